"""MiniCPM-V 4.6 as the worker serves it, on the tiny random fixture built at test time: the loader finds its
image-only processor without torchvision (which must not be installed beside torch 2.13 CPU), the hybrid
Qwen3.5 text model (linear-attention + full-attention layers) batches, and eight requests sent together through
the real worker are decoded together and each gets the answer it gets alone.
"""

from __future__ import annotations

import importlib.util

import pytest

from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.hf.minicpmv import MiniCPMVImageProcessor
from deskeye.prompt import build_messages, deskeye_response_format
from tests.fixtures.chat_requests import png_bytes
from tests.fixtures.worker import running_worker
from tests.test_batching import COLORS, QUESTIONS, all_at_once

pytestmark = [pytest.mark.model, pytest.mark.subprocess]


def test_torchvision_is_not_installed():
    """Its only wheel for torch 2.13 is CUDA-linked and breaks every processor (FIELD_NOTES)."""
    assert importlib.util.find_spec("torchvision") is None


def auto_processor_or_error(folder):
    from transformers import AutoProcessor
    try:
        return AutoProcessor.from_pretrained(folder)
    except (OSError, ImportError, ValueError) as exc:
        return exc


@pytest.mark.slow
def test_the_loader_finds_the_image_only_processor_where_auto_processor_cannot(tiny_minicpmv46_dir):
    """AutoProcessor wants the video half (torchvision, video_preprocessor_config.json): it fails or, as FIELD_NOTES
    saw, returns the bare tokenizer. The worker's family table gives MiniCPM-V its image-only processor."""
    auto = auto_processor_or_error(tiny_minicpmv46_dir)
    assert isinstance(auto, Exception) or not hasattr(auto, "image_processor")
    engine = load_hf_engine(str(tiny_minicpmv46_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    try:
        assert isinstance(engine.processor, MiniCPMVImageProcessor)
        assert type(engine.model).__name__ == "MiniCPMV4_6ForConditionalGeneration"
        layers = engine.model.config.text_config.layer_types
        assert layers == ["linear_attention", "full_attention"]
        assert engine.decoder.can_merge                     # the hybrid cache merges: rows batch
    finally:
        engine.close()


@pytest.fixture(scope="module")
def minicpmv46_worker(tiny_minicpmv46_dir, tmp_path_factory):
    args = ["--engine", "transformers", "--model", str(tiny_minicpmv46_dir), "--threads", "1",
            "--max-batch-size", "8", "--batch-window-ms", "3000,3000,3000"]
    with running_worker(args, tmp_path_factory.mktemp("minicpmv46_worker")) as handle:
        yield handle


def deskeye_body(question: str, color) -> dict:
    return {"model": "deskeye", "messages": build_messages(question, png_bytes(color, (320, 200))),
            "response_format": deskeye_response_format(), "temperature": 0, "max_tokens": 256}


@pytest.mark.slow
def test_eight_requests_through_the_worker_are_decoded_together_and_each_gets_its_solo_answer(minicpmv46_worker):
    bodies = [deskeye_body(q, c) for q, c in zip(QUESTIONS, COLORS)]
    solo = [minicpmv46_worker.request("POST", "/v1/chat/completions", body) for body in bodies]
    before = minicpmv46_worker.metrics()
    together = all_at_once(lambda b: minicpmv46_worker.request("POST", "/v1/chat/completions", b), bodies)
    after = minicpmv46_worker.metrics_after(before, num_requests=8)

    assert [status for status, _ in solo + together] == [200] * 16, [b for _, b in solo + together]
    for (_, alone), (_, batched) in zip(solo, together):
        assert batched["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert max(b["deskeye"]["batch_size"] for _, b in together) > 1
    steps = after["deskeye_worker_decode_steps_total"] - before["deskeye_worker_decode_steps_total"]
    row_steps = after["deskeye_worker_decode_row_steps_total"] - before["deskeye_worker_decode_row_steps_total"]
    assert steps > 0 and row_steps / steps > 1                   # more than one row per step, on average
    assert after["deskeye_worker_live_rows"] == 0                # the gauge: nothing decodes once the call is over


def test_its_head_reads_the_last_position_only_and_gives_the_same_logits(tiny_minicpmv46_dir, tiny_idefics3_dir):
    """transformers' MiniCPM-V 4.6 forward has no `logits_to_keep` and applies its 248k-row head to every prompt
    position (181 ms and 157 MB of logits for an 800x600 prompt at real size); every forward of the worker reads the
    last position only, so the head is given that one: the same last logits, and a cold prefill with an image sends
    the head one position per row. Idefics3, whose forward keeps the last position itself, is left as it is."""
    import torch

    from inference_worker.engines.base import run_one
    from inference_worker.engines.hf.model_forward import head_on_last_position
    from tests.fixtures.chat_requests import chat_request

    engine = load_hf_engine(str(tiny_minicpmv46_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    other = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    try:
        model, head = engine.model, engine.model.get_output_embeddings()
        assert head.reads_last_position and not head_on_last_position(other.model)
        ids = torch.tensor([engine.processor.tokenizer("The build finished with 3 warnings").input_ids])
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            hidden = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            every_position = torch.nn.functional.linear(hidden, head.weight)
        assert ids.shape[1] > 1 and logits.shape[1] == 1
        assert torch.allclose(logits[:, -1], every_position[:, -1], atol=1e-5)
        rows = []
        hook = head.register_forward_hook(lambda module, args, out: rows.append(tuple(args[0].shape)))
        try:
            answer = run_one(engine, chat_request("What is on this screen?", png_bytes((220, 30, 30)),
                                                  max_tokens=4)[0])
        finally:
            hook.remove()
        assert answer.completion_tokens >= 1 and rows
        assert all(len(shape) == 2 or shape[1] == 1 for shape in rows), rows
    finally:
        engine.close()
        other.close()
