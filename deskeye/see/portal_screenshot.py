"""Seeing a Wayland screen through the portal's Screenshot: one still image per grab, where no stream comes.

The fallback of deskeye/see/portal_screencast.py: xdg-desktop-portal-wlr (sway, Hyprland, river) streams only into
GPU buffers, so on a machine without a GPU its ScreenCast sends no frame; its Screenshot works there. Each grab asks
for a screenshot with `interactive=false` (the desktop shows no dialog once the user allowed DeskEye) and crops the
region out of it: 0.15-0.6 s a grab, fine at the capture interval, which is why ScreenCast comes first.

The portal answers a `file://` URI of a PNG it wrote. The URI is a D-Bus reply, so it is checked before a byte is
read: a local path (no host), absolute, of a regular file (not a link, FIFO or device) owned by this user, of a
bounded size. That file is a picture of the whole screen, left on disk at every capture interval (GNOME 43 writes a
new ~/Screenshot.png, Screenshot-1.png, ... in the Pictures folder, else home, for every shot; KDE writes into
~/Pictures; xdg-desktop-portal-wlr overwrites /tmp/out.png): exactly what the exclusions keep from being seen. So once
it is read DeskEye deletes it (`remove_screenshot`), but only the file this request made: still the same file it read
(device and inode, looked up again without following a link, in the folder opened once), a regular file of this
user, and written after the request began (its mtime and ctime, give or take CLOCK_SLACK_S). A file that fails any
of that (a user's own picture the portal happened to name, a link, a file replaced meanwhile) is left where it is
and logged. The screen DeskEye sees is the whole screenshot (every monitor, as the desktop composes it), at 0,0.
"""

from __future__ import annotations

import io
import logging
import os
import stat
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from deskeye.errors import CaptureError
from deskeye.language import N_, _
from deskeye.see.geometry import Rect
from deskeye.see.portal_request import NO_PORTAL, PortalBus, error_text
from deskeye.see.portal_screencast import desktop_name

if TYPE_CHECKING:
    from PIL import Image

    from deskeye.see.session import Session

log = logging.getLogger(__name__)

SCREENSHOT = "org.freedesktop.portal.Screenshot"
SCREENSHOT_TIMEOUT_S = 20.0
MAX_SCREENSHOT_BYTES = 256 * 1024 * 1024      # a PNG of several 8K monitors stays well under this
CLOCK_SLACK_S = 2.0          # a file's times may lag the request's start by this (coarse file-system timestamps)

# What the user reads (translated where it is raised).
BAD_SCREENSHOT = N_("The screenshot portal answered a file DeskEye does not read ({why}).")
REGION_OFF_SCREEN = N_("The region {region} lies outside the screen ({width}x{height}): set capture.region (or "
                       "--region) inside it.")


def screenshot_path(uri: str) -> Path:
    """The local file behind the portal's answer, or CaptureError (the URI is untrusted text)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise CaptureError(_(BAD_SCREENSHOT).format(why="not a local file:// URI"))
    path = Path(urllib.parse.unquote(parts.path))
    if not path.is_absolute() or "\0" in parts.path:
        raise CaptureError(_(BAD_SCREENSHOT).format(why="not an absolute path"))
    return path


def read_screenshot(path: Path) -> bytes:
    """The bytes of the screenshot the portal wrote: a regular file of this user, not a link, bounded in size."""
    return read_screenshot_file(path)[0]


def read_screenshot_file(path: Path) -> tuple[bytes, os.stat_result]:
    """`read_screenshot`'s bytes and the file they were read from (its fstat: which file to delete afterwards)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CaptureError(_(BAD_SCREENSHOT).format(why=f"{path}: {exc.strerror or exc}")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CaptureError(_(BAD_SCREENSHOT).format(why=f"{path} is not a regular file"))
        if info.st_uid != os.getuid():
            raise CaptureError(_(BAD_SCREENSHOT).format(why=f"{path} belongs to another user"))
        if info.st_size > MAX_SCREENSHOT_BYTES:
            raise CaptureError(_(BAD_SCREENSHOT).format(why=f"{path} is {info.st_size} bytes"))
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_SCREENSHOT_BYTES:
                raise CaptureError(_(BAD_SCREENSHOT).format(why=f"{path} grew past {MAX_SCREENSHOT_BYTES} bytes"))
        return b"".join(chunks), info
    finally:
        os.close(fd)


def remove_screenshot(path: Path, read: os.stat_result, since_s: float) -> str:
    """Delete the screenshot at `path` if it is the file that was read (`read`: its fstat), a regular file of this
    user written at or after `since_s` (time.time() when the request began); "" once deleted, else why it was left.
    The name is looked up in its folder, opened once, without following a link, and deleted from that folder."""
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return f"its folder cannot be opened: {exc.strerror or exc}"
    try:
        info = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            return "it is no longer a regular file"
        if (info.st_dev, info.st_ino) != (read.st_dev, read.st_ino):
            return "it is no longer the file DeskEye read"
        if info.st_uid != os.getuid():
            return "it belongs to another user"
        if min(info.st_mtime, info.st_ctime) < since_s - CLOCK_SLACK_S:
            return "it was written before DeskEye asked for it"
        os.unlink(path.name, dir_fd=folder)
        return ""
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(folder)


class PortalScreenshotBackend:
    """The capture backend of a Wayland session whose portal takes screenshots but streams nothing (wlroots
    without a GPU). One per thread, like every backend; each grab is one portal call."""

    def __init__(self, session: "Session", environ: Mapping[str, str] = os.environ):
        self.session = session
        self._bus = PortalBus(environ)
        self.name = f"xdg-desktop-portal Screenshot ({desktop_name(environ)})"
        self._left: set[str] = set()          # why screenshots were left on disk, each said once as a warning
        try:
            try:
                self._bus.property(SCREENSHOT, "version")
            except Exception as exc:   # GLib.Error: no portal, or none with Screenshot
                raise CaptureError(_(NO_PORTAL).format(cause=error_text(exc))) from None
            self._size = self._screenshot().size      # the screen's size, and the proof that it works
        except BaseException:
            self._bus.close()
            raise

    def _screenshot(self) -> "Image.Image":
        from PIL import Image, UnidentifiedImageError

        asked_s = time.time()
        results = self._bus.request(SCREENSHOT, "Screenshot", "(sa{sv})",
                                    ("", {"interactive": self._bus.variant("b", False)}),
                                    timeout_s=SCREENSHOT_TIMEOUT_S)
        uri = results.get("uri")
        if not isinstance(uri, str):
            raise CaptureError(_(BAD_SCREENSHOT).format(why="no uri in the answer"))
        path = screenshot_path(uri)
        data, read = read_screenshot_file(path)
        self._remove(path, read, asked_s)
        try:
            with Image.open(io.BytesIO(data)) as image:
                image = image.convert("RGB")
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise CaptureError(_(BAD_SCREENSHOT).format(why=f"{path}: {exc}")) from None
        log.debug("portal screenshot %dx%d from %s", image.width, image.height, path)
        self._size = image.size
        return image

    def _remove(self, path: Path, read: os.stat_result, asked_s: float) -> None:
        """Delete the picture of the screen the portal left (`remove_screenshot`); where it must stay, say why
        (a warning the first time for each reason)."""
        why = remove_screenshot(path, read, asked_s)
        if not why:
            log.debug("deleted the portal's screenshot %s", path)
        elif why not in self._left:
            self._left.add(why)
            log.warning("The portal's screenshot %s was left on disk: %s.", path, why)
        else:
            log.debug("the portal's screenshot %s was left on disk: %s", path, why)

    def monitors(self) -> list[Rect]:
        width, height = self._size
        return [Rect(0, 0, width, height), Rect(0, 0, width, height)]

    def grab(self, rect: Rect) -> "Image.Image":
        image = self._screenshot()
        box = (max(rect.left, 0), max(rect.top, 0), min(rect.left + rect.width, image.width),
               min(rect.top + rect.height, image.height))
        if box[2] <= box[0] or box[3] <= box[1]:
            raise CaptureError(_(REGION_OFF_SCREEN).format(region=rect, width=image.width, height=image.height))
        return image.crop(box)

    def why_black(self, rect: Rect) -> str:
        """The portal hands the compositor's own pixels: a black screenshot is what the screen shows."""
        return ""

    def close(self) -> None:
        self._bus.close()
