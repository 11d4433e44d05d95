"""A long prompt's prefill in pieces against one forward, and how soon a cancelled one frees the model thread (the
batch decoder's model-thread work only, no HTTP): the tiny random Idefics3 with a 128K context, text-only prompts.

Per prompt length (tokens), a prepared request is prefilled (max_tokens 1)
- "one forward": the whole prompt at once (what the decoder did before prompts went in pieces);
- "pieces": `PREFILL_CHUNK_TOKENS` tokens of text per forward, each on the cache the ones before filled;
median of --repeats, alternating, 1 torch thread. Then the same prompt is prefilled in pieces and its `cancelled`
event is set as the piece halfway through begins: "freed after" is how long the decoder still kept the model thread
(that one piece; a piece later in the prompt attends to more keys and takes longer). On this tiny model
attention dominates and a piece's explicit mask costs it the fused causal kernel, so pieces cost a multiple of one
forward here; a real model's weights dominate a prefill and prompts are bounded by its context.

    .venv/bin/python -m benchmarks.prefill_pieces [--tokens 2000,8000,16000,32000] [--repeats 3] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import write_result

DEFAULT_JSON_OUT = Path("benchmarks/results/prefill_pieces.json")
CONTEXT_TOKENS = 131_072
SENTENCE = "The quick brown fox jumps over the lazy dog. "


def build_engine(folder: Path):
    from inference_worker.engines import EngineOptions, load_hf_engine
    from tests.fixtures.tiny_models import build_tiny_idefics3

    checkpoint = build_tiny_idefics3(folder / "idefics3_long", text_overrides={"max_position_embeddings":
                                                                               CONTEXT_TOKENS})
    return load_hf_engine(str(checkpoint), EngineOptions(device="cpu", num_threads=1), progress=False)


def prepared(engine, num_tokens: int):
    """A text-only request of about `num_tokens` tokens, prepared as the service would."""
    from inference_worker.protocol import parse_chat_request

    words, item = max(1, num_tokens // 12), None
    while item is None or item.inputs.num_tokens < num_tokens:
        text = "".join(f"{i % 97} {SENTENCE}" for i in range(words))
        item = engine.prepare(parse_chat_request({"messages": [{"role": "user", "content": text}],
                                                  "max_tokens": 1}))
        words = int(words * 1.1) + 1
    return item


def prefill_s(engine, item, chunk_tokens: int) -> float:
    engine.decoder.forward.chunk_tokens = chunk_tokens
    started = time.perf_counter()
    engine.decoder.run([engine.decoder_row(item)], lambda index, result: None)
    return time.perf_counter() - started


def freed_after_s(engine, item) -> float:
    """Seconds the decoder kept the model thread after the row's cancelled event was set, which happens as the piece
    halfway through its prefill starts (the worst moment: a whole piece still to run)."""
    from inference_worker.engines.hf.model_forward import PREFILL_CHUNK_TOKENS

    decoder, forward = engine.decoder, engine.decoder.forward
    forward.chunk_tokens = PREFILL_CHUNK_TOKENS
    row = engine.decoder_row(item)
    halfway = len(forward.prefill_pieces(item.inputs.all_ids())) // 2 + 1
    calls, cancelled_at = [], []
    forward_once = forward._once

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == halfway:
            cancelled_at.append(time.perf_counter())
            row.cancelled.set()
        return forward_once(*args, **kwargs)
    outcomes: list = []
    forward._once = counted
    try:
        decoder.run([row], lambda index, outcome: outcomes.append(outcome))
    finally:
        del forward._once
    ended = time.perf_counter()
    if not cancelled_at or type(outcomes[0]).__name__ != "RowCancelled":
        raise RuntimeError(f"the row was not cancelled mid-prefill: {outcomes}")
    return ended - cancelled_at[0]


def measure(engine, num_tokens: int, repeats: int) -> dict[str, Any]:
    from inference_worker.engines.hf.model_forward import PREFILL_CHUNK_TOKENS

    item = prepared(engine, num_tokens)
    whole, pieces = [], []
    for _ in range(repeats):
        whole.append(prefill_s(engine, item, 10**9))
        pieces.append(prefill_s(engine, item, PREFILL_CHUNK_TOKENS))
    pieces_s = statistics.median(pieces)
    return {"prompt_tokens": item.inputs.num_tokens, "chunk_tokens": PREFILL_CHUNK_TOKENS,
            "one_forward_s": round(statistics.median(whole), 3), "pieces_s": round(pieces_s, 3),
            "num_pieces": len(engine.decoder.forward.prefill_pieces(item.inputs.all_ids())),
            "freed_after_s": round(freed_after_s(engine, item), 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2000,8000,16000,32000", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.tokens.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="deskeye-prefill-pieces-") as folder:
        engine = build_engine(Path(folder))
        try:
            print(f"{'tokens':>7} {'pieces':>6} {'one forward s':>13} {'in pieces s':>11} {'ratio':>6} "
                  f"{'freed after s':>13}")
            for num_tokens in lengths:
                row = measure(engine, num_tokens, args.repeats)
                results.append(row)
                print(f"{row['prompt_tokens']:>7} {row['num_pieces']:>6} {row['one_forward_s']:>13.2f} "
                      f"{row['pieces_s']:>11.2f} {row['pieces_s'] / row['one_forward_s']:>6.1f} "
                      f"{row['freed_after_s']:>13.3f}", flush=True)
        finally:
            engine.close()
    write_result(args.json_out, {"benchmark": "prefill_pieces", "model": "tiny Idefics3, 128K context",
                                 "repeats": args.repeats, "torch_threads": 1, "results": results})


if __name__ == "__main__":
    main()
