"""The worker's limits reach the app through its state file, not through copies of its defaults.

A real `deskeye-worker --engine ocr`, started by the app's own supervisor with lower limits than its defaults
(`--max-image-pixels`, `--max-tokens-limit`), publishes them; the app then caps what it sends by them: an image file
given to `deskeye describe` is scaled down to the worker's limit, and a deep question's room stays within its
`max_tokens` limit. A server that publishes none (an external one, an older worker) gets the worker's defaults.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from PIL import Image

from deskeye import cli
from deskeye.answering import deep_max_tokens
from deskeye.errors import AnswerError
from deskeye.settings import Settings, with_overrides
from deskeye.worker import supervisor as supervisor_module
from deskeye.worker.client import WorkerClient
from deskeye.worker.endpoint import FALLBACK_LIMITS, WorkerLimits
from deskeye.worker.launch import worker_command
from deskeye.worker.supervisor import WorkerSupervisor
from inference_worker.config import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES,
                                     DEFAULT_MAX_REQUEST_PIXELS, DEFAULT_MAX_TOKENS_LIMIT, WorkerConfig)
from tests.fixtures.text_image import render_text_png

pytestmark = [pytest.mark.subprocess]

MAX_IMAGE_PIXELS = 200_000           # above the 900x180 text frame, below an 800x600 image
MAX_TOKENS_LIMIT = 96                # above worker.max_tokens, below a deep question's 4 x that
MAX_TOKENS = 64


@pytest.fixture
def low_limits_worker(monkeypatch):
    """Every worker the app's supervisor starts in this test runs with MAX_IMAGE_PIXELS and MAX_TOKENS_LIMIT."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(supervisor_module, "worker_command", lambda settings, state_file: [
        *worker_command(settings, state_file),
        "--max-image-pixels", str(MAX_IMAGE_PIXELS), "--max-tokens-limit", str(MAX_TOKENS_LIMIT)])


def ocr_settings(**worker) -> Settings:
    return with_overrides(Settings(), worker={"engine": "ocr", "startup_timeout_s": 90.0, "request_timeout_s": 90.0,
                                              "max_tokens": MAX_TOKENS, **worker})


def test_the_fallback_limits_are_the_workers_own_defaults():
    assert FALLBACK_LIMITS == WorkerLimits(
        max_image_pixels=DEFAULT_MAX_IMAGE_PIXELS, max_request_pixels=DEFAULT_MAX_REQUEST_PIXELS,
        max_images=DEFAULT_MAX_IMAGES, max_tokens_limit=DEFAULT_MAX_TOKENS_LIMIT,
        max_prompt_tokens=WorkerConfig().max_prompt_tokens, max_body_bytes=DEFAULT_MAX_BODY_BYTES)


def test_published_limits_replace_the_fallback_key_by_key():
    assert WorkerLimits.from_state(None) == FALLBACK_LIMITS                  # an older worker: no "limits"
    assert WorkerLimits.from_state(["not", "an", "object"]) == FALLBACK_LIMITS
    read = WorkerLimits.from_state({"max_image_pixels": 40_000, "max_tokens_limit": "96", "max_images": -1,
                                    "max_body_bytes": True, "max_prompt_tokens": 2048, "unknown": 7})
    assert read == dataclasses.replace(FALLBACK_LIMITS, max_image_pixels=40_000, max_prompt_tokens=2048)
    assert read.max_pixels_per_frame == 40_000


def test_an_external_server_is_taken_to_accept_the_workers_defaults():
    supervisor = WorkerSupervisor(ocr_settings(url="http://127.0.0.1:9/v1"))
    assert WorkerClient(supervisor, supervisor.settings).limits() == FALLBACK_LIMITS


@pytest.mark.slow
def test_a_deep_answer_gets_the_room_the_worker_publishes(low_limits_worker):
    settings = ocr_settings()
    supervisor = WorkerSupervisor(settings)
    client = WorkerClient(supervisor, settings)
    png = render_text_png(["Quarterly budget review", "Meeting at 3pm"])
    try:
        supervisor.start()
        limits = client.limits()
        assert (limits.max_image_pixels, limits.max_tokens_limit) == (MAX_IMAGE_PIXELS, MAX_TOKENS_LIMIT)
        assert deep_max_tokens(settings.worker.max_tokens, limits) == MAX_TOKENS_LIMIT
        answer = client.ask("explain this in detail", png, max_tokens=deep_max_tokens(settings.worker.max_tokens,
                                                                                      limits))
        assert "budget" in answer.summary.lower()
        with pytest.raises(AnswerError, match=f"at most {MAX_TOKENS_LIMIT}"):     # the defaults' room is refused
            client.ask("explain this in detail", png,
                       max_tokens=deep_max_tokens(settings.worker.max_tokens, FALLBACK_LIMITS))
    finally:
        client.close()
        supervisor.stop()


@pytest.mark.slow
def test_describe_scales_an_image_file_down_to_the_workers_published_limit(low_limits_worker, tmp_path, capsys):
    path = tmp_path / "large.png"
    Image.new("RGB", (800, 600), "white").save(path)
    settings_file = tmp_path / "settings.toml"
    settings_file.write_text('[worker]\nengine = "ocr"\nstartup_timeout_s = 90.0\nrequest_timeout_s = 90.0\n'
                             f'max_tokens = {MAX_TOKENS}\n', encoding="utf-8")
    code = cli.main(["--settings", str(settings_file), "describe", "--image", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert set(json.loads(out)) >= {"summary", "key_objects", "engine"}
    width, height = (int(n) for n in err.split("scaled down to ")[1].split(".")[0].split("x"))
    assert width * height <= MAX_IMAGE_PIXELS and abs(width / height - 4 / 3) < 0.02
