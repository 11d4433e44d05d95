"""The OCR models: RapidOCR's PP-OCRv4 detector and recogniser from the rapidocr-onnxruntime wheel (nothing is
downloaded), loaded with DeskEye's onnxruntime options and their graphs folded (folding.py), and the inputs each
model reads. reader.py decides what to read; this module only runs the models.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DET_STRIDE = 32                    # the detector's input grid: sides are multiples of this

#: RapidOCR's detector ("max" limit) resizes an image whose longer side is above this; up to it, an image whose
#: sides are multiples of 32 goes in as it is
DET_MAX_UNRESIZED_SIDE_PX = 2000


def detect_quads(text_det: Any, image: np.ndarray) -> np.ndarray | None:
    """RapidOCR's detection of `image` (BGR uint8): its quads, as `text_det(image)` finds them. On the detector's
    grid the input is normalised here, into one float32 buffer (RapidOCR's goes through float64 and three copies:
    ~8 ms for an 800x600 frame, here ~1 ms); with the wheel's mean and std (0.5) the values are the same, bit for
    bit (tests/test_ocr_models.py)."""
    height, width = image.shape[:2]
    if height % DET_STRIDE or width % DET_STRIDE or max(height, width) > DET_MAX_UNRESIZED_SIDE_PX:
        return text_det(image)[0]
    preds = text_det.infer(det_input(image, text_det.mean, text_det.std))[0]
    boxes, _ = text_det.postprocess_op(preds, (height, width))
    return text_det.filter_tag_det_res(boxes, (height, width))


def det_input(image: np.ndarray, mean: Any, std: Any) -> np.ndarray:
    """(image / 255 - mean) / std per channel, as a contiguous 1x3xHxW float32 array, computed in place."""
    height, width = image.shape[:2]
    x = np.empty((1, 3, height, width), np.float32)
    mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    for channel in range(3):
        plane = x[0, channel]
        np.multiply(image[:, :, channel], np.float32(1 / 255.0), out=plane)
        plane -= np.float32(mean[channel])
        plane /= np.float32(std[channel])
    return x


@dataclass(frozen=True)
class Models:
    """The detector and the recogniser (no angle classifier: screen text is upright), and RapidOCR's crop."""
    text_det: Any                    # RapidOCR's TextDetector: its session (`infer`, simplified) and box finding
    rec_session: Any                 # onnxruntime session of the recogniser (simplified: folding.py)
    rec_decode: Any                  # CTC decoding of the recogniser's output -> [(text, score)]
    crop: Any                        # (bgr, quad) -> the quad's crop, upright
    num_rewrites: dict[str, int]     # {"det": n, "rec": n}: op patterns folded away (0: the model as shipped)

    def recognize(self, x: np.ndarray) -> np.ndarray:
        return self.rec_session.run(None, {self.rec_session.get_inputs()[0].name: x})[0]


def load_models(num_threads: int, *, simplify: bool) -> Models:
    """The detector and the recogniser from the wheel (no network), `num_threads` for one read (0: one per CPU),
    their graphs folded unless `simplify` is off."""
    # onnxruntime >= 1.29 ships telemetry on Linux too: it writes a device id under ~/.cache/Microsoft and
    # queues usage events for upload. DeskEye promises that nothing leaves the machine, so opt out before
    # onnxruntime initialises (the variable is read once per process).
    os.environ["ORT_DISABLE_TELEMETRY"] = "1"
    from rapidocr_onnxruntime import RapidOCR  # onnxruntime + opencv: imported on first use only
    from rapidocr_onnxruntime.ch_ppocr_det import TextDetector
    from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH
    from rapidocr_onnxruntime.utils import read_yaml, update_model_path
    from rapidocr_onnxruntime.utils.infer_engine import OrtInferSession

    threads = resolved_threads(num_threads)
    make_options = OrtInferSession._init_sess_opts

    def our_options(session_config: dict) -> Any:
        # Idle onnxruntime threads spin by default: on two shared cores that burns the CPU the app and
        # the capture loop need, for no gain in latency (benchmarks/ocr_latency.py, cpu_s column).
        options = make_options(session_config)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # RapidOCR turns the memory arena off: every read then allocates the detector's feature maps afresh,
        # ~25% of its time on an 800x600 frame; with the arena they are reused (it keeps the largest frame's)
        options.enable_cpu_mem_arena = True
        return options

    models = update_model_path(read_yaml(DEFAULT_CFG_PATH))     # the wheel's own model files and settings
    OrtInferSession._init_sess_opts = staticmethod(our_options)   # during this load only
    try:
        # detection: one large image, `threads` intra-op threads; "max" never scales up (_fit scales down).
        # The angle classifier is not loaded (RapidOCR() would: ~0.05 s).
        det_config = {**models["Det"], "limit_type": "max", "intra_op_num_threads": threads, "inter_op_num_threads": 1}
        text_det = TextDetector(det_config)
        # recognition: one intra-op thread per call, `threads` calls at once (onnxruntime runs a session from
        # several threads concurrently)
        rec_config = {"intra_op_num_threads": 1, "inter_op_num_threads": 1}
        rec_session, num_rec = _session(models["Rec"]["model_path"], our_options(rec_config), simplify)
        if simplify:      # RapidOCR's detector keeps its pre- and post-processing, on the folded graph
            text_det.infer.session, num_det = _session(models["Det"]["model_path"], our_options(det_config), True)
        else:
            num_det = 0
    finally:
        OrtInferSession._init_sess_opts = staticmethod(make_options)
    # RapidOCR's perspective crop of one quad (it reads nothing of its instance)
    return Models(text_det, rec_session, _ctc_decoder(rec_session), lambda bgr, quad: RapidOCR.get_crop_img_list(
        None, bgr, [quad])[0], {"det": num_det, "rec": num_rec})


def _session(model_path: str, options: Any, simplify: bool) -> tuple[Any, int]:
    """An onnxruntime session of the wheel's model at `model_path`, its graph simplified (folding.py) unless
    `simplify` is off or the onnx package is missing; and how many op patterns the simplification folded away."""
    from onnxruntime import InferenceSession

    from inference_worker.engines.ocr.folding import simplified_model

    simplified = simplified_model(Path(model_path)) if simplify else None
    session = InferenceSession(simplified.model_bytes if simplified else model_path, sess_options=options,
                               providers=[("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})])
    return session, simplified.num_rewrites if simplified else 0


def _ctc_decoder(session: Any) -> Any:
    """RapidOCR's CTC decoding with the character list stored in the model's metadata."""
    from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode

    return CTCLabelDecode(character=session.get_modelmeta().custom_metadata_map["character"].splitlines())


def resolved_threads(num_threads: int) -> int:
    """The threads one read uses: `num_threads`, at most one per CPU (0 = one per CPU)."""
    cpus = os.cpu_count() or 1
    return min(num_threads, cpus) if num_threads else cpus


def rec_input(crop: np.ndarray, height_px: int, stretch: float = 1.0) -> np.ndarray:
    """The recogniser's input for one crop: `height_px` high, its aspect kept (its width times `stretch`: more
    frames per glyph, glyphs.py), normalised to -1..1, 1x3xHxW."""
    import cv2

    crop_h, crop_w = crop.shape[:2]
    width_px = max(height_px // 2, int(math.ceil(stretch * height_px * crop_w / max(1, crop_h))))
    x = cv2.resize(crop, (width_px, height_px)).astype(np.float32).transpose(2, 0, 1)
    return ((x / 255.0 - 0.5) / 0.5)[np.newaxis]


def pad_for_detector(region: np.ndarray) -> np.ndarray:
    """Pad right and bottom with the border colour to the detector's grid (multiples of 32, so it is
    not resized) and to a sane aspect ratio (it misreads thin strips: height >= width / 8)."""
    import cv2

    height, width = region.shape[:2]
    target_h = _round_up(max(height, 64, math.ceil(width / 8)), DET_STRIDE)
    target_w = _round_up(max(width, 64, math.ceil(height / 8)), DET_STRIDE)
    if (target_h, target_w) == (height, width):
        return region
    border = np.concatenate([region[0], region[-1], region[:, 0], region[:, -1]])
    colour = tuple(int(c) for c in np.median(border, axis=0))
    return cv2.copyMakeBorder(region, 0, target_h - height, 0, target_w - width, cv2.BORDER_CONSTANT, value=colour)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step
