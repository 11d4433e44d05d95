"""The OCR models as the reader runs them, against RapidOCR as shipped, on text rendered with real fonts.

- the recogniser with its affine and hard-swish passes folded away (engines/ocr/folding.py) reads every crop
  as the wheel's model does: the same texts, the same scores to 1e-4; the folded detector finds the same boxes;
- the detector's input, normalised in place by the reader, is RapidOCR's bit for bit;
- the warm-up at load: in a fresh process, the engine's first two answers after it is built import no module
  and grow the process by almost nothing, where an engine built without the warm-up grows by tens of MB
  (onnxruntime's per-shape memory plans) and imports the schema validator on the first request.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from inference_worker.engines.ocr import models as ocr_models
from inference_worker.engines.ocr import reader as ocr_reader
from inference_worker.engines.ocr.reader import OcrConfig, OcrReader

pytestmark = [pytest.mark.subprocess]

REPO = Path(__file__).resolve().parent.parent
FONTS = {"sans": "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
         "mono": "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
         "cjk": "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc"}
LINES = [("sans", 20, "Mail - Inbox (3 unread)"), ("sans", 14, "Invoice #4411 total $1,249.00 due 2024-05-12"),
         ("mono", 13, "-rw-r--r-- 1 ana staff 120 Dec  1 15:12 budget.csv"),
         ("mono", 13, 'File "/home/ana/calc.py", line 4, in <module>'),
         ("mono", 13, "ZeroDivisionError: division by zero"), ("cjk", 16, "收件箱 3 封未读邮件 ¥12,500"),
         ("sans", 12, "The quick brown fox jumps over the lazy dog, again and again, until the line runs long"),
         ("sans", 16, "OK"), ("mono", 12, "    return done / total"), ("sans", 18, "Quarterly budget review")]


def render_screen(width: int = 800, height: int = 600):
    """The lines above, top to bottom, twice (different x offsets), black on near-white."""
    from PIL import Image, ImageDraw, ImageFont

    for path in FONTS.values():
        if not Path(path).is_file():
            pytest.fail(f"{path} missing: install fonts-dejavu-core and fonts-noto-cjk (scripts/test.sh does)")
    image = Image.new("RGB", (width, height), (250, 250, 250))
    draw, top = ImageDraw.Draw(image), 10
    for left in (12, 40):
        for family, size_px, text in LINES:
            draw.text((left, top), text, fill=(20, 20, 20), font=ImageFont.truetype(FONTS[family], size_px))
            top += size_px + 12
    return image


def crops_of(reader: OcrReader, image) -> list[np.ndarray]:
    """The recogniser's inputs for every line the detector finds in `image`."""
    bgr = ocr_reader.to_bgr(image)
    quads = reader._detect(bgr, 1.0, (0, 0, bgr.shape[1], bgr.shape[0]))
    return [ocr_models.rec_input(reader._ocr.crop(bgr, quad), reader.config.rec_height_px) for quad in quads]


@pytest.fixture(scope="module")
def readers():
    shipped = OcrReader(OcrConfig(simplify_models=False, warm_up_frame_px=(0, 0)))
    simplified = OcrReader(OcrConfig(warm_up_frame_px=(0, 0)))
    shipped.load()
    simplified.load()
    yield shipped, simplified
    shipped.close()
    simplified.close()


@pytest.mark.slow
def test_the_simplified_recogniser_reads_every_crop_as_the_wheels_model_does(readers):
    shipped, simplified = readers
    assert shipped._ocr.num_rewrites == {"det": 0, "rec": 0}
    assert simplified._ocr.num_rewrites["rec"] > 0 and simplified._ocr.num_rewrites["det"] > 0
    crops = crops_of(shipped, render_screen())
    assert len(crops) >= len(LINES) * 2 - 2, len(crops)
    texts = []
    for crop in crops:
        theirs, ours = shipped._ocr.recognize(crop), simplified._ocr.recognize(crop)
        assert theirs.shape == ours.shape
        assert float(np.abs(theirs - ours).max()) < 1e-3          # probabilities, after the softmax
        (their_text, their_score), = [r[:2] for r in shipped._ocr.rec_decode(theirs)]
        (our_text, our_score), = [r[:2] for r in simplified._ocr.rec_decode(ours)]
        assert our_text == their_text and abs(our_score - their_score) < 1e-4, (their_text, our_text)
        texts.append(our_text)
    joined = " ".join(texts)
    assert "ZeroDivisionError" in joined and "1,249.00" in joined and "收件箱" in joined, texts  # real text read


@pytest.mark.parametrize("model", ["Det", "Rec"])
def test_the_simplified_graphs_have_the_per_pixel_passes_folded_away(model):
    import collections

    import onnx
    from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH
    from rapidocr_onnxruntime.utils import read_yaml, update_model_path

    from inference_worker.engines.ocr.folding import simplified_model

    path = Path(update_model_path(read_yaml(DEFAULT_CFG_PATH))[model]["model_path"])
    before = collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)
    simplified = simplified_model(path)
    after = collections.Counter(node.op_type for node in onnx.load_from_string(simplified.model_bytes).graph.node)
    assert simplified.num_hard_swishes == before["Clip"] and after["Clip"] == 0        # every hard-swish shortened
    for layer in ("Conv", "MatMul", "ConvTranspose", "Resize", "Softmax"):              # the model's own layers stay
        assert after[layer] == before[layer], layer
    assert simplified.num_conv_affines >= 20 and simplified.num_input_affines >= 20
    assert after["Mul"] + after["Add"] + after["Div"] < 0.6 * (before["Mul"] + before["Add"] + before["Div"]), after


@pytest.mark.slow
def test_the_simplified_detector_finds_the_boxes_the_wheels_model_finds(readers):
    shipped, simplified = readers
    for image in (render_screen(), render_screen(1024, 768)):
        image = ocr_models.pad_for_detector(ocr_reader.to_bgr(image))
        theirs = shipped._ocr.text_det(image)[0]
        ours = ocr_models.detect_quads(simplified._ocr.text_det, image)
        assert len(ours) == len(theirs) >= len(LINES) and float(np.abs(ours - theirs).max()) <= 1.0


def test_the_detector_input_is_rapidocrs_bit_for_bit_and_so_are_its_quads(readers):
    _, reader = readers
    detector = reader._ocr.text_det
    image = ocr_models.pad_for_detector(ocr_reader.to_bgr(render_screen()))
    theirs = detector.get_preprocess(max(image.shape[:2]))(image)
    ours = ocr_models.det_input(image, detector.mean, detector.std)
    assert ours.dtype == np.float32 and ours.flags.c_contiguous
    assert ours.shape == theirs.shape and np.array_equal(ours, theirs)
    their_quads, our_quads = detector(image)[0], ocr_models.detect_quads(detector, image)   # the same session
    assert len(our_quads) >= len(LINES) and np.array_equal(our_quads, their_quads)


def test_a_frame_off_the_detectors_grid_is_detected_by_rapidocr_itself(readers):
    _, reader = readers
    image = ocr_reader.to_bgr(render_screen(790, 590))                   # not multiples of 32: RapidOCR resizes
    assert np.array_equal(ocr_models.detect_quads(reader._ocr.text_det, image), reader._ocr.text_det(image)[0])


FIRST_ANSWERS = textwrap.dedent("""
    import gc, json, sys
    import psutil
    from inference_worker.engines.base import run_one
    from inference_worker.engines.ocr.engine import OcrEngine
    from inference_worker.engines.ocr.reader import OcrConfig
    from inference_worker.protocol import parse_chat_request
    from deskeye.prompt import build_messages, deskeye_response_format
    from tests.fixtures.chat_requests import png_of
    from tests.test_ocr_models import render_screen

    frames = [render_screen(), render_screen()]
    frames[1].paste((250, 250, 250), (0, 0, 800, 40))                 # a second frame, a little different
    config = OcrConfig() if sys.argv[1] == "warm" else OcrConfig(warm_up_frame_px=(0, 0))
    engine = OcrEngine(config)
    requests = [parse_chat_request({"model": "deskeye-ocr", "response_format": deskeye_response_format(),
                                    "messages": build_messages("What is on this screen?", png_of(frame))})
                for frame in frames]
    process, answers = psutil.Process(), []
    for request in requests:
        gc.collect()
        modules, rss = set(sys.modules), process.memory_info().rss
        completion = run_one(engine, request)
        answers.append({"grown_mib": (process.memory_info().rss - rss) / 2 ** 20,
                        "new_modules": sorted(set(sys.modules) - modules),
                        "lines": completion.facts.ocr.num_lines,
                        "summary": json.loads(completion.text)["summary"]})
    print(json.dumps({"load_s": engine.reader.load_s, "answers": answers}))
""")


def first_answers(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", FIRST_ANSWERS, mode], capture_output=True, text=True, timeout=180,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_warm_up_at_load_leaves_nothing_to_load_or_allocate_for_the_first_answers():
    warm, cold = first_answers("warm"), first_answers("cold")
    for answer in warm["answers"]:
        assert answer["new_modules"] == [], answer["new_modules"]
        assert answer["grown_mib"] < 8, warm
        assert answer["lines"] >= len(LINES) and "Invoice #4411 total $1,249.00" in answer["summary"], answer
    # the same measure without the warm-up: the first request imports the schema validator, and the first two
    # reads allocate onnxruntime's buffers and memory plans (so the measure above is not blind)
    assert cold["answers"][0]["new_modules"], cold
    assert sum(answer["grown_mib"] for answer in cold["answers"]) > 30, cold
    assert [a["lines"] for a in cold["answers"]] == [a["lines"] for a in warm["answers"]]
    assert warm["load_s"] > cold["load_s"]                      # the warm-up is part of the load


@pytest.mark.slow
def test_the_warm_up_runs_when_loading_ahead_and_leaves_no_trace_a_first_read_loads_without_it():
    ahead = OcrReader()
    ahead.load()
    warm_up = ahead.warm_up_result
    assert warm_up is not None and warm_up.frame_size == (800, 600) and len(warm_up.lines) >= 5, warm_up
    assert "Invoice #4411 total $1,249.00" in [line.text for line in warm_up.lines]     # the frame was really read
    assert ahead._rec_cache == {} and ahead._last_frame is None and ahead.num_rec_cache_hits == 0   # no trace
    first = ahead.read(render_screen())
    assert first.is_full_read
    lazy = OcrReader()
    assert lazy.read(render_screen()).lines == first.lines and lazy.warm_up_result is None
    ahead.close()
    lazy.close()


@pytest.mark.slow
def test_without_the_onnx_package_the_models_run_as_shipped_and_read_the_same(readers, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)                      # `import onnx` raises ImportError
    reader = OcrReader(OcrConfig(warm_up_frame_px=(0, 0)))
    lines = reader.read(render_screen()).lines
    assert reader._ocr.num_rewrites == {"det": 0, "rec": 0}
    simplified = readers[1]
    simplified.clear_cache()
    assert [line.text for line in lines] == [line.text for line in simplified.read(render_screen()).lines]
    reader.close()


def test_a_graph_it_cannot_rewrite_is_left_as_shipped(tmp_path):
    from inference_worker.engines.ocr.folding import simplified_model

    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not an onnx model")
    assert simplified_model(broken) is None
