"""Query routing: LinearSVC over char n-grams, trained from rules/router_queries.tsv; accuracy on a
held-out split per language, the pickle cache keyed by the data, and the `deskeye route` command."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deskeye.ask import router as router_module
from deskeye.cli import main as deskeye_main
from deskeye.errors import RouterDataError
from deskeye.ask.router import TIERS, Router, find_data_file, load_examples, score_predictions
from deskeye.settings import package_rules_dir, RouterSettings, Settings
from tests.fixtures.small_fs import full_filesystem  # noqa: F401 - a fixture

pytestmark = [pytest.mark.subprocess]

HELD_OUT_FRACTION = 0.25


@pytest.fixture(scope="module")
def examples():
    return load_examples(find_data_file(package_rules_dir()))


def test_data_is_large_bilingual_and_balanced(examples):
    assert len(examples) >= 300
    for lang in ("en", "zh"):
        share = sum(e.lang == lang for e in examples) / len(examples)
        assert 0.4 <= share <= 0.6, f"{lang} share {share:.2f}"
        for tier in TIERS:
            assert sum(e.lang == lang and e.tier == tier for e in examples) >= 40, (lang, tier)
    assert len({e.query.casefold() for e in examples}) == len(examples), "duplicate queries"


@pytest.mark.slow
def test_held_out_accuracy_is_at_least_90_percent_in_each_language(examples):
    from sklearn.model_selection import train_test_split
    strata = [f"{e.tier}/{e.lang}" for e in examples]
    train, test = train_test_split(examples, test_size=HELD_OUT_FRACTION, stratify=strata, random_state=0)
    router = Router.from_examples(train)
    scores = score_predictions(test, [router.route(e.query).tier for e in test])
    report = {k: f"{s.accuracy:.3f} ({s.num_correct}/{s.num_total})" for k, s in sorted(scores.items())}
    print(f"\nheld-out accuracy ({len(test)} queries never trained on): {report}")
    assert scores["lang:en"].accuracy >= 0.9, report
    assert scores["lang:zh"].accuracy >= 0.9, report
    assert scores["overall"].accuracy >= 0.9, report


def test_confidence_is_the_softmax_of_the_decision_values(examples):
    router = Router.from_examples(examples)
    route = router.route("现在几点了")
    assert route.tier == "quick" and 1 / 3 < route.confidence < 1
    scores = router._pipeline.decision_function(["现在几点了"])[0]
    assert route.confidence == pytest.approx(max(router_module._softmax(scores)))
    assert router.route("   ") == router_module.Route("standard", 0.0)


def test_low_confidence_falls_back_to_standard(examples):
    strict = Router.from_examples(examples, min_confidence=0.999)
    route = strict.route("what time is it")
    assert (route.tier, route.fell_back) == ("standard", True)
    assert strict.route("what is this error").tier == "standard"


def _copy_rules(tmp_path: Path) -> Settings:
    rules = tmp_path / "rules"
    rules.mkdir()
    shutil.copy(package_rules_dir() / "router_queries.tsv", rules)
    return Settings(router=RouterSettings(data_dir=str(rules)))


def test_cache_is_reused_and_retrained_when_the_data_changes(tmp_path, monkeypatch):
    settings, cache = _copy_rules(tmp_path), tmp_path / "cache"
    first = Router.load(settings, cache_dir=cache)
    [cached] = cache.glob("router-*.pkl")

    def no_training(examples):
        raise AssertionError("retrained although the data did not change")
    monkeypatch.setattr(router_module, "train_pipeline", no_training)
    assert Router.load(settings, cache_dir=cache).route("summarise this document").tier == \
        first.route("summarise this document").tier == "deep"
    monkeypatch.undo()

    data = settings.rules_dir / "router_queries.tsv"
    data.write_text(data.read_text(encoding="utf-8") + "quick\twhat is the moon phase today\n", encoding="utf-8")
    Router.load(settings, cache_dir=cache)
    [new] = cache.glob("router-*.pkl")
    assert new.name != cached.name          # a new key; the stale pickle is gone


def test_broken_cache_is_retrained(tmp_path):
    settings, cache = _copy_rules(tmp_path), tmp_path / "cache"
    Router.load(settings, cache_dir=cache)
    [cached] = cache.glob("router-*.pkl")
    cached.write_bytes(b"not a pickle")
    assert Router.load(settings, cache_dir=cache).route("what time is it").tier == "quick"


def test_cache_write_on_a_full_disk_leaves_no_temp_file_and_routes_anyway(tmp_path, full_filesystem, caplog):
    settings, cache = _copy_rules(tmp_path), full_filesystem.root / "cache"
    assert Router.load(settings, cache_dir=cache).route("what time is it").tier == "quick"
    assert full_filesystem.entries(cache) == []             # no .router-* temp file, no empty or partial pickle
    assert "could not cache the router" in caplog.text and "No space left on device" in caplog.text

    full_filesystem.free()
    assert Router.load(settings, cache_dir=cache).route("what time is it").tier == "quick"
    [cached] = full_filesystem.entries(cache)
    assert re.fullmatch(r"router-[0-9a-f]{20}\.pkl", cached)


@pytest.mark.slow
def test_cache_write_past_a_file_size_limit_leaves_no_temp_file(tmp_path):
    from tests.fixtures.small_fs import FSIZE_LIMIT_PRELUDE
    settings, cache = _copy_rules(tmp_path), tmp_path / "cache"
    script = FSIZE_LIMIT_PRELUDE + (
        "from pathlib import Path\nfrom deskeye.ask.router import Router\n"
        "from deskeye.settings import RouterSettings, Settings\n"
        f"settings = Settings(router=RouterSettings(data_dir={str(settings.rules_dir)!r}))\n"
        f"print(Router.load(settings, cache_dir=Path({str(cache)!r})).route('what time is it').tier)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "quick"
    assert "could not cache the router" in proc.stderr and "File too large" in proc.stderr
    assert sorted(p.name for p in cache.iterdir()) == []     # no .router-* temp file left behind


@pytest.mark.parametrize("line, reason", [
    ("urgent\twhat now", "unknown tier 'urgent'"),
    ("quick", "expected 'tier'"),
    ("deep\t   ", "expected 'tier'"),
])
def test_bad_data_names_the_file_and_line(tmp_path, line, reason):
    path = tmp_path / "router_queries.tsv"
    path.write_text(f"tier\tquery\nquick\twhat time is it\n{line}\n", encoding="utf-8")
    with pytest.raises(RouterDataError) as caught:
        load_examples(path)
    assert str(caught.value).startswith(f"{path}, line 3:") and reason in str(caught.value)


def test_missing_data_says_where_it_looked(tmp_path):
    with pytest.raises(RouterDataError, match="router.data_dir"):
        find_data_file(tmp_path)


def test_import_trains_nothing_and_loads_no_sklearn():
    code = "import sys, deskeye.ask.router; print('sklearn' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.slow
def test_route_json_command_prints_one_json_line_per_query(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "deskeye.cli", "--settings", str(tmp_path / "none.toml"), "route", "--json",
         "现在几点了", "what is this error"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [sorted(line) for line in lines] == [["confidence", "query", "tier"]] * 2
    assert [(line["query"], line["tier"]) for line in lines] == \
        [("现在几点了", "quick"), ("what is this error", "standard")]
    assert all(isinstance(line["confidence"], float) and 0 < line["confidence"] <= 1 for line in lines)
    assert list((tmp_path / "cache" / "deskeye").glob("router-*.pkl"))   # trained once, cached


def test_route_plain_command_prints_a_line_per_query(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["--settings", str(tmp_path / "none.toml"), "route", "summarise this document", "有新邮件吗"]
    assert deskeye_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["deep", "quick"]
    assert [line.split(maxsplit=2)[2] for line in lines] == ["summarise this document", "有新邮件吗"]


@pytest.mark.slow
def test_route_evaluate_prints_accuracy_per_tier_and_language(tmp_path, capsys):
    assert deskeye_main(["--settings", str(tmp_path / "none.toml"), "route", "--evaluate"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(quick|standard|deep|lang:en|lang:zh|overall)\s+\d+\s+([01]\.\d{3})$", out, re.M))
    assert sorted(rows) == sorted(["quick", "standard", "deep", "lang:en", "lang:zh", "overall"]), out
    assert all(float(v) >= 0.85 for v in rows.values()), out
    print(out)


def test_route_without_queries_is_a_usage_error(tmp_path, capsys):
    assert deskeye_main(["--settings", str(tmp_path / "none.toml"), "route"]) == 2
    assert "give at least one QUERY" in capsys.readouterr().err
