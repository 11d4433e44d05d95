"""Preprocessing in child processes (`--prepare-processes N`, engines/hf/preprocess.py), with real spawned
children: they give the PromptInputs the preprocessing threads give (Idefics3 and the MiniCPM-V 4.6 fixture),
refuse a bad image with the service's own answer, and when one dies the engine goes on preparing on its threads.
Through the real worker, a describe with the official openai client gets the answer the thread worker gives.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import psutil
import pytest
import torch

from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.errors import ProtocolError
from inference_worker.protocol import parse_chat_request
from inference_worker.images import decode_request_images
from deskeye.prompt import build_messages, deskeye_response_format
from tests.fixtures.chat_requests import chat_request, png_bytes
from tests.fixtures.worker import running_worker
from tests.test_batching import COLORS, QUESTIONS, all_at_once

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

MAX_PIXELS = 4000 * 3000                 # the engines' --max-image-pixels here


def requests_of_every_kind() -> list:
    """Frames of other sizes and colours, JSON and free, two images, and one without an image."""
    made = [chat_request(q, png_bytes(c, (320 + 16 * i, 200)), deskeye_schema=i % 2 == 0)[0]
            for i, (q, c) in enumerate(zip(QUESTIONS[:4], COLORS))]
    two = parse_chat_request({"model": "deskeye", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(COLORS[4], (200, 150)))}},
        {"type": "image_url", "image_url": {"url": data_url(png_bytes(COLORS[5], (150, 200)))}},
        {"type": "text", "text": "Compare these two."}]}]})
    return [*made, two, chat_request("What time is it?")[0]]


def data_url(png: bytes) -> str:
    import base64
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module", params=["idefics3", "minicpmv46"])
def engine(request, tmp_path_factory):
    folder = request.getfixturevalue(f"tiny_{request.param}_dir")
    engine = load_hf_engine(str(folder), EngineOptions(device="cpu", num_threads=1, kv_cache_bytes=64 << 20,
                                                       prepare_processes=1, max_image_pixels=MAX_PIXELS),
                            progress=False)
    yield engine
    engine.close()


def assert_same_inputs(a, b) -> None:
    assert torch.equal(a.prefix_ids, b.prefix_ids) and torch.equal(a.suffix_ids, b.suffix_ids)
    assert a.vision.keys() == b.vision.keys()
    for name, value in a.vision.items():
        other = b.vision[name]
        assert type(other) is type(value), name
        if torch.is_tensor(value):
            assert value.dtype == other.dtype and torch.equal(value, other), name
    assert a.num_images == b.num_images
    assert (a.frame is None) == (b.frame is None)
    if a.frame is not None:
        assert (a.frame.exact_key, a.frame.group_key) == (b.frame.exact_key, b.frame.group_key)
        assert a.frame.signature.sizes == b.frame.signature.sizes
        for x, y in zip(a.frame.signature.thumbnails, b.frame.signature.thumbnails):
            assert x.dtype == y.dtype and (x == y).all()


@pytest.mark.slow
def test_a_child_gives_the_inputs_the_threads_give(engine):
    assert engine.prepares_in_processes
    for request in requests_of_every_kind():
        num_encoded = engine._processes.num_encoded
        in_child = engine.prepare(request)    # one thread: the child is idle
        assert engine._processes.num_encoded == num_encoded + 1
        here = engine.preprocessor.encode(request.messages, decode_request_images(request, MAX_PIXELS))
        assert_same_inputs(here, in_child.inputs)
        assert (in_child.inputs.grammar is None) == (request.json_schema is None)   # compiled in the parent


@pytest.mark.slow                # 1 s or more with the fixtures it sets up
def test_with_every_child_busy_the_thread_encodes_the_request_itself(engine):
    request = requests_of_every_kind()[1]
    from_child = engine.prepare(request).inputs
    busy = engine._processes._idle.get()             # as if another thread's request were in it
    try:
        num_encoded = engine._processes.num_encoded
        on_thread = engine.prepare(request).inputs
        assert engine._processes.num_encoded == num_encoded
    finally:
        engine._processes._idle.put(busy)
    assert_same_inputs(from_child, on_thread)
    assert engine.prepares_in_processes


@pytest.mark.slow
def test_a_child_refuses_a_bad_image_as_the_service_does(engine):
    broken = parse_chat_request({"model": "deskeye", "messages": build_messages("What?", b"\x89PNG\r\n\x1a\nrest")})
    huge = parse_chat_request({"model": "deskeye", "messages": build_messages("What?", png_bytes((1, 2, 3),
                                                                                                 (4100, 3000)))})
    for request in (broken, huge):
        with pytest.raises(ProtocolError) as in_parent:
            decode_request_images(request, MAX_PIXELS)
        with pytest.raises(ProtocolError) as in_child:
            engine.prepare(request)
        assert (str(in_child.value), in_child.value.status, in_child.value.param) == \
            (str(in_parent.value), in_parent.value.status, in_parent.value.param)
    assert engine.prepares_in_processes                  # a refused request leaves the child serving
    request = requests_of_every_kind()[0]
    assert engine.prepare(request).inputs.num_images == 1


@pytest.mark.slow
def test_when_the_child_dies_the_engine_prepares_on_its_threads(tiny_idefics3_dir, caplog):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1, kv_cache_bytes=64 << 20,
                                                                  prepare_processes=1, max_image_pixels=MAX_PIXELS),
                            progress=False)
    try:
        [pid] = engine._processes.pids
        request = requests_of_every_kind()[0]
        before = engine.prepare(request).inputs
        os.kill(pid, signal.SIGKILL)
        psutil.Process(pid).wait(10)
        with caplog.at_level(logging.WARNING):
            after = engine.prepare(request).inputs     # images None: decoded here now
        assert_same_inputs(before, after)
        assert not engine.prepares_in_processes
        assert "preprocessing process died" in caplog.text
        assert_same_inputs(before, engine.prepare(request).inputs)
    finally:
        engine.close()


@pytest.mark.slow                # 1 s or more with the fixtures it sets up
def test_a_processor_that_cannot_travel_leaves_preprocessing_on_the_threads(tiny_idefics3_dir, caplog):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    try:
        engine.preprocessor = dataclasses.replace(engine.preprocessor, escape_text=lambda text: text)  # no pickle
        with caplog.at_level(logging.WARNING):
            engine.start_prepare_processes(1)
        assert not engine.prepares_in_processes
        assert "--prepare-processes 1: cannot prepare in child processes" in caplog.text
        request, images = chat_request("What is on this screen?", png_bytes(COLORS[0]))
        assert engine.prepare(request).inputs.num_images == 1
    finally:
        engine.close()


@pytest.mark.slow
def test_close_stops_the_children(tiny_idefics3_dir):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1, prepare_processes=2),
                            progress=False)
    pids = engine._processes.pids
    assert len(set(pids)) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    engine.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


@pytest.fixture(scope="module")
def process_worker(tiny_idefics3_dir, tmp_path_factory):
    args = ["--engine", "transformers", "--model", str(tiny_idefics3_dir), "--threads", "1",
            "--prepare-processes", "1"]
    with running_worker(args, tmp_path_factory.mktemp("process_worker")) as handle:
        yield handle


def describe(client, question: str, color) -> str:
    messages = build_messages(question, png_bytes(color, (320, 200)))
    reply = client.chat.completions.create(model="deskeye", messages=messages, temperature=0, max_tokens=48,
                                           response_format=deskeye_response_format())
    return reply.choices[0].message.content


@pytest.mark.slow
def test_the_worker_with_a_preparing_process_answers_as_the_thread_worker(process_worker, tiny_worker):
    assert "preprocessing in 1 process(es)" in process_worker.log_text()
    ours, theirs = process_worker.openai_client(), tiny_worker.openai_client()
    pairs = list(zip(QUESTIONS, COLORS))
    together = all_at_once(lambda pair: describe(ours, *pair), pairs)
    assert together == [describe(theirs, *pair) for pair in pairs]


@pytest.mark.slow
def test_the_worker_with_a_preparing_process_refuses_a_bad_image_as_the_thread_worker(process_worker, tiny_worker):
    body = {"model": "deskeye", "messages": build_messages("What?", b"GIF89a-not-a-png")}
    answers = [worker.request("POST", "/v1/chat/completions", body) for worker in (process_worker, tiny_worker)]
    assert answers[0] == answers[1] and answers[0][0] == 400, answers
