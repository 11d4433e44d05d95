"""Turn the request's encoded images into RGB PIL images, refusing broken files and decompression bombs.

An image is decoded only as the type its data URL declares, and only PNG, JPEG, WebP, BMP or GIF: PIL is
told which one decoder it may use (`Image.open(..., formats=[...])`), so a TIFF, JPEG 2000, ICO, DDS, SGI,
SPIDER, QOI or EPS file never reaches its decoder (EPS would run Ghostscript) whatever type it claims.
The pixel count is read from the file header and checked BEFORE the pixels are decoded, so a small file
claiming a huge size costs nothing. PIL's own bomb guard is mapped to the same 413 answer.
"""

from __future__ import annotations

import io
import re

from PIL import Image, UnidentifiedImageError

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


def located_images(request: ChatRequest) -> list[tuple[str, ImagePart]]:
    """Each image with where it sits in the request, e.g. ("messages[1].content[0]", part)."""
    found = []
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.parts):
            if isinstance(part, ImagePart):
                found.append((f"messages[{i}].content[{j}]", part))
    return found


def decode_request_images(request: ChatRequest, max_pixels: int) -> list[Image.Image]:
    return [decode_image(part, max_pixels, where) for where, part in located_images(request)]


def decode_image(part: ImagePart, max_pixels: int, where: str = "image") -> Image.Image:
    """An RGB image, or ProtocolError: 400 for bytes that are not a readable image, 413 for too many pixels."""
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
    except (OSError, SyntaxError, ValueError) as exc:
        raise ProtocolError(f"{where}: the image header is broken ({_reason(exc)}).", param=where) from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_large(where, f"{width}x{height} = {width * height:,} pixels", max_pixels)
    try:
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ProtocolError(f"{where}: the {image.format or 'image'} file is broken ({_reason(exc)}).",
                            param=where) from None


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


def _claimed_pixels(exc: Exception) -> str:
    match = re.search(r"\((\d+) pixels\)", str(exc))     # PIL: "Image size (N pixels) exceeds limit ..."
    return f"{int(match.group(1)):,} pixels" if match else "larger than PIL's decompression-bomb limit"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:160]
