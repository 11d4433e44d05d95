"""Decode steps from int8 copies of the text model's weights (`--decode-weights`): which modules get copies (text
model and head, never the vision tower), that decode steps and only they multiply by the copies, that a row's
tokens do not depend on the rows batched with it, that the MiniCPM families serve with them, and what `auto`
chooses. The speed is measured in benchmarks.real_size, never here."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from inference_worker.config import ConfigError, WorkerConfig  # noqa: E402
from inference_worker.engines import EngineOptions, load_hf_engine  # noqa: E402
from inference_worker.engines.base import run_one  # noqa: E402
from inference_worker.engines.hf import int8_decode  # noqa: E402
from inference_worker.engines.hf.model_files import ModelLoadError  # noqa: E402
from tests.fixtures.chat_requests import chat_request, png_bytes, with_sampling  # noqa: E402
from tests.fixtures.minicpmo_standin import build_minicpmo_standin  # noqa: E402

pytestmark = [pytest.mark.model]

COLORS = [(220, 30, 30), (30, 160, 60), (30, 30, 220), (200, 200, 30), (30, 200, 200), (200, 30, 200)]
QUESTIONS = ["What is on this screen?", "Which window has focus?", "List the buttons.", "Any errors shown?",
             "What is the title?", "Summarise the text."]


def load(folder, decode_weights: str):
    return load_hf_engine(str(folder), EngineOptions(device="cpu", num_threads=1, decode_weights=decode_weights),
                          progress=False)


@pytest.fixture(scope="module")
def int8_engine(tiny_minicpmv46_dir):
    engine = load(tiny_minicpmv46_dir, "int8")
    yield engine
    engine.close()


def vlm_shaped(text: torch.nn.Module) -> torch.nn.Module:
    """A module laid out as transformers' vision-language models are: the text model at model.language_model."""
    holder, inner = torch.nn.Module(), torch.nn.Module()
    inner.language_model = text
    holder.model = inner
    return holder


def converted(model) -> list[str]:
    linear_class = int8_decode.int8_linear_class()
    return [name for name, module in model.named_modules() if isinstance(module, linear_class)]


def test_the_text_model_and_head_get_int8_copies_and_the_vision_tower_does_not(int8_engine, tiny_minicpmv46_dir):
    model = int8_engine.model
    names = converted(model)
    plain = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    assert "lm_head" in names
    assert any(name.startswith("model.language_model.") for name in names)
    assert names and all(not name.startswith(("model.vision", "model.merger", "model.resampler")) for name in names)
    assert plain and all("language_model" not in name and name != "lm_head" for name in plain), plain
    head = model.get_output_embeddings()
    assert head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()      # still tied
    assert head.weight_int8.dtype == torch.int8 and head.weight_int8.shape == head.weight.shape
    assert head.weight.shape[0] == 248_094                                               # the real vocabulary
    assert not any(key.endswith(("weight_int8", "weight_scale")) for key in model.state_dict())   # not saved
    assert converted(load(tiny_minicpmv46_dir, "model").model) == []


def test_decode_steps_multiply_by_the_copies_and_everything_else_by_the_model_weights():
    torch.manual_seed(0)
    holder = vlm_shaped(torch.nn.Sequential(torch.nn.Linear(64, 96, bias=True)))
    before = holder.model.language_model[0].weight.detach().clone()
    assert int8_decode.add_int8_copies(holder).num_matrices == 1
    linear = holder.model.language_model[0]
    assert torch.equal(linear.weight, before)                                         # the model's own, untouched
    x = torch.randn(3, 64)
    own = torch.nn.functional.linear(x, linear.weight, linear.bias)
    dequantized = torch.nn.functional.linear(x, linear.weight_int8.float() * linear.weight_scale[:, None], linear.bias)
    assert torch.equal(linear(x), own)
    with int8_decode.decode_steps():
        in_step = linear(x)
        assert torch.equal(linear(x[None])[0], in_step)                                  # any leading shape
    assert torch.allclose(in_step, dequantized, atol=1e-4)
    assert not torch.allclose(in_step, own, atol=1e-4)                                 # it is the int8 copy
    # the rounding is bounded: half a step of each row's 1/127 of its largest weight, times |x|
    step = linear.weight.abs().amax(dim=1) / 127
    assert torch.all((in_step - own).abs() <= (x.abs().sum(dim=1, keepdim=True) * step / 2) + 1e-4)
    assert torch.equal(linear(x), own)                                                 # and back after the step


def test_a_rows_tokens_do_not_depend_on_the_rows_batched_with_it(int8_engine):
    """Six rows (more than fit a small-batch kernel) decoded together give each row's solo tokens."""
    requests = [chat_request(q, png_bytes(c), max_tokens=12)[0] for q, c in zip(QUESTIONS, COLORS)]
    requests[2] = with_sampling(requests[2], temperature=0.9, top_p=0.9, top_k=50, seed=7)
    solo = [run_one(int8_engine, request) for request in requests]
    answers = {}
    int8_engine.run_batch([int8_engine.prepare(r) for r in requests], lambda i, a: answers.__setitem__(i, a))
    for index, alone in enumerate(solo):
        assert (answers[index].text, answers[index].completion_tokens) == (alone.text, alone.completion_tokens)
        assert answers[index].facts.batch_size == len(requests)


def test_the_int8_steps_change_the_logits_a_little_and_not_the_prompt(int8_engine, tiny_minicpmv46_dir):
    """Same request through the int8 engine and the model-weights engine: the first token (from the prefill, the
    model's weights in both) is the same; later tokens come from nearly the same logits."""
    exact = load(tiny_minicpmv46_dir, "model")
    request = chat_request("What is on this screen?", png_bytes((220, 30, 30)), max_tokens=8)[0]
    logits = {}
    for name, engine in (("int8", int8_engine), ("model", exact)):
        engine.decoder.keep_logits = True
        try:
            logits[name] = run_one(engine, request).facts.logits
        finally:
            engine.decoder.keep_logits = False
    first_int8, first_exact = logits["int8"][0], logits["model"][0]
    assert torch.equal(first_int8, first_exact)                                        # prefill: the model's weights
    later_int8, later_exact = logits["int8"][1], logits["model"][1]
    cosine = torch.nn.functional.cosine_similarity(later_int8.double(), later_exact.double(), dim=0)
    assert 0.99 < float(cosine) < 1.0, float(cosine)                                   # close, and not the same path
    exact.close()


def test_minicpmo_serves_with_int8_copies_of_its_qwen3(tmp_path_factory):
    folder = build_minicpmo_standin(tmp_path_factory.mktemp("minicpmo_int8"))
    engine = load(folder, "int8")
    try:
        names = converted(engine.model)
        assert names and all(name.startswith("llm.") for name in names), names
        assert "llm.lm_head" in names
        answer = run_one(engine, chat_request("List the buttons.", png_bytes((30, 160, 60)), max_tokens=6)[0])
        assert answer.completion_tokens == 6
    finally:
        engine.close()


class _Device:
    def __init__(self, kind: str):
        self.type = kind


def test_auto_picks_int8_on_the_cpu_for_a_big_bf16_text_model_that_fits(monkeypatch, caplog):
    model = vlm_shaped(torch.nn.Linear(8, 8))
    cpu, cuda, bf16 = _Device("cpu"), _Device("cuda"), torch.bfloat16
    resolve = int8_decode.resolve_decode_weights
    assert resolve("auto", cpu, model, dtype=bf16, memory_bytes=10**12) == "model"                 # too small
    monkeypatch.setattr(int8_decode, "MIN_AUTO_PARAMS", 64)
    assert resolve("auto", cpu, model, dtype=bf16, memory_bytes=10**12) == "int8"
    assert resolve("auto", cpu, model, dtype=torch.float32, memory_bytes=10**12) == "model"       # slower there
    assert resolve("auto", cuda, model, dtype=bf16, memory_bytes=10**12) == "model"
    with caplog.at_level(logging.WARNING, logger=int8_decode.__name__):
        assert resolve("auto", cpu, model, dtype=bf16, memory_bytes=100) == "model"
    assert "free memory" in caplog.text
    assert int8_decode.resolve_decode_weights("model", cpu, model) == "model"
    assert int8_decode.resolve_decode_weights("int8", cpu, model, memory_bytes=1) == "int8"     # asked for
    with pytest.raises(ModelLoadError, match="for the CPU"):
        int8_decode.resolve_decode_weights("int8", cuda, model)
    with pytest.raises(ModelLoadError, match="auto, int8, model"):
        int8_decode.resolve_decode_weights("int4", cpu, model)


def test_memory_available_is_read_from_meminfo():
    text = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n"
    assert int8_decode.available_memory_bytes(text) == 12345678 * 1024
    assert int8_decode.available_memory_bytes("MemTotal: 5 kB\n") is None


def test_the_worker_flag_names_its_choices():
    assert WorkerConfig().decode_weights == "auto"
    assert EngineOptions.from_config(WorkerConfig(decode_weights="model")).decode_weights == "model"
    with pytest.raises(ConfigError, match="decode_weights.*auto | int8 | model"):
        WorkerConfig(decode_weights="int4")
