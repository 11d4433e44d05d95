"""Turn the request's encoded images into RGB PIL images, refusing broken files and work without a bound.

An image is decoded only as the type its data URL declares, and only PNG, JPEG, WebP, BMP or GIF: PIL is
told which one decoder it may use (`Image.open(..., formats=[...])`), so a TIFF, JPEG 2000, ICO, DDS, SGI,
SPIDER, QOI or EPS file never reaches its decoder (EPS would run Ghostscript) whatever type it claims.

Everything that sets the cost of decoding is read from the file headers BEFORE any pixel is decoded, for every
image of the request, so a small file cannot buy a long decode: each image's pixel count (--max-image-pixels;
PIL's own bomb guard is mapped to the same 413), the pixels of all the request's images together
(--max-request-pixels, 413), a JPEG's number of scans (each progressive scan is one more pass over the whole
image: 10,000 duplicated scans in a 660 KB file once kept a preprocessing thread busy for minutes, 400) and an
animation's frame count (only the first frame is ever decoded; an absurd count is refused, 400). Between two
images the decoder looks at its request's cancellation event, so a request that timed out or whose client went
away stops within one image, whose work the limits above bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import re
import sys
import threading
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from inference_worker.errors import CancelledError
from inference_worker.protocol import ChatRequest, ImagePart, ProtocolError

#: declared MIME type -> the one PIL decoder allowed for it (protocol.SUPPORTED_IMAGE_MIME lists the same five)
PIL_FORMAT_BY_MIME = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/bmp": "BMP",
                      "image/gif": "GIF"}
#: leading bytes -> what a file is, to say so when it is not what was declared (the data is never decoded)
MAGIC_NAMES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"),
               (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
               (b"\xffO\xffQ", "JPEG 2000"), (b"\x00\x00\x01\x00", "ICO"), (b"DDS ", "DDS"), (b"\x01\xda", "SGI"),
               (b"qoif", "QOI"), (b"%!PS", "PostScript/EPS"), (b"\xc5\xd0\xd3\xc6", "PostScript/EPS"),
               (b"%PDF", "PDF"))
#: scans one JPEG may have. Sequential JPEGs have 1 (or one per colour component), progressive ones about 10
#: (libjpeg's progressive scripts: 6 for greyscale, 10 for colour, 18 for CMYK). PIL's libjpeg decodes every scan
#: it is given, each a pass over the whole image: on the 2-core test machine one duplicated refinement scan of an
#: 8K frame costs 50-100 ms, so this bounds a JPEG to a few seconds where 10,000 scans took minutes.
MAX_JPEG_SCANS = 32
#: frames an animated GIF, PNG or WebP (or a JPEG's MPO extension) may have; only the first is ever decoded
MAX_IMAGE_FRAMES = 1000
#: decoded pixels after which the heap's free pages are handed back to the OS (`release_freed_memory`): after
#: a batch on the model thread, after a request in a preprocessing process (benchmarks/worker_memory.py)
TRIM_AFTER_PIXELS = 3840 * 2160
_JPEG_SOS, _JPEG_EOI = 0xDA, 0xD9


@dataclass(frozen=True, eq=False)
class ImageHeader:
    """One image of a request as its header describes it, opened for decoding but not decoded."""
    where: str                  # e.g. "messages[1].content[0]"
    image: Image.Image          # opened lazily by PIL: only the header has been read

    @property
    def num_pixels(self) -> int:
        width, height = self.image.size
        return width * height

    def describe(self) -> str:
        width, height = self.image.size
        return f"{width}x{height}"


def located_images(request: ChatRequest) -> list[tuple[str, ImagePart]]:
    """Each image with where it sits in the request, e.g. ("messages[1].content[0]", part)."""
    found = []
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.parts):
            if isinstance(part, ImagePart):
                found.append((f"messages[{i}].content[{j}]", part))
    return found


def check_request_images(request: ChatRequest, max_pixels: int, max_request_pixels: int | None = None) -> int:
    """Read every image's header and check what decoding it would cost (see the module docstring); returns the
    request's total pixels, or raises ProtocolError (400, 413, 415). Decodes no pixel."""
    return sum(header.num_pixels for header in _open_request_images(request, max_pixels, max_request_pixels))


def decode_request_images(request: ChatRequest, max_pixels: int, *, max_request_pixels: int | None = None,
                          cancelled: threading.Event | None = None) -> list[Image.Image]:
    """The request's images as RGB, in order, once all their headers passed the checks. `max_request_pixels`
    None: no budget for the request as a whole (its caller checked it already). Raises CancelledError, between
    two images, once `cancelled` is set: nobody wants the rest."""
    pending = _open_request_images(request, max_pixels, max_request_pixels)[::-1]
    images = []
    while pending:
        if cancelled is not None and cancelled.is_set():
            raise CancelledError("the client went away or timed out while its images were decoded")
        images.append(_load_rgb(pending.pop()))     # popped: a converted original is not kept alive by the list
    return images


def decode_image(part: ImagePart, max_pixels: int, where: str = "image") -> Image.Image:
    """An RGB image, or ProtocolError: 400 for bytes that are not a readable image (or too many scans or
    frames), 413 for too many pixels, 415 for a type the worker does not decode."""
    return _load_rgb(open_image(part, max_pixels, where))


def open_image(part: ImagePart, max_pixels: int, where: str = "image") -> ImageHeader:
    """The image's header, checked: its type, its pixel count, and its scans or frames."""
    pil_format = PIL_FORMAT_BY_MIME.get(part.mime)
    if pil_format is None:
        raise ProtocolError(f"{where}: unsupported image type {part.mime!r}; send one of "
                            f"{', '.join(PIL_FORMAT_BY_MIME)}.", param=where, status=415)
    try:
        image = Image.open(io.BytesIO(part.data), formats=[pil_format])      # reads the header only
    except Image.DecompressionBombError as exc:
        raise _too_large(where, _claimed_pixels(exc), max_pixels) from None
    except UnidentifiedImageError:
        raise ProtocolError(f"{where}: the data is not an image of the declared type {part.mime} "
                            f"({_looks_like(part.data)}); send a PNG, JPEG, WebP, BMP or GIF file with its real "
                            "type in the data URL (data:image/png;base64,...).", param=where) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ProtocolError(f"{where}: the image header is broken ({_reason(exc)}).", param=where) from None
    header = ImageHeader(where, image)
    if header.num_pixels > max_pixels:
        raise _too_large(where, f"{header.describe()} = {header.num_pixels:,} pixels", max_pixels)
    _check_scans(part.data, pil_format, where)
    _check_frames(header, part.data, pil_format)
    return header


def _open_request_images(request: ChatRequest, max_pixels: int, max_request_pixels: int | None) -> list[ImageHeader]:
    headers = [open_image(part, max_pixels, where) for where, part in located_images(request)]
    total = sum(header.num_pixels for header in headers)
    if max_request_pixels is not None and total > max_request_pixels:
        raise _request_too_large(headers, total, max_request_pixels)
    return headers


def _load_rgb(header: ImageHeader) -> Image.Image:
    """Decode the (first frame of the) image and convert it to RGB; the decoded original is dropped at once."""
    image = header.image
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ProtocolError(f"{header.where}: the {image.format or 'image'} file is broken ({_reason(exc)}).",
                            param=header.where) from None


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc malloc_trim; False where there is none). Freed image
    buffers (tens to hundreds of MB for large frames) otherwise stay in the worker's RSS: glibc keeps freed
    blocks of up to 32 MB in its arenas, one per thread that decoded."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


_TRIM: list = []


def _malloc_trim():
    """glibc's malloc_trim, looked up once (None off Linux or without it)."""
    if not _TRIM:
        function = None
        if sys.platform.startswith("linux"):
            try:
                function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
            except OSError:
                function = None
        _TRIM.append(function)
    return _TRIM[0]


# ------------------------------------------------------------ scans and frames, from the bytes

def _check_scans(data: bytes, pil_format: str, where: str) -> None:
    if pil_format != "JPEG":
        return
    num_scans = jpeg_scan_count(data, stop_after=MAX_JPEG_SCANS)
    if num_scans > MAX_JPEG_SCANS:
        raise ProtocolError(f"{where}: the JPEG has more than {MAX_JPEG_SCANS} scans; each scan is one more pass "
                            "over the whole image and encoders write about 10, so this worker refuses it before "
                            "decoding. Send the image as a PNG or as a baseline (non-progressive) JPEG.",
                            param=where)


def _check_frames(header: ImageHeader, data: bytes, pil_format: str) -> None:
    if pil_format == "GIF":
        num_frames = gif_frame_count(data, stop_after=MAX_IMAGE_FRAMES)   # PIL's n_frames would walk them all
    else:
        num_frames = int(getattr(header.image, "n_frames", 1))           # PNG acTL, WebP, MPO: declared counts
    if num_frames > MAX_IMAGE_FRAMES:
        raise ProtocolError(f"{header.where}: the {pil_format} has more than {MAX_IMAGE_FRAMES:,} frames; this "
                            "worker reads only the first frame of an animation. Send that frame as a PNG.",
                            param=header.where)


def jpeg_scan_count(data: bytes, stop_after: int) -> int:
    """How many scans (SOS markers) a JPEG has, found by walking its marker segments and skipping the entropy-coded
    data after each scan; linear in the file, and it stops once more than `stop_after` are found. A malformed file
    ends the count where it breaks (PIL then says what is wrong with it); segments inside others (an EXIF
    thumbnail in APP1) are skipped with their parent, as a decoder does."""
    num_scans, pos, end = 0, 2, len(data)          # 2: after SOI
    while pos + 1 < end:
        if data[pos] != 0xFF:
            break                                  # not a marker where one must be
        marker = data[pos + 1]
        if marker == 0xFF:                         # a fill byte before the marker
            pos += 1
            continue
        pos += 2
        if marker == _JPEG_EOI:
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:   # TEM, RSTn, SOI: no length field
            continue
        length = int.from_bytes(data[pos:pos + 2], "big")
        if length < 2:
            break
        pos += length
        if marker == _JPEG_SOS:
            num_scans += 1
            if num_scans > stop_after:
                break
            pos = _end_of_entropy_data(data, pos)
    return num_scans


def _end_of_entropy_data(data: bytes, pos: int) -> int:
    """Where the entropy-coded data starting at `pos` ends: at the first 0xFF that is neither a stuffed 0xFF00
    nor a restart marker (the two 0xFF sequences entropy-coded data may contain)."""
    while True:
        pos = data.find(b"\xff", pos)
        if pos < 0 or pos + 1 >= len(data):
            return len(data)
        following = data[pos + 1]
        if following != 0x00 and not 0xD0 <= following <= 0xD7:
            return pos
        pos += 2


def gif_frame_count(data: bytes, stop_after: int) -> int:
    """How many frames (image descriptors) a GIF has, found by walking its blocks without decoding any; stops
    once more than `stop_after` are found, or where the file breaks."""
    if len(data) < 13:
        return 0
    flags = data[10]
    pos = 13 + (3 << ((flags & 0x07) + 1) if flags & 0x80 else 0)      # after the global colour table
    num_frames = 0
    while pos < len(data):
        kind = data[pos]
        if kind == 0x3B:                           # trailer
            break
        if kind == 0x21:                           # extension: label, then sub-blocks
            pos = _after_sub_blocks(data, pos + 2)
        elif kind == 0x2C:                         # image descriptor, local colour table, LZW size, sub-blocks
            num_frames += 1
            if num_frames > stop_after or pos + 10 > len(data):
                break
            local = data[pos + 9]
            pos += 10 + (3 << ((local & 0x07) + 1) if local & 0x80 else 0)
            pos = _after_sub_blocks(data, pos + 1)
        else:
            break
    return num_frames


def _after_sub_blocks(data: bytes, pos: int) -> int:
    while pos < len(data):
        size = data[pos]
        pos += 1 + size
        if size == 0:
            break
    return pos


# ------------------------------------------------------------ messages

def _looks_like(data: bytes) -> str:
    for magic, name in MAGIC_NAMES:
        if data.startswith(magic):
            return f"it looks like {name}"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "it looks like WebP"
    return "not a file type this worker recognises"


def _too_large(where: str, claimed: str, max_pixels: int) -> ProtocolError:
    return ProtocolError(f"{where}: the image is {claimed}; this worker accepts at most {max_pixels:,} pixels "
                         "(send a smaller region, or start it with a larger --max-image-pixels).",
                         param=where, status=413)


def _request_too_large(headers: list[ImageHeader], total: int, max_request_pixels: int) -> ProtocolError:
    sizes = ", ".join(f"{h.where} {h.describe()}" for h in headers[:8]) + (", ..." if len(headers) > 8 else "")
    return ProtocolError(f"The request's {len(headers)} images have {total:,} pixels together ({sizes}); this "
                         f"worker decodes at most {max_request_pixels:,} pixels per request (send fewer or smaller "
                         "images, or start it with a larger --max-request-pixels).", param="messages", status=413)


def _claimed_pixels(exc: Exception) -> str:
    match = re.search(r"\((\d+) pixels\)", str(exc))     # PIL: "Image size (N pixels) exceeds limit ..."
    return f"{int(match.group(1)):,} pixels" if match else "larger than PIL's decompression-bomb limit"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:160]
