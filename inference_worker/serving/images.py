"""Turn the request's encoded images into RGB PIL images, refusing broken files and decompression bombs.

The pixel count is read from the file header and checked BEFORE the pixels are decoded, so a small file
claiming a huge size costs nothing. PIL's own bomb guard is mapped to the same 413 answer.
"""

from __future__ import annotations

import io
import re

from PIL import Image, UnidentifiedImageError

from inference_worker.protocol import ChatRequest, ImagePart, ProtocolError


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
    try:
        image = Image.open(io.BytesIO(part.data))      # reads the header only
    except Image.DecompressionBombError as exc:
        raise _too_large(where, _claimed_pixels(exc), max_pixels) from None
    except UnidentifiedImageError:
        raise ProtocolError(f"{where}: the data is not an image this worker can read ({part.mime} was declared); "
                            "send a PNG, JPEG, WebP, BMP or GIF file.", param=where) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ProtocolError(f"{where}: the image header is broken ({_reason(exc)}).", param=where) from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_large(where, f"{width}x{height} = {width * height:,} pixels", max_pixels)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ProtocolError(f"{where}: the {image.format or 'image'} file is broken ({_reason(exc)}).",
                            param=where) from None


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
