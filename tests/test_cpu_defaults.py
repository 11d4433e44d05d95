"""The worker's CPU defaults for a vision model: the dtype "auto" picks from the CPU's flags and the model's size
(bf16 where the CPU multiplies bf16 natively and the model is big enough to gain from it, fp32 elsewhere), and
MiniCPM-V 4.6's processor on a CPU cuts a frame into no more slices than its pixels fill. Speed itself is
benchmarks/real_size.py's to measure; these check the choices and that the worker's loader applies them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from benchmarks._harness import render_screen, to_png
from inference_worker.engines.hf import loading
from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.base import run_one
from tests.fixtures.chat_requests import chat_request

pytestmark = [pytest.mark.model]

#: /proc/cpuinfo excerpts (one core each; real files repeat the block per logical CPU)
SAPPHIRE_RAPIDS = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr avx avx2 avx512f avx512dq avx512bw avx512vl avx_vnni \
avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
bogomips	: 4000.00
"""
ZEN4 = """processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD Ryzen 7 7840U w/ Radeon 780M Graphics
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 \
avx512_vnni
"""
LAPTOP = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Core(TM) i7-8550U CPU @ 1.80GHz
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 fma
"""
ARM = """processor	: 0
BogoMIPS	: 243.75
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp bf16 i8mm
CPU implementer	: 0x41
"""
REAL_SIZE = 1_300_428_016          # MiniCPM-V 4.6
TINY = 170_000                     # the test fixtures
CPU = torch.device("cpu")


def auto_dtype(cpuinfo: str, num_params: int):
    return loading.resolve_dtype("auto", CPU, num_params=num_params, cpu_flags=loading.read_cpu_flags(cpuinfo))


@pytest.mark.parametrize("cpuinfo", [SAPPHIRE_RAPIDS, ZEN4], ids=["amx_bf16", "avx512_bf16"])
def test_auto_is_bf16_on_a_cpu_that_multiplies_bf16_natively(cpuinfo):
    assert auto_dtype(cpuinfo, REAL_SIZE) == torch.bfloat16


@pytest.mark.parametrize("cpuinfo", [LAPTOP, ARM, ""], ids=["avx2-laptop", "arm", "no-cpuinfo"])
def test_auto_is_fp32_on_a_cpu_without_native_bf16(cpuinfo):
    """Emulated bf16 is slower than fp32; Arm's bf16 path was never measured here, so it stays fp32."""
    assert auto_dtype(cpuinfo, REAL_SIZE) == torch.float32


def test_a_small_model_stays_fp32_even_where_bf16_is_native():
    """The tiny fixtures decoded 18-32% slower in bf16 on an AMX CPU, and fp32 keeps their numbers exact."""
    assert auto_dtype(SAPPHIRE_RAPIDS, TINY) == torch.float32
    assert auto_dtype(SAPPHIRE_RAPIDS, loading.MIN_CPU_BF16_PARAMS) == torch.bfloat16


def test_a_named_dtype_is_never_second_guessed():
    flags = loading.read_cpu_flags(SAPPHIRE_RAPIDS)
    assert loading.resolve_dtype("fp32", CPU, num_params=REAL_SIZE, cpu_flags=flags) == torch.float32
    assert loading.resolve_dtype("bf16", CPU, num_params=TINY, cpu_flags=frozenset()) == torch.bfloat16


def test_cpu_flags_are_read_from_every_flags_line_and_nothing_else():
    flags = loading.read_cpu_flags(SAPPHIRE_RAPIDS + "\n" + LAPTOP)
    assert {"amx_bf16", "avx512_bf16", "avx2", "fma"} <= flags
    assert "GenuineIntel" not in flags and "4000.00" not in flags and "Xeon(R)" not in flags
    assert "bf16" in loading.read_cpu_flags(ARM) and "asimd" in loading.read_cpu_flags(ARM)


def _cpuinfo_file(tmp_path, monkeypatch, text: str) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(loading, "CPUINFO_PATH", path, raising=False)


def test_the_loader_picks_the_dtype_from_this_cpu_and_the_checkpoint_size(tiny_idefics3_dir, tmp_path, monkeypatch):
    """Through the worker's own loader: /proc/cpuinfo (a file standing in for this machine's) and the parameters
    counted from the checkpoint decide "auto". The size floor is lowered to the fixture's size here, so that a
    model of real size need not be built."""
    _cpuinfo_file(tmp_path, monkeypatch, SAPPHIRE_RAPIDS)
    monkeypatch.setattr(loading, "MIN_CPU_BF16_PARAMS", 1_000, raising=False)
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    try:
        assert engine.model.dtype == torch.bfloat16
        answer = run_one(engine, chat_request(image_png=to_png(render_screen("bf16")), max_tokens=4)[0])
        assert answer.completion_tokens >= 1            # it serves in bf16
    finally:
        engine.close()

    _cpuinfo_file(tmp_path, monkeypatch, LAPTOP)
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    try:
        assert engine.model.dtype == torch.float32
    finally:
        engine.close()


def test_the_checkpoint_size_is_counted_from_its_tensors(tiny_idefics3_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_idefics3_dir)
    assert loading.num_checkpoint_params(tiny_idefics3_dir) == sum(p.numel() for p in model.state_dict().values())


# ---------------------------------------------------------------- MiniCPM-V 4.6's slicing on a CPU

@pytest.fixture(scope="module")
def slicing_minicpmv46_dir(tiny_minicpmv46_dir, tmp_path_factory):
    """The tiny MiniCPM-V 4.6 fixture with the real checkpoint's slicing (448-px slices, up to 9) and room in its
    context for them."""
    folder = tmp_path_factory.mktemp("slicing_minicpmv46") / "model"
    shutil.copytree(tiny_minicpmv46_dir, folder)
    processor_config = folder / "processor_config.json"
    saved = json.loads(processor_config.read_text(encoding="utf-8"))
    saved["image_processor"].update(scale_resolution=448, max_slice_nums=9, slice_mode=True)
    processor_config.write_text(json.dumps(saved), encoding="utf-8")
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["text_config"]["max_position_embeddings"] = 8192
    config_file.write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def minicpmv46_cpu_engine(slicing_minicpmv46_dir):
    engine = load_hf_engine(str(slicing_minicpmv46_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    yield engine
    engine.close()


def num_images(engine, size: tuple[int, int]) -> tuple[int, int]:
    """(images the processor made of one frame of `size`: the overview and its slices; prompt tokens)."""
    request, images = chat_request(image_png=to_png(render_screen(f"slices-{size}", size)), max_tokens=4)
    inputs = engine.prepare(request).inputs
    return int(inputs.vision["target_sizes"].shape[0]), inputs.num_tokens


@pytest.mark.slow
def test_on_a_cpu_the_default_region_gets_two_slices_not_four_upscaled_ones(minicpmv46_cpu_engine):
    """800x600 fills 2.4 slices of 448x448: the model's own grid search takes 2x2 slices of 400x300, each upscaled
    to ~518x388; on a CPU it gets 2 slices of 400x600 (0.9 of their pixels kept) and the overview: two fewer runs
    of the vision tower and ~120 fewer prompt tokens, for no pixel the model would not otherwise see."""
    engine = minicpmv46_cpu_engine
    cpu_images, cpu_tokens = num_images(engine, (800, 600))
    engine.processor.upscale_slices = True            # the model's own slicing, as on a GPU
    try:
        own_images, own_tokens = num_images(engine, (800, 600))
    finally:
        engine.processor.upscale_slices = False
    assert (cpu_images, own_images) == (3, 5)
    assert cpu_tokens < own_tokens


@pytest.mark.parametrize("size, expected", [((1920, 1080), 9), ((448, 336), 1), ((1280, 800), 7)])
def test_frames_that_fill_their_slices_keep_the_models_slicing(minicpmv46_cpu_engine, size, expected):
    """A full-HD frame fills 10 slices: capped at the model's 9 either way (8 slices and the overview); a frame
    smaller than a slice is one image; 1280x800 fills 5.1 slices and gets 6."""
    assert num_images(minicpmv46_cpu_engine, size)[0] == expected


@pytest.mark.slow
def test_the_cpu_worker_answers_about_a_sliced_frame(minicpmv46_cpu_engine):
    """The capped slices reach the model: it answers, and reports how long encoding the image took."""
    answer = run_one(minicpmv46_cpu_engine, chat_request(image_png=to_png(render_screen("answer")), max_tokens=4)[0])
    assert answer.completion_tokens >= 1
    timing = answer.facts.timing
    assert timing.vision_ms > 0 and timing.ttft_ms >= timing.vision_ms


@pytest.mark.slow
def test_a_gpu_keeps_the_models_own_slicing(slicing_minicpmv46_dir, monkeypatch):
    """The loader turns the cap on for a CPU only. CUDA cannot run here: the parts loader is called directly, with
    the weights' loading (onto a GPU this machine lacks) left out."""
    from inference_worker.engines.hf.minicpmv import load_minicpmv_parts

    monkeypatch.setattr(loading, "load_model_weights", lambda path, processor, **_: (None, processor))
    upscales = {}
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        _, processor = load_minicpmv_parts(slicing_minicpmv46_dir, dtype=torch.float32, attn_implementation="sdpa",
                                           device=device, step=lambda: None)
        upscales[device.type] = getattr(processor, "upscale_slices", True)
    assert upscales == {"cpu": False, "cuda": True}
