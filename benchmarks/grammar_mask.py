"""Per-step cost of the JSON-schema grammar in a decode loop: the first GrammarLogitsProcessor against
GrammarBatch (full masks computed inline, prefetched on a thread during the forward, or lazily for greedy
rows), next to the tiny Idefics3's own decode step.

A trace is recorded first: a greedy decode of random logits under DeskEye's schema, one row per batch row (a row
leaves the batch when it samples EOS), keeping each step's token, unmasked argmax and masks. Every configuration
then replays that whole trace, in a shuffled order, --repeats times (median), between real 1-token forwards of
the tiny fixture model with a DynamicCache (1 torch thread): one mask and one token per row per step, and the
model's caches cooled by the grammar's work as in the worker. The replayed logits put 1.0 on the step's unmasked
argmax and 0.5 on the token the trace took, so every configuration's masked argmax must give the trace's tokens
(checked); "lazy, JSON model" puts 1.0 on the trace's token, as a model that writes JSON would.
Vocabularies: the fixture's tokenizer (~1k), and synthetic byte-level BPE tokenizers of 32k and 151k tokens
(Qwen3's size) trained here, nothing downloaded.

    .venv/bin/python -m benchmarks.grammar_mask [--vocabs tiny,32k,151k] [--repeats 3] [--json-out PATH]

The "old processor" is inference_worker/grammar.py as of commit BASELINE_COMMIT, read from git.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks._results import write_result
from typing import Any, Callable

DEFAULT_JSON_OUT = Path("benchmarks/results/grammar_mask.json")
REPO_ROOT = Path(__file__).resolve().parents[1]
BASELINE_COMMIT = "2f0e40b"          # grammar.py with the first GrammarLogitsProcessor (before GrammarBatch)
BATCH_SIZES = (1, 8)
SYNTHETIC_VOCABS = {"32k": 32_000, "151k": 151_643}     # Qwen3: 151,643 tokens, lm_head 151,936
QWEN_LM_HEAD = 151_936
PROMPT_TOKENS = 64
NO_GRAMMAR = "no grammar"
GRAMMAR_MODES = ("old processor", "batch", "batch prefetch", "lazy greedy", "lazy, JSON model")
SEED = 7


@dataclass
class Vocab:
    name: str
    tokenizer: Any
    lm_head_size: int


@dataclass
class Trace:
    """A recorded decode: per row its tokens and per step the unmasked argmax; per step the packed masks."""
    tokens: list[list[int]]
    raw_argmax: list[list[int]]
    masks: list = field(repr=False)

    @property
    def num_steps(self) -> int:
        return max(map(len, self.tokens))

    def live_rows(self, index: int) -> list[int]:
        return [row for row, tokens in enumerate(self.tokens) if index < len(tokens)]


@dataclass
class Row:
    vocab: str
    vocab_size: int
    batch_size: int
    steps: int
    free_step_ms: float                     # mean ms per decode step without a grammar
    grammar_ms: dict[str, float]            # per mode: mean grammar ms per step on the decode thread
    step_ratio: dict[str, float]            # per mode: mean step wall time with the grammar / without


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", default="tiny,32k,151k",
                        help="comma-separated: tiny (the fixture tokenizer), 32k, 151k (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="replays of each trace (median; default 3)")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    args.vocabs = [v.strip() for v in args.vocabs.split(",") if v.strip()]
    unknown = set(args.vocabs) - {"tiny", *SYNTHETIC_VOCABS}
    if unknown or not args.vocabs:
        parser.error(f"--vocabs: unknown {sorted(unknown)}; choose from tiny, {', '.join(SYNTHETIC_VOCABS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


# ---------------------------------------------------------------- vocabularies

def synthetic_tokenizer(num_tokens: int):
    """A byte-level BPE tokenizer of `num_tokens` trained on pseudo-words, with Qwen-like special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiouy"] + list("aeiou")
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 5)))
                    for _ in range(num_tokens * 2)})
    lines = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(num_tokens * 2 // 3)]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|reserved_{i}|>" for i in range(20))]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(lines, trainer=trainers.BpeTrainer(
        vocab_size=num_tokens, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=specials[3:])


def load_vocab(name: str, model_dir: Path) -> Vocab:
    if name == "tiny":
        from transformers import AutoConfig, AutoProcessor
        lm_head_size = AutoConfig.from_pretrained(model_dir).text_config.vocab_size
        return Vocab("tiny fixture", AutoProcessor.from_pretrained(model_dir).tokenizer, lm_head_size)
    tokenizer = synthetic_tokenizer(SYNTHETIC_VOCABS[name])
    lm_head_size = QWEN_LM_HEAD if name == "151k" else len(tokenizer)
    return Vocab(f"synthetic {name}", tokenizer, lm_head_size)


def load_baseline() -> types.ModuleType | None:
    """inference_worker/grammar.py at BASELINE_COMMIT as a module, or None when git cannot show it."""
    shown = subprocess.run(["git", "show", f"{BASELINE_COMMIT}:inference_worker/grammar.py"], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    if shown.returncode != 0:
        print(f"old processor not measured: git show {BASELINE_COMMIT} failed: {shown.stderr.strip()}")
        return None
    module = types.ModuleType("grammar_baseline")
    exec(compile(shown.stdout, f"{BASELINE_COMMIT}:inference_worker/grammar.py", "exec"), module.__dict__)
    return module


# ---------------------------------------------------------------- the trace

def record_trace(grammars, batch_size: int) -> Trace:
    """A greedy decode of random logits through a GrammarBatch, every row following DeskEye's schema."""
    import numpy as np
    import torch

    from deskeye.prompt import DESKEYE_SCHEMA

    batch = grammars.batch([DESKEYE_SCHEMA] * batch_size, prefetch=False)
    generator = torch.Generator().manual_seed(SEED)
    eos, live = grammars.eos_token_ids[0], list(range(batch_size))
    trace = Trace([[] for _ in live], [[] for _ in live], [])
    while live:
        logits = torch.randn(len(live), grammars.vocab_size, generator=generator)
        raw_argmax = logits.argmax(-1).tolist()
        batch.apply(logits, live)
        allowed = np.packbits(torch.isfinite(logits).numpy(), axis=1, bitorder="little")
        trace.masks.append(np.pad(allowed, ((0, 0), (0, -allowed.shape[1] % 4))).view(np.int32))
        sampled = logits.argmax(-1).tolist()
        batch.advance(live, sampled)
        for row, token, raw in zip(live, sampled, raw_argmax):
            trace.tokens[row].append(token)
            trace.raw_argmax[row].append(raw)
        live = [row for row, token in zip(live, sampled) if token != eos]
    return trace


def stand_in_logits(logits, trace: Trace, index: int, rows: list[int], *, json_model: bool = False) -> None:
    """In place: 1.0 on each row's unmasked argmax at step `index`, 0.5 on the token the trace took, else 0.
    `json_model`: 1.0 on the trace's token, as from a model whose argmax follows the schema."""
    logits.zero_()
    for line, row in enumerate(rows):
        step = min(index, len(trace.tokens[row]) - 1)        # a finished row (old processor): its last step
        logits[line, trace.tokens[row][step]] = 0.5
        logits[line, trace.tokens[row][step] if json_model else trace.raw_argmax[row][step]] = 1.0


def check_tokens(picked: list[int], trace: Trace, index: int, rows: list[int]) -> None:
    expected = [trace.tokens[row][index] for row in rows]
    if picked != expected:
        raise AssertionError(f"step {index}: masked argmax {picked} != the trace's tokens {expected}")


# ---------------------------------------------------------------- the decode loops being measured


class DecodeStep:
    """1-token forwards of the tiny model for a batch, continuing a DynamicCache filled by a prompt."""

    def __init__(self, model: Any, batch_size: int):
        import torch
        from transformers import DynamicCache

        self.model, self.torch = model, torch
        self.next_ids = torch.full((batch_size, 1), 5, dtype=torch.long)
        prompt = torch.randint(5, 500, (batch_size, PROMPT_TOKENS), generator=torch.Generator().manual_seed(SEED))
        self.cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=prompt, past_key_values=self.cache, use_cache=True)

    def __call__(self) -> None:
        with self.torch.inference_mode():
            self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)


class Timer:
    """Sorts a step's time: grammar calls, and the benchmark's own bookkeeping (left out of the step)."""

    def __init__(self):
        self.grammar_s = self.untimed_s = 0.0

    def grammar(self, call: Callable[[], Any]) -> Any:
        return self._timed(call, "grammar_s")

    def untimed(self, call: Callable[[], Any]) -> Any:
        return self._timed(call, "untimed_s")

    def _timed(self, call, attribute: str):
        started = time.perf_counter()
        try:
            return call()
        finally:
            setattr(self, attribute, getattr(self, attribute) + time.perf_counter() - started)


def batch_loop(grammars, trace: Trace, *, prefetch: bool = False, lazy_greedy: bool = False,
               json_model: bool = False):
    """The batched decode loop's use of GrammarBatch: advance(previous rows, their tokens), forward,
    apply(rows still running); `json_model`: logits whose argmax the grammar accepts (see stand_in_logits)."""
    import torch

    from inference_worker.engines.hf.sampling import argmax_lines
    from deskeye.prompt import DESKEYE_SCHEMA

    batch = grammars.batch([DESKEYE_SCHEMA] * len(trace.tokens), prefetch=prefetch)
    logits = torch.zeros(len(trace.tokens), grammars.vocab_size)

    def step(index: int, forward: Callable[[], None], timer: Timer) -> None:
        if index > 0:
            previous = trace.live_rows(index - 1)
            timer.grammar(lambda: batch.advance(previous, [trace.tokens[row][index - 1] for row in previous]))
        forward()
        rows = trace.live_rows(index)
        lines = logits[: len(rows)]
        timer.untimed(lambda: stand_in_logits(lines, trace, index, rows, json_model=json_model))
        if lazy_greedy:                 # apply returns the argmax (and its time counts as the grammar's)
            picked = timer.grammar(lambda: batch.apply(lines, rows, greedy=[True] * len(rows)))
        else:
            timer.grammar(lambda: batch.apply(lines, rows))
            picked = argmax_lines(lines)
        timer.untimed(lambda: check_tokens(picked, trace, index, rows))
    return step, batch.close


def free_loop(vocab_size: int, trace: Trace):
    """The same loop without a grammar: forward, (untimed) stand-in logits, argmax (every loop picks tokens
    with the same argmax_lines, so that only the grammar differs)."""
    import torch

    from inference_worker.engines.hf.sampling import argmax_lines

    logits = torch.zeros(len(trace.tokens), vocab_size)

    def step(index: int, forward: Callable[[], None], timer: Timer) -> None:
        forward()
        rows = trace.live_rows(index)
        lines = logits[: len(rows)]
        timer.untimed(lambda: stand_in_logits(lines, trace, index, rows))
        argmax_lines(lines)
    return step, lambda: None


def old_loop(old_grammars, trace: Trace):
    """The first processor as generate drives it: every row every step, finished rows padded with EOS."""
    import torch

    from inference_worker.engines.hf.sampling import argmax_lines
    from deskeye.prompt import DESKEYE_SCHEMA

    processor = old_grammars.logits_processor(DESKEYE_SCHEMA, len(trace.tokens))
    eos, num_rows = old_grammars.eos_token_ids[0], len(trace.tokens)
    padded = torch.tensor([tokens + [eos] * (trace.num_steps - len(tokens)) for tokens in trace.tokens])
    logits = torch.zeros(num_rows, old_grammars.vocab_size)

    def step(index: int, forward: Callable[[], None], timer: Timer) -> None:
        forward()
        rows = trace.live_rows(index)
        timer.untimed(lambda: stand_in_logits(logits, trace, index, list(range(num_rows))))
        scores = timer.grammar(lambda: processor(padded[:, :index], logits))
        picked = argmax_lines(scores)
        timer.untimed(lambda: check_tokens([picked[row] for row in rows], trace, index, rows))
    return step, lambda: None


def replay(make_loop, forward: DecodeStep, trace: Trace) -> tuple[float, float]:
    """(grammar s, step s without the bookkeeping) over one replay of the whole trace."""
    step, close = make_loop()
    grammar_s = step_s = 0.0
    for index in range(trace.num_steps):
        timer, started = Timer(), time.perf_counter()
        step(index, forward, timer)
        grammar_s += timer.grammar_s
        step_s += time.perf_counter() - started - timer.untimed_s
    close()
    return grammar_s, step_s


def measure(model, vocab: Vocab, baseline, *, batch_size: int, repeats: int) -> tuple[Trace, Row]:
    from inference_worker.engines.hf.grammar import SchemaGrammars

    eos_ids = [vocab.tokenizer.convert_tokens_to_ids(vocab.tokenizer.eos_token)]
    grammars = SchemaGrammars(vocab.tokenizer, vocab_size=vocab.lm_head_size, eos_token_ids=eos_ids)
    old_grammars = None if baseline is None else baseline.SchemaGrammars(
        vocab.tokenizer, vocab_size=vocab.lm_head_size, eos_token_ids=eos_ids)
    trace = record_trace(grammars, batch_size)
    makers = {NO_GRAMMAR: lambda: free_loop(grammars.vocab_size, trace),
              "old processor": lambda: old_loop(old_grammars, trace),
              "batch": lambda: batch_loop(grammars, trace),
              "batch prefetch": lambda: batch_loop(grammars, trace, prefetch=True),
              "lazy greedy": lambda: batch_loop(grammars, trace, lazy_greedy=True),
              "lazy, JSON model": lambda: batch_loop(grammars, trace, lazy_greedy=True, json_model=True)}
    modes = [NO_GRAMMAR, *(m for m in GRAMMAR_MODES if m != "old processor" or old_grammars is not None)]
    per_mode: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    order = random.Random(SEED)
    for repeat in range(repeats + 1):                       # the first round warms up, not counted
        for mode in order.sample(modes, len(modes)):
            grammar_s, step_s = replay(makers[mode], DecodeStep(model, batch_size), trace)
            if repeat:
                per_mode[mode].append((grammar_s * 1000 / trace.num_steps, step_s * 1000 / trace.num_steps))
    grammars.close()
    median = {mode: (statistics.median(g for g, _ in runs), statistics.median(s for _, s in runs))
              for mode, runs in per_mode.items()}
    free_step_ms = median[NO_GRAMMAR][1]
    return trace, Row(vocab.name, vocab.lm_head_size, batch_size, trace.num_steps, round(free_step_ms, 3),
                      {m: round(median[m][0], 4) for m in modes[1:]},
                      {m: round(median[m][1] / free_step_ms, 3) for m in modes[1:]})


# ---------------------------------------------------------------- applying a packed mask

def mask_kernels(masks: list, vocab_size: int) -> dict[str, float]:
    """Mean µs per decode step of ways to apply a step's packed masks (bit set = allowed; the rows still
    running) to CPU float32 logits, over the masks a real decode produced (a random bitmask would be unfair
    to masked_fill_, whose per-token branch then mispredicts half the time)."""
    import llguidance.numpy
    import llguidance.torch
    import numpy as np
    import torch

    from inference_worker.engines.hf.token_mask import fill_banned_words, unpack_words

    logits = torch.zeros(len(masks[0]), vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)

    def torch_shifts(words):       # the first processor: unpack with torch shifts, out-of-place fill
        allowed = ((torch.from_numpy(words).unsqueeze(-1) >> shifts) & 1).reshape(len(words), -1).bool()
        logits[: len(words)].masked_fill(~allowed[:, :vocab_size], float("-inf"))

    def numpy_unpackbits(words):   # GrammarBatch below WORD_FILL_MIN_VOCAB (and on CUDA)
        banned = torch.from_numpy(unpack_words(np.invert(words), vocab_size))
        logits[: len(words)].masked_fill_(banned, float("-inf"))

    def word_fill(words):          # GrammarBatch on the CPU from WORD_FILL_MIN_VOCAB on
        fill_banned_words(logits[: len(words)], np.invert(words))

    kernels = {"first processor: torch shifts + masked_fill": torch_shifts,
               "numpy unpackbits + masked_fill_": numpy_unpackbits}
    if vocab_size == masks[0].shape[1] * 32:
        kernels["word fill (index_fill_ per 32 tokens)"] = word_fill
    kernels["llguidance.numpy.apply_token_bitmask_inplace"] = \
        lambda words: llguidance.numpy.apply_token_bitmask_inplace(logits[: len(words)].numpy(), words)
    kernels["llguidance.torch.apply_token_bitmask_inplace (torch.compile)"] = \
        lambda words: llguidance.torch.apply_token_bitmask_inplace(logits[: len(words)], torch.from_numpy(words))
    timings = {}
    for name, kernel in kernels.items():
        try:
            for words in masks:                                   # warm-up (and torch.compile's compiles)
                kernel(words)
        except Exception as exc:   # torch.compile needs a C compiler; say so rather than stop the benchmark
            print(f"{name}: not measured ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        started = time.perf_counter()
        for words in masks:
            kernel(words)
        timings[name] = round((time.perf_counter() - started) * 1e6 / len(masks), 1)
    return timings


# ---------------------------------------------------------------- output

def print_table(rows: list[Row]) -> None:
    modes = list(rows[0].grammar_ms)
    print("grammar ms per decode step on the decode thread (% of a step without a grammar, free ms); the lazy")
    print("modes' time includes the argmax apply returns, which the other loops compute outside the grammar:")
    header = f"{'vocab':<15} {'lm_head':>7} {'batch':>5} {'steps':>5} {'free ms':>7}" + "".join(
        f" {m:>18}" for m in modes)
    print(header)
    print("-" * len(header))
    for r in rows:
        cells = "".join(f" {f'{r.grammar_ms[m]:.3f} ({100 * r.grammar_ms[m] / r.free_step_ms:.0f}%)':>18}"
                        for m in modes)
        print(f"{r.vocab:<15} {r.vocab_size:>7} {r.batch_size:>5} {r.steps:>5} {r.free_step_ms:>7.3f}{cells}")
    print("\nstep wall time with the grammar / without:")
    print(f"{'vocab':<15} {'batch':>5}" + "".join(f" {m:>18}" for m in modes))
    for r in rows:
        print(f"{r.vocab:<15} {r.batch_size:>5}" + "".join(f" {r.step_ratio[m]:>18.2f}" for m in modes))


def print_kernels(kernels: dict[str, dict[str, float]]) -> None:
    print("\napplying a step's packed masks to CPU logits, mean µs per step (masks of the traces above):")
    for shape, timings in kernels.items():
        for name, us in timings.items():
            print(f"  {shape:<26} {name:<62} {us:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import llguidance
    import torch
    from transformers import AutoModelForImageTextToText

    from tests.fixtures.tiny_models import build_tiny_idefics3

    torch.set_num_threads(1)
    baseline = load_baseline()
    rows, kernels = [], {}
    with tempfile.TemporaryDirectory(prefix="deskeye-bench-") as tmp:
        model_dir = build_tiny_idefics3(Path(tmp) / "tiny_idefics3")
        model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        for name in args.vocabs:
            started = time.perf_counter()
            vocab = load_vocab(name, model_dir)
            print(f"{vocab.name}: {len(vocab.tokenizer)} tokens, lm_head {vocab.lm_head_size} "
                  f"(ready in {time.perf_counter() - started:.1f} s)", flush=True)
            for batch_size in BATCH_SIZES:
                trace, row = measure(model, vocab, baseline, batch_size=batch_size, repeats=args.repeats)
                rows.append(row)
                kernels[f"{vocab.name}, batch {batch_size}"] = mask_kernels(trace.masks, vocab.lm_head_size)
    print()
    print_table(rows)
    print_kernels(kernels)
    result = {
        "benchmark": "grammar_mask", "model": "tiny random Idefics3 (tests/fixtures), 1-token forward, DynamicCache",
        "threads": 1, "repeats": args.repeats, "baseline_commit": BASELINE_COMMIT if baseline else None,
        "torch": torch.__version__, "llguidance": llguidance.__version__,
        "statistic": "median over repeats of the mean per decode step; rows leave the batch at EOS",
        "rows": [asdict(r) for r in rows], "mask_kernels_us": kernels,
    }
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
