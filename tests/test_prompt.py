"""The app's prompt module: the worker accepts what it builds and writes within its bounds, and the app never imports
the worker package (a fresh interpreter imports every deskeye module and checks sys.modules)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deskeye import prompt
from inference_worker import protocol

pytestmark = [pytest.mark.subprocess]

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_schema_the_app_asks_for_is_the_one_the_worker_serves():
    assert (prompt.SUMMARY_MAX_CHARS, prompt.OBJECT_MAX_CHARS, prompt.MAX_KEY_OBJECTS) == \
        (protocol.SUMMARY_MAX_CHARS, protocol.OBJECT_MAX_CHARS, protocol.MAX_KEY_OBJECTS)
    request = {"model": "m", "messages": prompt.build_messages("q?", b"\x89PNG-bytes", [prompt.Turn("a", "b")],
                                                               "ctx"),
               "response_format": prompt.deskeye_response_format()}
    parsed = protocol.parse_chat_request(request)          # the worker accepts what the app builds
    assert parsed.json_schema == prompt.DESKEYE_SCHEMA
    assert [m.role for m in parsed.messages] == ["system", "user", "assistant", "user"]
    assert parsed.images[0].data == b"\x89PNG-bytes"


def test_parse_description_reads_the_schema_and_names_what_is_wrong():
    answer = prompt.parse_description(json.dumps({"summary": "A terminal", "key_objects": ["bash"]}))
    assert answer == prompt.Description("A terminal", ["bash"])
    for bad, reason in (("not json", "not JSON"), ('{"key_objects": []}', "no 'summary'"),
                        ('{"summary": "s", "key_objects": [1]}', "not a list of strings")):
        with pytest.raises(ValueError, match=reason):
            prompt.parse_description(bad)


@pytest.mark.slow
def test_no_deskeye_module_imports_the_worker_package():
    code = ("import importlib, pkgutil, sys, deskeye\n"
            "for m in pkgutil.walk_packages(deskeye.__path__, 'deskeye.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('inference_worker', 'torch')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
