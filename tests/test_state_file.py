"""The worker's state file: a stale one (kill -9, then its pid reused) never blocks a start, a failed write leaves
no temporary file, a folder other users can write is refused, and it publishes the worker's request limits. Real
`deskeye-worker` subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from inference_worker.server.auth import StateFileError, write_state_file
from tests.fixtures.worker import REPO_ROOT, start_worker, worker_env

pytestmark = [pytest.mark.subprocess]


def run_worker_cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inference_worker.cli", "--port", "0", *args], capture_output=True,
                          text=True, timeout=timeout_s, cwd=REPO_ROOT, env=worker_env())


@pytest.mark.slow
def test_a_state_file_left_by_kill_9_does_not_block_the_next_worker(tmp_path):
    first = start_worker(["--engine", "ocr"], tmp_path)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    assert json.loads(first.state_file.read_text())["pid"] == first.proc.pid     # left behind
    second = start_worker(["--engine", "ocr"], tmp_path)
    try:
        assert json.loads(second.state_file.read_text())["pid"] == second.proc.pid
    finally:
        second.stop()


@pytest.mark.slow
def test_a_stale_state_file_whose_pid_was_reused_does_not_block_start(tmp_path):
    state_file = tmp_path / "worker.json"
    state_file.write_text(json.dumps({"url": "http://127.0.0.1:1", "api_key": "old", "pid": 1}))
    written_s = time.time() - 120
    os.utime(state_file, (written_s, written_s))           # the killed worker wrote it two minutes ago
    reused = subprocess.Popen(["sleep", "60"])             # a live process that now has the file's pid
    try:
        state_file.write_text(json.dumps({"url": "http://127.0.0.1:1", "api_key": "old", "pid": reused.pid}))
        os.utime(state_file, (written_s, written_s))
        worker = start_worker(["--engine", "ocr"], tmp_path)
        try:
            assert json.loads(state_file.read_text())["pid"] == worker.proc.pid
            assert reused.poll() is None, "the process holding the reused pid was left alone"
        finally:
            worker.stop()
    finally:
        reused.kill()
        reused.wait()


def test_a_live_owner_started_before_the_file_still_blocks(tmp_path):
    """The pid + create-time check still protects a live worker's file (this test process started earlier)."""
    state_file = tmp_path / "worker.json"
    state_file.write_text(json.dumps({"url": "http://127.0.0.1:1", "api_key": "x", "pid": os.getpid()}))
    result = run_worker_cli("--engine", "ocr", "--state-file", str(state_file))
    assert result.returncode == 1 and f"pid {os.getpid()}" in result.stderr


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    (folder / "worker.json").mkdir()                      # os.replace onto a folder fails after the write
    with pytest.raises(StateFileError, match="cannot write the state file"):
        write_state_file(folder / "worker.json", {"url": "u", "api_key": "k", "pid": os.getpid()})
    with pytest.raises(StateFileError, match="cannot write the state file"):
        write_state_file(folder / "other.json", {"pid": os.getpid(), "bad": object()})   # json.dump fails midway
    assert sorted(p.name for p in folder.iterdir()) == ["worker.json"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o722])
def test_a_state_file_folder_others_can_write_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    result = run_worker_cli("--engine", "ocr", "--state-file", str(shared / "worker.json"))
    assert result.returncode == 1, result.stderr
    assert "can be written by other users" in result.stderr and f"chmod 700 {shared}" in result.stderr
    assert list(shared.iterdir()) == []


def test_a_private_folder_is_accepted_and_the_file_is_0600(tmp_path):
    path = tmp_path / "private" / "worker.json"
    write_state_file(path, {"url": "u", "api_key": "k", "pid": os.getpid()})
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in path.parent.iterdir()] == ["worker.json"]


@pytest.mark.slow
def test_the_state_file_carries_the_limits_the_worker_was_started_with(tmp_path):
    """The app sizes its requests by the published limits; they are the ones the worker enforces."""
    worker = start_worker(["--engine", "ocr", "--max-image-pixels", "1000000", "--max-request-pixels", "3000000",
                           "--max-images", "2", "--max-tokens-limit", "64", "--max-prompt-tokens", "512",
                           "--max-body-bytes", "2000000"], tmp_path)
    try:
        limits = json.loads(worker.state_file.read_text())["limits"]
        assert limits == {"max_image_pixels": 1_000_000, "max_request_pixels": 3_000_000, "max_images": 2,
                          "max_tokens_limit": 64, "max_prompt_tokens": 512, "max_body_bytes": 2_000_000}
        status, body = worker.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": limits["max_tokens_limit"] + 1})
        assert status == 400 and f"at most {limits['max_tokens_limit']}" in body["error"]["message"]
    finally:
        worker.stop()


@pytest.mark.slow
def test_a_model_workers_state_file_carries_its_effective_prompt_limit(tiny_worker):
    """With a model loaded, max_prompt_tokens is what the model's context allows (the flag was left at 0): a prompt
    one token too long for it is refused naming that number."""
    limit = tiny_worker.state["limits"]["max_prompt_tokens"]
    assert 0 < limit < 10_000
    status, body = tiny_worker.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "word " * limit}], "max_tokens": 1})
    assert status == 400, body
    assert f"over the {limit:,} this worker accepts" in body["error"]["message"]
