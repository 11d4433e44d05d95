"""The OCR engine needs nothing from the network and nothing heavy at import.

The offline test runs a real subprocess in a fresh network namespace (`unshare -n`, only loopback up —
needs root or CAP_SYS_ADMIN, as CI has) with an empty HOME: it proves the network is unreachable, then
builds the worker's default engine (no model configured), OCRs a rendered image and prints the answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest

from deskeye.prompt import DESKEYE_SCHEMA

pytestmark = [pytest.mark.subprocess]

REPO = Path(__file__).resolve().parent.parent
LINES = ["Quarterly budget review", "Invoice 4471 overdue", "收件箱 3 封未读邮件"]

CHILD = textwrap.dedent("""
    import io, json, socket, sys
    from PIL import Image, ImageDraw, ImageFont

    def reachable(address):
        try:
            socket.create_connection(address, timeout=3).close()
            return "connected"
        except OSError as exc:
            return f"{type(exc).__name__}: {exc.strerror or exc}"

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    loopback = reachable(server.getsockname())
    outside = reachable(("1.1.1.1", 443))

    fonts = {"latin": sys.argv[2], "cjk": sys.argv[3]}
    image = Image.new("RGB", (720, 220), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(json.loads(sys.argv[1])):
        font = ImageFont.truetype(fonts["cjk" if ord(line[0]) > 0x2e80 else "latin"], 30)
        draw.text((24, 20 + 64 * i), line, fill="black", font=font)

    from inference_worker.config import WorkerConfig
    from inference_worker.engines import load_engine
    from inference_worker.engines.base import run_one
    from inference_worker.protocol import parse_chat_request
    from deskeye.prompt import build_messages, deskeye_response_format
    from tests.fixtures.chat_requests import png_of

    engine = load_engine(WorkerConfig())              # no model configured: the default engine
    request = parse_chat_request({"model": "deskeye-ocr", "response_format": deskeye_response_format(),
                                  "messages": build_messages("What is on this screen?", png_of(image))})
    completion = run_one(engine, request)
    print(json.dumps({"loopback": loopback, "outside": outside, "kind": engine.kind,
                      "answer": json.loads(completion.text),
                      "heavy_modules": sorted(m for m in ("torch", "transformers", "huggingface_hub")
                                              if m in sys.modules)}, ensure_ascii=False))
""")

FONTS = ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")


def netns_unavailable_reason() -> str | None:
    """Why a network namespace cannot be made here, named exactly; None when it can."""
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt package {package})"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return (f"`unshare -n` is not permitted here ({probe.stderr.strip()}): creating a network namespace "
                f"needs CAP_SYS_ADMIN (root, as in CI); this process runs as uid {os.getuid()}")
    return None


@pytest.mark.slow
def test_ocr_engine_answers_with_the_network_cut(tmp_path):
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    for font in FONTS:
        assert Path(font).is_file(), f"{font} missing: install fonts-dejavu-core and fonts-noto-cjk"
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
           "PYTHONPATH": str(REPO), "LANG": "C.UTF-8"}
    child = [sys.executable, "-c", CHILD, json.dumps(LINES, ensure_ascii=False), *FONTS]
    script = 'ip link set lo up && exec "$@"'
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script, "sh", *child], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loopback"] == "connected"
    assert result["outside"].startswith("OSError") and "unreachable" in result["outside"], result
    assert result["kind"] == "ocr" and result["heavy_modules"] == []
    answer = result["answer"]
    jsonschema.validate(answer, DESKEYE_SCHEMA)
    assert "“Quarterly budget review”" in answer["summary"] and "“Invoice 4471 overdue”" in answer["summary"]
    assert "email inbox" in answer["key_objects"] and "3 unread" in answer["key_objects"], answer
    assert list(home.rglob("*")) == [], "the engine wrote caches or downloads under HOME"


def test_importing_the_ocr_modules_loads_no_model_and_no_torch():
    code = ("import json, sys\n"
            "import inference_worker.engines.ocr.engine, inference_worker.engines.ocr.grounding\n"
            "from inference_worker.engines.ocr.engine import OcrEngine\n"
            "engine = OcrEngine(preload=False)\n"
            "print(json.dumps([engine.reader.is_loaded, sorted(m for m in ('torch', 'transformers', 'onnxruntime',"
            " 'rapidocr_onnxruntime', 'cv2') if m in sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, []]
