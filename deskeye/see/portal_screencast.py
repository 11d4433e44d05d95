"""Seeing a Wayland screen through the portal's ScreenCast: a PipeWire stream of one monitor, read with GStreamer.

The portal (org.freedesktop.portal.ScreenCast) asks the user once which monitor DeskEye may see; with
`persist_mode=2` it answers a restore token (deskeye/see/portal_token.py) that skips the dialog from then on. Start
hands a PipeWire node and OpenPipeWireRemote a socket to it; the pipeline
`pipewiresrc fd=FD path=NODE ! videoconvert ! appsink` keeps only the latest frame (max-buffers=1, drop=true). The
compositor sends a frame when the screen changes: a static screen costs nothing. The appsink takes the compositor's
own 32-bit formats (GNOME sends BGRx), so videoconvert passes frames through untouched: a frame is converted to RGB
only when a grab asks for it, once, not every frame the compositor sends (up to 60 a second while something moves);
a grab crops the region out of that copy, so the capture loop's grabs of a static screen copy only the region
(benchmarks/app_idle.py, benchmarks/portal_capture.py). PipeWire's session manager (wireplumber) links the
stream to the pipeline; where none runs, pipewiresrc gives up after its 30 s wait and DeskEye names it.

Coordinates: the screen DeskEye sees is the one monitor the portal streams (`capture.monitor` 0 and 1 both name it),
in the desktop's pixels, where Xwayland places DeskEye's windows: the portal's Start says where the monitor lies in
the compositor's layout (`position`) and its logical `size`, which are those pixels; the stream is in the monitor's
physical pixels with its own 0,0, so a grab maps the region into it (`stream_map`: the offset, and the scale from the
logical size to the stream's). Where the portal does not say, or says a place that is not one of Xwayland's monitors,
DeskEye cannot tell where its own windows are in the frames: it says so once (a warning naming both) and takes the
stream as the monitor at 0,0 at scale 1. Measured on headless GNOME 43 at scale 1 (one monitor, and two side by side
with the first one streamed): position 0,0 and the stream's size, which Xwayland reports too. A streamed monitor at
an offset or scaled is mapped as the portal's documentation says, not measured.

"Watch this window" (`capture.source = "window"`): the desktop's dialog offers windows instead of monitors, and the
stream is that one window's pixels, wherever it is and whatever covers it. Then the screen DeskEye sees is the window
itself, at 0,0 in its own pixels: no other window is in its frames, DeskEye's own neither (nothing to mask), and the
restore token is kept apart from the monitor's (deskeye/see/portal_token.py).

One stream serves every thread of the process that grabs (`ScreenGrabber` opens a backend per thread): the first
backend opens it, the last one's close() stops the pipeline and ends the portal session. A stream that ended (the
user stopped the sharing in the desktop's indicator) is not reopened behind the user's back: the grab says so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Mapping

from deskeye.errors import CaptureError
from deskeye.language import N_, _
from deskeye.see.geometry import FrameMap, Rect
from deskeye.see.monitors import desktop_monitors
from deskeye.see.portal_request import NO_PORTAL, PortalBus, error_text, import_gio
from deskeye.see.portal_token import load_token, save_token, token_path

if TYPE_CHECKING:
    from PIL import Image

    from deskeye.see.session import Session

log = logging.getLogger(__name__)

SCREENCAST = "org.freedesktop.portal.ScreenCast"
SOURCE_MONITOR = 1
SOURCE_WINDOW = 2
SOURCE_TYPES = {"monitor": SOURCE_MONITOR, "window": SOURCE_WINDOW}      # capture.source
CURSOR_HIDDEN = 1                  # the pointer is left out of the frames (it is not part of what is on screen)
PERSIST_UNTIL_REVOKED = 2
PERSIST_MIN_VERSION = 4            # ScreenCast version 4 added persist_mode and restore_token
CONSENT_TIMEOUT_S = 300.0          # Start: the desktop may show its dialog (no token yet, or one it no longer takes)
# The sink's formats, the compositor's own first (no conversion in the pipeline), and PIL's raw mode for each.
RAW_MODES = {"BGRx": "BGRX", "BGRA": "BGRX", "RGBx": "RGBX", "RGBA": "RGBX", "xRGB": "XRGB", "ARGB": "XRGB",
             "xBGR": "XBGR", "ABGR": "XBGR", "RGB": "RGB"}
# The first frame comes at once (0.27 s on headless GNOME), then frames come only on damage. How long to wait for it:
# xdg-desktop-portal-wlr (sway, Hyprland, river) streams only GPU buffers and sends nothing without a GPU, so there
# DeskEye soon takes the portal's screenshots instead. GNOME's and KDE's compositors stream from memory too: a late
# first frame there is a busy machine (over 5 s seen while the test suite loaded two cores), not a stream that never
# comes, and their Screenshot fallback is worse (GNOME flashes the screen white at every screenshot).
FIRST_FRAME_TIMEOUT_S = 5.0
FIRST_FRAME_PATIENT_S = 30.0
STREAMS_WITHOUT_GPU = ("GNOME", "KDE")      # in XDG_CURRENT_DESKTOP, e.g. "ubuntu:GNOME"
ERROR_POLL_S = 0.1

# What the user reads (translated where it is shown or raised).
CONSENT_ONCE = N_("{desktop} asks once whether DeskEye may see the screen: choose the monitor to share and allow it. "
                  "DeskEye keeps the desktop's answer in {path}, so it does not ask again.")
CONSENT_WINDOW_ONCE = N_("{desktop} asks once which window DeskEye may see (capture.source = \"window\"): choose it "
                         "and allow it. Only that window is seen. DeskEye keeps the desktop's answer in {path}, so it "
                         "does not ask again.")
NO_MONITOR_SOURCE = N_("the ScreenCast portal offers no monitor to stream")
NO_WINDOW_SOURCE = N_("the ScreenCast portal offers no window to stream (capture.source = \"window\"): set "
                      "capture.source = \"monitor\"")
NO_STREAM = N_("the ScreenCast portal started no stream")
NO_GSTREAMER = N_("DeskEye reads the ScreenCast portal's PipeWire stream with GStreamer, which is missing here "
                  "({cause}). Install gir1.2-gstreamer-1.0, gir1.2-gst-plugins-base-1.0, gstreamer1.0-plugins-base "
                  "and gstreamer1.0-pipewire (Debian and Ubuntu names).")
NO_FRAMES = N_("the ScreenCast stream sent no frame within {seconds:.0f} s")
STREAM_PLACE_UNKNOWN = N_("The ScreenCast portal streams a {width}x{height} monitor {where}, which is not one of the "
                          "monitors Xwayland reports ({monitors}): DeskEye cannot tell where its own windows (the "
                          "overlay, the Ask box) are in the frames, so what it describes may include them.")
NOT_LINKED = N_("PipeWire did not connect DeskEye to the desktop's screen cast ({cause}). PipeWire's session "
                "manager connects the two: check that it runs (systemctl --user status wireplumber), then restart "
                "DeskEye.")
STREAM_ENDED = N_("The screen cast ended ({cause}): the desktop stopped it, or it was stopped in the desktop's "
                  "sharing indicator. DeskEye does not ask again by itself: restart DeskEye to let it see the "
                  "screen.")


def desktop_name(environ: Mapping[str, str] = os.environ) -> str:
    """The desktop's name for messages, e.g. "GNOME" (first of XDG_CURRENT_DESKTOP; "the desktop" if unset)."""
    first = environ.get("XDG_CURRENT_DESKTOP", "").split(":")[0].strip()
    return first[:32] if first.isprintable() and first else "the desktop"


def first_frame_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """How long a new stream may take to send its first frame on this desktop (see FIRST_FRAME_PATIENT_S)."""
    desktops = {name.strip().upper() for name in environ.get("XDG_CURRENT_DESKTOP", "").split(":")}
    return FIRST_FRAME_PATIENT_S if desktops & set(STREAMS_WITHOUT_GPU) else FIRST_FRAME_TIMEOUT_S


def import_gst():
    """Gst, initialised, with the pipewiresrc element; CaptureError naming the packages where it is missing."""
    import_gio()
    try:
        import gi
        gi.require_version("Gst", "1.0")
        from gi.repository import Gst
    except (ImportError, ValueError) as exc:
        raise CaptureError(_(NO_GSTREAMER).format(cause=exc)) from None
    Gst.init(None)
    missing = [name for name in ("pipewiresrc", "videoconvert", "appsink") if Gst.ElementFactory.find(name) is None]
    if missing:
        raise CaptureError(_(NO_GSTREAMER).format(cause="no GStreamer element " + ", ".join(missing)))
    return Gst


class ScreenCastStream:
    """One portal ScreenCast session and the GStreamer pipeline that keeps its latest frame."""

    def __init__(self, environ: Mapping[str, str] = os.environ, source: str = "monitor"):
        self.desktop = desktop_name(environ)
        self.source = source               # capture.source: "monitor" or "window"
        self._cond = threading.Condition()
        self._sample = None
        self.num_frames = 0                # frames the compositor sent so far (benchmarks/portal_capture.py)
        self.frame_at = 0.0                # when the latest one came (time.monotonic())
        self._copy_lock = threading.Lock()
        self._copied: tuple = (None, None)     # (sample, its frame as an RGB image): what the last grab copied
        self._ended = ""                   # why the stream ended ("" while it runs)
        self.position: tuple[int, int] | None = None        # where the portal says the monitor lies (layout pixels)
        self.logical_size: tuple[int, int] | None = None    # and its size there
        self._pipeline = None
        self._fd = -1
        self._session_handle = ""
        Gst = self._gst = import_gst()
        self._bus = PortalBus(environ)
        try:
            node = self._start_session()
            self._fd = self._bus.call_with_fd(SCREENCAST, "OpenPipeWireRemote", "(oa{sv})",
                                              (self._session_handle, {}))
            self._pipeline = self._make_pipeline(Gst, node)
            self._wait_first_frame(first_frame_timeout_s(environ))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the portal session

    def _start_session(self) -> int:
        """CreateSession, SelectSources (a monitor or a window, the saved token), Start -> the PipeWire node; saves
        the token."""
        bus, variant = self._bus, self._bus.variant
        try:
            version = int(bus.property(SCREENCAST, "version"))
            sources = int(bus.property(SCREENCAST, "AvailableSourceTypes"))
            cursors = int(bus.property(SCREENCAST, "AvailableCursorModes"))
        except Exception as exc:   # GLib.Error: no portal on the bus, or none with ScreenCast
            raise CaptureError(_(NO_PORTAL).format(cause=error_text(exc))) from None
        if not sources & SOURCE_TYPES[self.source]:
            missing = NO_WINDOW_SOURCE if self.source == "window" else NO_MONITOR_SOURCE
            raise CaptureError(_(missing))
        results = bus.request(SCREENCAST, "CreateSession", "(a{sv})",
                              ({"session_handle_token": variant("s", bus.token())},))
        self._session_handle = str(results.get("session_handle", ""))
        bus.on_session_closed(self._session_handle, self._on_closed)
        options = {"types": variant("u", SOURCE_TYPES[self.source]), "multiple": variant("b", False)}
        if cursors & CURSOR_HIDDEN:
            options["cursor_mode"] = variant("u", CURSOR_HIDDEN)
        token = ""
        if version >= PERSIST_MIN_VERSION:
            options["persist_mode"] = variant("u", PERSIST_UNTIL_REVOKED)
            token = load_token(token_path(self.source))
            if token:
                options["restore_token"] = variant("s", token)
        if not token:
            consent = CONSENT_WINDOW_ONCE if self.source == "window" else CONSENT_ONCE
            log.warning("%s", _(consent).format(desktop=self.desktop, path=token_path(self.source)))
        bus.request(SCREENCAST, "SelectSources", "(oa{sv})", (self._session_handle, options))
        results = bus.request(SCREENCAST, "Start", "(osa{sv})", (self._session_handle, "", {}),
                              timeout_s=CONSENT_TIMEOUT_S)
        if isinstance(results.get("restore_token"), str):
            save_token(results["restore_token"], token_path(self.source))
        streams = results.get("streams") or []
        if not streams or not isinstance(streams[0][0], int):
            raise CaptureError(_(NO_STREAM))
        node, properties = streams[0]
        self.position, self.logical_size = _pair(properties.get("position")), _pair(properties.get("size"))
        log.info("ScreenCast stream of a %s: PipeWire node %d, at %s, logical size %s", self.source, node,
                 properties.get("position"), properties.get("size"))
        return node

    # ------------------------------------------------------------------ the pipeline

    def _make_pipeline(self, Gst, node: int):
        pipeline = Gst.Pipeline.new("deskeye-screencast")
        source = Gst.ElementFactory.make("pipewiresrc", None)
        source.set_property("fd", self._fd)
        source.set_property("path", str(node))
        convert = Gst.ElementFactory.make("videoconvert", None)
        sink = Gst.ElementFactory.make("appsink", None)
        sink.set_property("caps", Gst.Caps.from_string(f"video/x-raw,format={{ {', '.join(RAW_MODES)} }}"))
        for name, value in (("max-buffers", 1), ("drop", True), ("sync", False), ("emit-signals", True)):
            sink.set_property(name, value)
        sink.connect("new-sample", self._on_sample)
        for element in (source, convert, sink):
            pipeline.add(element)
        source.link(convert)
        convert.link(sink)
        if pipeline.set_state(Gst.State.PLAYING) == Gst.StateChangeReturn.FAILURE:
            message = pipeline.get_bus().pop_filtered(Gst.MessageType.ERROR)      # why, where GStreamer says
            why = f": {error_text(message.parse_error()[0])}" if message is not None else ""
            pipeline.set_state(Gst.State.NULL)
            raise CaptureError(_(NOT_LINKED).format(cause="the GStreamer pipeline did not start" + why))
        return pipeline

    def _on_closed(self) -> None:
        """The portal ended the session: the last frame is no longer the screen."""
        with self._cond:
            self._ended = self._ended or "the portal closed the session"
            self._cond.notify_all()

    def _on_sample(self, sink):
        """GStreamer's streaming thread, once per frame the compositor sends (on damage): keep the newest."""
        sample = sink.emit("pull-sample")
        with self._cond:
            self._sample = sample
            self.num_frames += 1
            self.frame_at = time.monotonic()
            self._cond.notify_all()
        return self._gst.FlowReturn.OK

    def _wait_first_frame(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._sample is None:
                self._check_pipeline()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CaptureError(_(NO_FRAMES).format(seconds=timeout_s))
                self._cond.wait(min(left, ERROR_POLL_S))

    def _check_pipeline(self) -> None:
        """CaptureError once the portal closed the session, or the pipeline posted an error or the end of the stream
        (all read without waiting): the latest frame is then no longer what the screen shows."""
        if not self._ended and self._bus is not None:
            self._bus.pump()
        if not self._ended and self._pipeline is not None:
            Gst = self._gst
            message = self._pipeline.get_bus().pop_filtered(Gst.MessageType.ERROR | Gst.MessageType.EOS)
            if message is not None:
                if message.type == Gst.MessageType.ERROR:
                    self._ended = error_text(message.parse_error()[0])
                else:
                    self._ended = "end of stream"
        if self._ended:
            raise CaptureError(_(STREAM_ENDED).format(cause=self._ended))

    # ------------------------------------------------------------------ frames

    def frame(self) -> "Image.Image":
        """The latest frame as an RGB image, copied out of GStreamer's buffer once per frame the compositor sent (the
        stream goes on meanwhile). The same image while no new frame came: callers crop it, never draw on it."""
        with self._cond:
            self._check_pipeline()
            sample = self._sample
        with self._copy_lock:
            if self._copied[0] is not sample:
                self._copied = (sample, self._copy(sample))
            return self._copied[1]

    def _copy(self, sample) -> "Image.Image":
        from PIL import Image

        caps = sample.get_caps().get_structure(0)
        width, height = caps.get_value("width"), caps.get_value("height")
        raw_mode = RAW_MODES.get(caps.get_value("format"), "")
        buffer = sample.get_buffer()
        data = buffer.extract_dup(0, buffer.get_size())
        stride = len(data) // height if height else 0          # rows may be padded (RGB rows to 4 bytes)
        if not raw_mode or width <= 0 or stride < width * len(raw_mode):
            raise CaptureError(_(STREAM_ENDED).format(
                cause=f"a frame of {width}x{height} {caps.get_value('format')} in {len(data)} bytes"))
        return Image.frombuffer("RGB", (width, height), data, "raw", raw_mode, stride, 1)

    def size(self) -> tuple[int, int]:
        with self._cond:
            self._check_pipeline()
            caps = self._sample.get_caps().get_structure(0)
        return caps.get_value("width"), caps.get_value("height")

    def close(self) -> None:
        """Stop the pipeline, close the PipeWire socket, end the portal session and the bus connection."""
        if self._pipeline is not None:
            self._pipeline.set_state(self._gst.State.NULL)
            self._pipeline = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._session_handle:
            self._bus.close_session(self._session_handle)
            self._session_handle = ""
        if getattr(self, "_bus", None) is not None:
            self._bus.close()
            self._bus = None
        with self._cond:
            self._sample = None
        with self._copy_lock:
            self._copied = (None, None)


def _pair(value) -> tuple[int, int] | None:
    """An (x, y) or (width, height) from the portal's answer, None where it is missing or not two integers."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def stream_map(stream_size: tuple[int, int], position: tuple[int, int] | None, logical_size: tuple[int, int] | None,
               monitors: list[Rect]) -> tuple[Rect, FrameMap, str]:
    """The streamed monitor in the desktop's pixels, where its pixels lie in the stream, and "" or why that is not
    known (for a warning): from the portal's `position` and logical `size`, when it gave them and they are one of
    Xwayland's `monitors` (mss numbering; [] where there is no X display: nothing to check against)."""
    width, height = stream_size
    if position is not None and logical_size is not None and min(logical_size) > 0:
        desktop = Rect(*position, *logical_size)
        where = f"at {position[0]},{position[1]} (logical size {logical_size[0]}x{logical_size[1]})"
    else:
        desktop = Rect(0, 0, width, height)
        where = "and does not say where it lies"
    frame_map = FrameMap(desktop.left, desktop.top, width / desktop.width, height / desktop.height)
    if not monitors[1:] or desktop in monitors[1:]:
        return desktop, frame_map, ""
    listed = ", ".join(f"{m.width}x{m.height}+{m.left}+{m.top}" for m in monitors[1:])
    return desktop, frame_map, _(STREAM_PLACE_UNKNOWN).format(width=width, height=height, where=where,
                                                              monitors=listed)


_shared_lock = threading.Lock()
_shared: list = [None, 0]          # [the process's ScreenCastStream, how many backends use it] (one source a process)
_said: set[str] = set()            # the warnings `PortalScreenCastBackend._map` gave (each once per process)


def _acquire(environ: Mapping[str, str], source: str) -> ScreenCastStream:
    with _shared_lock:         # a second thread waits for the first one's stream (bounded by its Start)
        if _shared[0] is None:
            _shared[0] = ScreenCastStream(environ, source)
        _shared[1] += 1
        return _shared[0]


def _release(stream: ScreenCastStream) -> None:
    with _shared_lock:
        if _shared[0] is not stream:
            stream.close()
            return
        _shared[1] -= 1
        if _shared[1] <= 0:
            _shared[0], _shared[1] = None, 0
            stream.close()


class PortalScreenCastBackend:
    """The capture backend of a Wayland session whose portal streams a monitor, or one window (GNOME, KDE Plasma)."""

    def __init__(self, session: "Session", environ: Mapping[str, str] = os.environ, source: str = "monitor"):
        self.session = session
        self._stream = _acquire(environ, source)
        self.watches_window = source == "window"       # the frames are one window's: no other window is in them
        self._mapped: tuple | None = None      # (stream size, the monitor in desktop pixels, its FrameMap)
        what = f"one window, {self._stream.desktop}" if self.watches_window else self._stream.desktop
        self.name = f"xdg-desktop-portal ScreenCast ({what})"

    def monitors(self) -> list[Rect]:
        """The streamed monitor, in the desktop's pixels, as [all, primary]: both name it. A shared window: the
        window itself, in its own pixels (at 0,0)."""
        desktop = self._map()[0]
        return [desktop, desktop]

    def _map(self) -> tuple[Rect, FrameMap]:
        """The streamed monitor and where its pixels lie in the stream (`stream_map`); why that is not known is
        said once, as a warning. A shared window is its own screen: its pixels are the frame's."""
        size = self._stream.size()
        if self.watches_window:
            return Rect(0, 0, *size), FrameMap(0, 0, 1.0, 1.0)
        if self._mapped is None or self._mapped[0] != size:
            desktop, frame_map, unknown = stream_map(size, self._stream.position, self._stream.logical_size,
                                                     desktop_monitors())
            if unknown and unknown not in _said:
                _said.add(unknown)
                log.warning("%s", unknown)
            self._mapped = (size, desktop, frame_map)
        return self._mapped[1], self._mapped[2]

    def grab(self, rect: Rect) -> "Image.Image":
        """`rect` (desktop pixels) cut out of the latest frame, in the stream's own pixels."""
        frame_map = self._map()[1]
        image = self._stream.frame()
        left, top, right, bottom = frame_map.box(rect)
        box = (max(left, 0), max(top, 0), min(right, image.width), min(bottom, image.height))
        if box[2] <= box[0] or box[3] <= box[1]:
            raise CaptureError(f"The region {rect} lies outside the streamed monitor ({image.width}x{image.height}).")
        return image.crop(box)

    def frames_received(self) -> tuple[int, float]:
        """Frames the compositor sent on this stream so far (none while the screen is static), and when the latest
        one came (time.monotonic()): for benchmarks/portal_capture.py."""
        return self._stream.num_frames, self._stream.frame_at

    def why_black(self, rect: Rect) -> str:
        """The portal hands the compositor's own pixels: a black frame is what the screen shows."""
        return ""

    def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            _release(stream)

