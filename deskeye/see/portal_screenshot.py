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
and logged.

Coordinates: the screenshot is the whole desktop as the compositor composes it (every monitor), in its own pixels:
measured on sway 1.7 (xdg-desktop-portal-wlr, which runs grim), the bounding box of the outputs' layout at the
largest output scale (two outputs 1280x800 and 1024x768 side by side at scale 1: 2304x800; one 1280x800 output at
scale 2: 1280x800 while its layout and Xwayland are 640x400). DeskEye's windows, the monitors it numbers and the
region it watches are in the desktop's own pixels, Xwayland's (`desktop_monitors`, in mss numbering as on X11), so
each grab maps them into the screenshot (`screenshot_map`: the layout's top-left corner at 0,0, one scale). A
screenshot that is not that layout at one scale is refused, naming both sizes: DeskEye cannot tell where the region
and its own windows are in it.
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
from deskeye.see.geometry import FrameMap, Rect
from deskeye.see.monitors import desktop_monitors
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
NOT_THE_DESKTOP = N_("The portal's screenshot is {width}x{height}, which is not the desktop's monitors as Xwayland "
                     "lays them out ({monitors}) at any one scale: DeskEye cannot tell where the watched region and "
                     "its own windows are in it, so it sends nothing.")
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


def screenshot_map(size: tuple[int, int], monitors: list[Rect]) -> tuple[list[Rect], FrameMap]:
    """The monitors (mss numbering, desktop pixels; [0] their bounding box) and where the desktop's pixels lie in a
    screenshot of `size`: the bounding box of `monitors[1:]` (the X server's, `desktop_monitors`) scaled to it, one
    scale for both sides. Without monitors, the screenshot itself is the one monitor, at 0,0 (scale 1). CaptureError
    where the screenshot is not the monitors' bounding box at one scale."""
    width, height = size
    screens = monitors[1:]
    if not screens:
        whole = Rect(0, 0, width, height)
        return [whole, whole], FrameMap()
    left, top = min(m.left for m in screens), min(m.top for m in screens)
    box = Rect(left, top, max(m.right for m in screens) - left, max(m.bottom for m in screens) - top)
    scale = width / box.width if box.width > 0 else 0.0
    if scale <= 0 or abs(box.width * scale - width) > 1 or abs(box.height * scale - height) > 1:
        listed = ", ".join(f"{m.width}x{m.height}+{m.left}+{m.top}" for m in screens)
        raise CaptureError(_(NOT_THE_DESKTOP).format(width=width, height=height, monitors=listed))
    return [box, *screens], FrameMap(left, top, scale, scale)


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
            self._screenshot()                        # the screen's layout, and the proof that it works
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
        self._monitors, self._map = screenshot_map(image.size, desktop_monitors())
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
        """The desktop's monitors as the last screenshot found them (desktop pixels, mss numbering)."""
        return list(self._monitors)

    def grab(self, rect: Rect) -> "Image.Image":
        """`rect` (desktop pixels) cut out of a new screenshot, in the screenshot's own pixels."""
        image = self._screenshot()
        left, top, right, bottom = self._map.box(rect)
        box = (max(left, 0), max(top, 0), min(right, image.width), min(bottom, image.height))
        if box[2] <= box[0] or box[3] <= box[1]:
            raise CaptureError(_(REGION_OFF_SCREEN).format(region=rect, width=image.width, height=image.height))
        return image.crop(box)

    def why_black(self, rect: Rect) -> str:
        """The portal hands the compositor's own pixels: a black screenshot is what the screen shows."""
        return ""

    def close(self) -> None:
        self._bus.close()
