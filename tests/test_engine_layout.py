"""The engines' layout and the smaller engine bugs of issue 12: one family table decides loader and engine (and
importing the loader imports no engine); the VRAM check counts the frame KV budget; the similar-frame search runs
while preparing, and a search that found nothing is not repeated on the model thread."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from inference_worker.config import DEFAULT_KV_SIMILAR_THRESHOLD
from inference_worker.engines import FAMILIES, EngineOptions, family_for
from inference_worker.engines.base import run_one
from inference_worker.engines.hf.frame_cache import FrameCache
from inference_worker.engines import load_hf_engine
from inference_worker.engines.hf.loading import GB, ModelLoadError, check_fits_vram, required_vram_bytes
from tests.fixtures.chat_requests import chat_request, png_bytes
from tests.fixtures.worker import REPO_ROOT

pytestmark = [pytest.mark.model, pytest.mark.subprocess]


@pytest.mark.parametrize("config, family", [
    ({"model_type": "minicpmv4_6"}, "minicpmv4_6"),
    ({"model_type": "minicpmv4_7"}, "minicpmv4_6"),
    ({"model_type": "minicpmo", "auto_map": {"AutoModel": "modeling_minicpmo.MiniCPMO"}}, "minicpmo"),
    ({"model_type": "qwen3", "auto_map": {"AutoModel": "modeling_minicpmo.MiniCPMO"}}, "minicpmo"),
    ({"model_type": "idefics3"}, "transformers"),
    ({"model_type": "llava"}, "transformers"),
])
def test_one_family_table_decides_each_folder(config, family):
    assert family_for(config).name == family


def test_every_family_names_importable_functions():
    import importlib
    for family in FAMILIES:
        for reference in (family.load_parts, family.make_engine):
            module, attribute = reference.split(":")
            assert callable(getattr(importlib.import_module(module), attribute)), reference


def test_the_loader_imports_no_engine_and_the_package_imports_no_torch():
    """No circle: loading.py decides nothing about families, so it needs neither engine module."""
    code = ("import sys, inference_worker.engines; assert 'torch' not in sys.modules, 'torch at import'; "
            "import inference_worker.engines.hf.loading; "
            "bad = [m for m in ('inference_worker.engines.hf.engine', 'inference_worker.engines.hf.minicpmo') "
            "if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_engine_options_are_validated():
    with pytest.raises(ValueError, match="num_threads"):
        EngineOptions(num_threads=0)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        EngineOptions(kv_cache_bytes=-1)
    with pytest.raises(ValueError, match="max_request_pixels"):
        EngineOptions(max_image_pixels=100, max_request_pixels=99)


def test_every_engine_name_has_one_loader_and_the_options_come_from_the_config_in_one_place():
    from inference_worker.config import ENGINES, WorkerConfig
    from inference_worker.engines import LOADERS

    assert tuple(LOADERS) == ENGINES
    config = WorkerConfig(num_threads=3, kv_cache_mb=7, kv_similar=False, max_image_pixels=5000,
                          max_request_pixels=9000, max_prompt_tokens=64, use_grammar=False, prepare_processes=2)
    options = EngineOptions.from_config(config)
    assert (options.num_threads, options.kv_cache_bytes, options.kv_similar_threshold) == (3, 7 * 2**20, None)
    assert (options.image_limits.max_image_pixels, options.image_limits.max_request_pixels) == (5000, 9000)
    assert (options.max_prompt_tokens, options.use_grammar, options.prepare_processes) == (64, False, 2)
    assert EngineOptions.from_config(WorkerConfig()).num_threads is None      # 0 = the library's default


def test_the_vram_check_counts_the_kv_budget_and_says_to_lower_it():
    """A pure function of bytes (no CUDA here): weights that fit alone, plus a KV budget that does not."""
    weights = int(3.2 * GB)
    assert required_vram_bytes(weights, kv_cache_bytes=2 * GB) == required_vram_bytes(weights) + 2 * GB
    check_fits_vram("openbmb/MiniCPM-V-4.6", required_bytes=required_vram_bytes(weights), free_bytes=5 * GB,
                    total_bytes=8 * GB)
    with pytest.raises(ModelLoadError) as too_big:
        check_fits_vram("openbmb/MiniCPM-V-4.6", required_bytes=required_vram_bytes(weights, 2 * GB),
                        free_bytes=5 * GB, total_bytes=8 * GB, kv_cache_bytes=2 * GB)
    message = str(too_big.value)
    assert "KV budget 2.0 GB" in message and "--kv-cache-mb" in message


@pytest.fixture()
def similar_engine(tiny_idefics3_dir):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1,
                                                                  kv_cache_bytes=64 * 1024 * 1024,
                                                                  kv_similar_threshold=DEFAULT_KV_SIMILAR_THRESHOLD),
                            progress=False)
    yield engine
    engine.close()


def test_the_similar_search_runs_while_preparing_and_not_again_on_the_model_thread(similar_engine, monkeypatch):
    searches = []
    closest = FrameCache._closest

    def spy_closest(self, candidates, signature):
        searches.append((threading.current_thread().name, len(candidates)))
        return closest(self, candidates, signature)
    monkeypatch.setattr(FrameCache, "_closest", spy_closest)
    first, first_images = chat_request("What is this?", png_bytes((10, 200, 10)), max_tokens=3)
    other, other_images = chat_request("What is this?", png_bytes((200, 10, 200)), max_tokens=3)
    run_one(similar_engine, first)                   # stores a frame of the group
    searches.clear()

    prepared = [None]
    preparing = threading.Thread(target=lambda: prepared.__setitem__(0, similar_engine.prepare(other)),
                                 name="deskeye-prepare-test")
    preparing.start()
    preparing.join()
    assert prepared[0].inputs.frame.nearest is None               # searched: nothing close enough
    answers = []
    similar_engine.run_batch(prepared, lambda index, answer: answers.append(answer))

    assert answers[0].facts.cache == "miss"
    assert [name for name, _ in searches] == ["deskeye-prepare-test"]     # one search, off the model thread


@pytest.mark.slow
def test_positions_are_plain_unless_the_model_computes_them_from_the_image_grid(tiny_minicpmv46_dir):
    """Qwen2-VL computes M-RoPE positions from the image grid (get_rope_index) and keeps rope_deltas between calls:
    no reused prefix, no explicit positions, no merging. MiniCPM-V 4.6's text model has M-RoPE sections but the
    model passes plain positions: it reuses and merges. (A tiny Qwen2-VL is built in memory: its processor needs
    torchvision.)"""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from inference_worker.engines.hf.batch_decode import can_merge_caches
    from inference_worker.engines.hf.model_forward import has_plain_positions

    qwen2_vl = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)))
    minicpmv = AutoModelForImageTextToText.from_pretrained(tiny_minicpmv46_dir, dtype=torch.float32)
    assert not has_plain_positions(qwen2_vl) and not can_merge_caches(qwen2_vl)
    assert has_plain_positions(minicpmv) and can_merge_caches(minicpmv)
