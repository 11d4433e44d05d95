"""Latency of the quick tier: the router (train vs cached load vs one route) and each quick provider.

    .venv/bin/python -m benchmarks.quick_answers [--repeats 20] [--json-out PATH]

Measured side by side in one run, wall-clock milliseconds (median and max of N): training the
LinearSVC from rules/ vs loading the cached pickle (their ratio), routing one query, and answering
with each provider — clock, calendar (a generated .ics with recurring events), system figures (CPU
includes its 0.2 s sampling window), screen memory. Mail needs an IMAP server and is left out here
(tests/test_mail_provider.py runs it against dovecot). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

from benchmarks._results import write_result
from zoneinfo import ZoneInfo

DEFAULT_JSON_OUT = Path("benchmarks/results/quick_answers.json")
QUERIES = {
    "clock": ["what time is it", "今天星期几"],
    "calendar": ["when is my next meeting", "am I free at 4pm", "今天下午有会吗"],
    "system": ["battery level?", "内存用了多少", "how much disk space is left", "cpu usage"],
    "memory": ["what did you see last time", "刚才看到了什么"],
}


def timed_ms(action, repeats: int) -> dict:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return {"median_ms": round(statistics.median(samples), 3), "max_ms": round(max(samples), 3), "n": repeats}


def write_calendar(path: Path, num_events: int) -> None:
    start = datetime(2025, 6, 2, 8, 0)
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//DeskEye bench//EN"]
    for i in range(num_events):
        begin = start + timedelta(hours=3 * i)
        rule = ["RRULE:FREQ=WEEKLY;BYDAY=MO,WE,FR"] if i % 10 == 0 else []
        lines += ["BEGIN:VEVENT", f"UID:{i}@bench", f"SUMMARY:Event {i}",
                  f"DTSTART;TZID=Europe/Berlin:{begin:%Y%m%dT%H%M%S}",
                  f"DTEND;TZID=Europe/Berlin:{begin + timedelta(minutes=45):%Y%m%dT%H%M%S}", *rule, "END:VEVENT"]
    path.write_text("\r\n".join(lines + ["END:VCALENDAR"]) + "\r\n", encoding="utf-8")


def bench_router(repeats: int, cache_dir: Path) -> dict:
    from deskeye.ask import router
    from deskeye.settings import Settings
    settings = Settings()
    examples = router.load_examples(router.find_data_file(settings.rules_dir))
    train = timed_ms(lambda: router.train_pipeline(examples), max(3, repeats // 5))
    router.Router.load(settings, cache_dir=cache_dir)               # writes the cache
    cached = timed_ms(lambda: router.Router.load(settings, cache_dir=cache_dir), repeats)
    loaded = router.Router.load(settings, cache_dir=cache_dir)
    route = timed_ms(lambda: loaded.route("am I free at 4pm"), repeats)
    return {"train": train, "cached_load": cached, "route_one_query": route,
            "train_vs_cached_ratio": round(train["median_ms"] / cached["median_ms"], 1)}


def bench_providers(repeats: int, ics: Path) -> dict:
    from deskeye.ask.providers import QuickAnswerer, ScreenMemory
    from deskeye.settings import ProviderSettings, Settings
    from deskeye.prompt import Description
    memory = ScreenMemory()
    memory.remember(Description("An editor with main.py", ["main.py", "Run"]))
    answerer = QuickAnswerer(Settings(providers=ProviderSettings(calendar_ics=str(ics))), memory)
    now = datetime(2025, 6, 4, 14, 5, tzinfo=ZoneInfo("Europe/Berlin"))
    results = {}
    for provider, queries in QUERIES.items():
        for query in queries:
            assert answerer.answer(query, now=now).provider == provider, query
            results[f"{provider}: {query}"] = timed_ms(lambda q=query: answerer.answer(q, now=now), repeats)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--events", type=int, default=300, help="events in the generated calendar")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ics = Path(tmp) / "bench.ics"
        write_calendar(ics, args.events)
        report = {"router": bench_router(args.repeats, Path(tmp) / "cache"),
                  "providers": bench_providers(args.repeats, ics), "calendar_events": args.events}
    print(f"{'what':<48} {'median ms':>10} {'max ms':>10}")
    for name in ("train", "cached_load", "route_one_query"):
        row = report["router"][name]
        print(f"{'router: ' + name:<48} {row['median_ms']:>10.2f} {row['max_ms']:>10.2f}")
    print(f"{'router: train / cached load':<48} {report['router']['train_vs_cached_ratio']:>10.1f}x")
    for name, row in report["providers"].items():
        print(f"{name:<48} {row['median_ms']:>10.2f} {row['max_ms']:>10.2f}")
    write_result(args.json_out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
