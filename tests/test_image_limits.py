"""Image decoding is bounded and stops with its request: a crafted progressive JPEG (8K greyscale, 10,000 duplicated
scans, 660 KB), an animation with an absurd frame count and images over the request's pixel budget are refused
from their headers, before any pixel is decoded, with a message that says why and what to send instead; a request
that ends (its client went away) stops decoding between two images; the next request is answered at once. Also:
a data URL with MIME parameters (data:image/png;name=a.png;base64,...) is accepted, as RFC 2397 allows.

The serving tests run a real OCR-engine worker (it starts in seconds) over HTTP, with one preprocessing thread:
the setting where one stuck decode held every other request hostage.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from PIL import Image

from benchmarks._harness import process_tree_rss_mb
from benchmarks.worker_memory import PeakSampler
from inference_worker import config
from inference_worker.errors import CancelledError
from inference_worker.protocol import (ChatRequest, ImagePart, Message, ProtocolError, SamplingParams,
                                       decode_data_url)
from inference_worker import images
from inference_worker.images import decode_image, decode_request_images
from tests.fixtures.hostile_images import (data_url, gif_with_frames, image_request, png16, progressive_jpeg)
from tests.fixtures.worker import REPO_ROOT, running_worker, worker_env

pytestmark = [pytest.mark.subprocess]

CHAT = "/v1/chat/completions"
REQUEST_TIMEOUT_S = 20          # --request-timeout-s: without a scan limit the crafted JPEG got 504 at this


def small_png(colour=(20, 120, 220)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def ocr_worker(tmp_path_factory):
    """An OCR-engine worker with ONE preprocessing thread and the default image limits."""
    with running_worker(["--engine", "ocr", "--preprocess-threads", "1", "--request-timeout-s",
                         str(REQUEST_TIMEOUT_S)], tmp_path_factory.mktemp("ocr_worker")) as worker:
        yield worker


def assert_answers_a_small_request(worker, within_s: float = 10.0) -> None:
    started_s = time.monotonic()
    status, body = worker.request("POST", CHAT, image_request([data_url(small_png(), "image/png")]))
    assert status == 200, body
    assert time.monotonic() - started_s < within_s


# ------------------------------------------------------------ over HTTP

@pytest.mark.slow
def test_a_progressive_jpeg_with_10000_scans_is_refused_at_once_and_the_next_request_is_answered(ocr_worker):
    crafted = progressive_jpeg(7680, 4320, num_scans=10_000)          # 8K greyscale, ~660 KB
    assert len(crafted) < 700_000
    started_s = time.monotonic()
    status, body = ocr_worker.request("POST", CHAT, image_request([data_url(crafted, "image/jpeg")]))
    assert status == 400, body                  # without a scan limit: decoded for minutes, 504
    message = body["error"]["message"]
    for words in ("messages[0].content[1]", f"more than {images.MAX_JPEG_SCANS} scans", "PNG", "baseline"):
        assert words in message, message
    assert body["error"]["param"] == "messages[0].content[1]"
    assert_answers_a_small_request(ocr_worker)      # the one preprocessing thread is free
    assert time.monotonic() - started_s < 10.0      # refused from its header: no decoding behind it


def test_a_progressive_jpeg_as_encoders_write_it_is_still_answered(ocr_worker):
    buffer = io.BytesIO()
    Image.effect_noise((640, 480), 60).convert("RGB").save(buffer, "JPEG", progressive=True)    # 10 scans
    status, body = ocr_worker.request("POST", CHAT, image_request([data_url(buffer.getvalue(), "image/jpeg")]))
    assert status == 200, body


@pytest.mark.slow
def test_images_over_the_request_pixel_budget_get_413_before_any_is_decoded(ocr_worker):
    """The trial's request: four 8K 16-bit PNGs (a few hundred KB each on the wire, 2.1 GB of RSS once decoded)."""
    frame_8k = data_url(png16(7680, 4320), "image/png")
    baseline_mb = process_tree_rss_mb(ocr_worker.proc.pid)
    with PeakSampler(ocr_worker.proc.pid) as sampler:
        status, body = ocr_worker.request("POST", CHAT, image_request([frame_8k] * 4))
    assert status == 413, body                  # without a budget: all four decoded, 200
    message = body["error"]["message"]
    for words in ("4 images", "132,710,400 pixels", "7680x4320",
                  f"at most {config.DEFAULT_MAX_REQUEST_PIXELS:,} pixels", "--max-request-pixels"):
        assert words in message, message
    assert sampler.peak_mb - baseline_mb < 100, f"RSS rose {sampler.peak_mb - baseline_mb:.0f} MB: it decoded"
    assert_answers_a_small_request(ocr_worker)


def test_an_animation_with_an_absurd_frame_count_is_refused_without_decoding_it(ocr_worker):
    gif = gif_with_frames(1001)                  # one more than the limit, 1,000
    status, body = ocr_worker.request("POST", CHAT, image_request([data_url(gif, "image/gif")]))
    assert status == 400, body
    message = body["error"]["message"]
    assert f"more than {images.MAX_IMAGE_FRAMES:,} frames" in message and "first frame" in message, message
    assert_answers_a_small_request(ocr_worker)


@pytest.mark.parametrize("header", ["data:image/png;name=a.png;base64,",
                                    "data:image/png;charset=utf-8;name=screen%20shot.png;base64,"])
def test_a_data_url_with_mime_parameters_is_accepted(ocr_worker, header):
    url = header + data_url(small_png(), "image/png").split(",", 1)[1]
    status, body = ocr_worker.request("POST", CHAT, image_request([url]))
    assert status == 200, body                  # was 400 "only base64 data URLs are accepted"


@pytest.mark.slow
def test_a_request_whose_client_went_away_stops_decoding_between_two_images(tmp_path):
    """Eight legitimate 2560x1600 progressive JPEGs (30 scans each; within every limit, the request's pixel budget
    included): decoding them takes seconds. The client of that request goes away at once; the next client must not
    wait for the other images."""
    jpegs = [progressive_jpeg(2560, 1600, num_scans=30)] * 8
    started_s = time.perf_counter()
    for data in jpegs:                          # what decoding them all costs on this machine now
        Image.open(io.BytesIO(data)).convert("RGB")
    decode_all_s = time.perf_counter() - started_s
    with running_worker(["--engine", "ocr", "--preprocess-threads", "1", "--max-images", "8"], tmp_path) as worker:
        assert_answers_a_small_request(worker)
        body = json.dumps(image_request([data_url(data, "image/jpeg") for data in jpegs])).encode()
        conn = http.client.HTTPConnection(worker.host, worker.port, timeout=0.3)
        try:
            conn.request("POST", CHAT, body=body, headers={"Authorization": f"Bearer {worker.api_key}",
                                                           "Content-Type": "application/json"})
            with pytest.raises((socket.timeout, TimeoutError)):
                conn.getresponse()
        finally:
            conn.close()                        # the client goes away while its images are decoded
        gone_s = time.perf_counter()
        assert_answers_a_small_request(worker)
        waited_s = time.perf_counter() - gone_s
    # without the check between images the next request waits for all eight (~decode_all_s); now for
    # the image being decoded, at most
    assert waited_s < max(0.5, decode_all_s / 2), f"waited {waited_s:.1f} s; decoding all takes {decode_all_s:.1f} s"


def test_a_request_budget_below_the_image_limit_is_refused_at_start():
    result = subprocess.run([sys.executable, "-m", "inference_worker.cli", "--engine", "ocr", "--max-image-pixels",
                             "50000000", "--max-request-pixels", "40000000"], capture_output=True, text=True,
                            timeout=60, cwd=REPO_ROOT, env=worker_env())
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "--max-request-pixels must be an integer >= --max-image-pixels (50000000); got 40000000" in result.stderr


# ------------------------------------------------------------ the decoder itself

@pytest.mark.parametrize("mode, num_scans", [("L", 6), ("RGB", 10), ("CMYK", 18)])
def test_progressive_jpegs_as_encoders_write_them_decode(mode, num_scans):
    buffer = io.BytesIO()
    Image.new(mode, (320, 240), 200 if mode == "L" else (200,) * len(mode)).save(buffer, "JPEG", progressive=True)
    assert images.jpeg_scan_count(buffer.getvalue(), stop_after=100) == num_scans   # libjpeg's progressive scripts
    image = decode_image(ImagePart(buffer.getvalue(), "image/jpeg"), 10**6)
    assert image.mode == "RGB" and image.size == (320, 240)


def test_one_scan_more_than_the_limit_is_refused():
    limit = images.MAX_JPEG_SCANS
    assert decode_image(ImagePart(progressive_jpeg(64, 64, limit), "image/jpeg"), 10**6).size == (64, 64)
    with pytest.raises(ProtocolError, match=f"more than {limit} scans") as refused:
        decode_image(ImagePart(progressive_jpeg(64, 64, limit + 1), "image/jpeg"), 10**6)
    assert refused.value.status == 400


def test_scans_in_an_exif_thumbnail_or_between_restart_markers_are_not_the_images():
    noise = Image.effect_noise((256, 256), 80).convert("RGB")
    thumbnail = io.BytesIO()
    noise.resize((32, 32)).save(thumbnail, "JPEG", progressive=True)
    exif = Image.Exif()
    exif[0x010F] = "camera"
    buffer = io.BytesIO()
    noise.save(buffer, "JPEG", exif=exif, restart_marker_blocks=1, comment=thumbnail.getvalue() * 20)
    assert images.jpeg_scan_count(buffer.getvalue(), stop_after=100) == 1   # the COM segment's scans are skipped
    assert decode_image(ImagePart(buffer.getvalue(), "image/jpeg"), 10**6).size == (256, 256)


@pytest.mark.parametrize("pil_format, mime", [("GIF", "image/gif"), ("PNG", "image/png"), ("WEBP", "image/webp")])
def test_an_animation_decodes_its_first_frame(pil_format, mime):
    frames = [Image.new("RGB", (40, 30), colour) for colour in ((250, 0, 0), (0, 250, 0), (0, 0, 250))]
    buffer = io.BytesIO()
    frames[0].save(buffer, pil_format, save_all=True, append_images=frames[1:], duration=50, lossless=True)
    image = decode_image(ImagePart(buffer.getvalue(), mime), 10**6)
    assert image.size == (40, 30) and image.getpixel((5, 5)) == (250, 0, 0)


def test_decoding_stops_before_the_next_image_once_its_request_is_cancelled():
    part = decode_data_url(data_url(small_png(), "image/png"))
    chat = ChatRequest(model="deskeye", messages=(Message("user", (part, part)),), sampling=SamplingParams())
    assert len(decode_request_images(chat, 10**6, cancelled=threading.Event())) == 2
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(CancelledError):
        decode_request_images(chat, 10**6, cancelled=cancelled)


@pytest.mark.parametrize("url, status, words", [
    ("data:image/png;base64;name=a.png,AAAA", 400, "only base64 data URLs"),
    ("data:image/png,AAAA", 400, "only base64 data URLs"),
    ("data:image/png" + ";x=y" * 300 + ";base64,AAAA", 400, "only base64 data URLs"),
    ("data:text/plain;name=a.png;base64,AAAA", 415, "'text/plain'"),
    ("https://example.com/a.png", 400, "never fetches remote URLs"),
])
def test_data_urls_still_need_an_image_type_and_base64(url, status, words):
    with pytest.raises(ProtocolError) as refused:
        decode_data_url(url, "messages[0].content[1]")
    assert refused.value.status == status and words in str(refused.value)
    assert str(refused.value).startswith("messages[0].content[1]: ")


def test_a_data_url_keeps_its_type_whatever_parameters_follow():
    png = small_png()
    part = decode_data_url("DATA:Image/PNG;name=a.png;x-unknown=1;base64," + data_url(png, "image/png").split(",")[1])
    assert part == ImagePart(png, "image/png")
