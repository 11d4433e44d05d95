"""DeskEye's own windows stay above its overlay, and opening them describes nothing.

`deskeye run` in a real process on a test desktop (openbox, xcompmgr, dunst, trayer), driven with xdotool as a user
drives it, under LANG=en_US.UTF-8 and LANG=zh_CN.UTF-8. A describe puts the overlay up (kept there: fade_after_s = 0,
top-right, under the tray) over a focused editor whose title bar lies in the watched region. Then:
- the overlay's right-click menu, the tray icon's menu and the Ask box each stay above the overlay: 3 s after they
  opened, the X server stacks their top-level window above the overlay's, and the screen shows their own pixels
  (the window's own image, which the compositor keeps, equals what a grab of the screen shows there);
- opening the Ask box moves the focus (the editor's title bar turns inactive) and closing it moves the focus back:
  the worker gets no request meanwhile (its /metrics counter), so neither started an automatic describe.
The two rules behind it are also checked on their own at the end: the change detector's hold, and where the overlay
goes for a given stacking order.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from PIL import Image, ImageChops

from tests.fixtures.deskeye_process import start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.polling import wait_until
from tests.fixtures.tk_windows import open_test_window

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

LOCALES = ["en_US.UTF-8", "zh_CN.UTF-8"]
SETTINGS = ('[worker]\nengine = "ocr"\n[capture]\ninterval_s = 1.0\n'
            '[overlay]\nfade_after_s = 0.0\nposition = "top-right"\n[hooks]\ndry_run = true\n')
REGION = "100,100,800,600"
EDITOR_GEOMETRY = "760x480+130+140"        # its frame's title bar lies inside REGION
LINES = ["Quarterly report draft", "Revenue grew by twelve percent", "Costs are under review"]
OPEN_FOR_S = 3.0
QUIET_S = 4.0                  # capture ticks (1 s) and the settle time after an own window closed (2 s), and more
ANSWER_S = 2.0                 # a describe started at the end of QUIET_S is counted once the worker has answered it
MIN_VISIBLE = 0.99             # of a window's pixels shown on the screen as the window drew them (a text cursor blinks)


@pytest.fixture(scope="module", params=LOCALES)
def running(request):
    """A test desktop in the locale, a focused editor in the watched region, and `deskeye run` with its overlay up."""
    patch = pytest.MonkeyPatch()
    patch.setenv("LANG", request.param)
    patch.setenv("LC_ALL", request.param)
    desktop = start_desktop(1600, 900, tray="trayer")
    editor = app = None
    try:
        editor = open_test_window(desktop.display, "Report - editor", EDITOR_GEOMETRY, lines=LINES)
        editor.focus()
        assert wait_until(lambda: focused_name(desktop) == "Report - editor", 10)
        app = start_deskeye(desktop, "--region", REGION, settings=SETTINGS)
        assert app.read_until("deskeye: watching", 90), "".join(app.output)
        assert wait_until(app.overlay_rect, 120), "no describe put the overlay up: " + "".join(app.output)
        settle(app)
        yield desktop, app
    finally:
        if app is not None:
            app.stop()
        if editor is not None:
            editor.close()
        desktop.stop()
        patch.undo()


def settle(app, quiet_s: float = QUIET_S, timeout_s: float = 120) -> int:
    """Wait until the worker has had no new request for `quiet_s` (the first describes are done)."""
    count, since, deadline = app.chat_requests(), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.5)
        now = app.chat_requests()
        if now != count:
            count, since = now, time.monotonic()
    return count


class Screen:
    """What the test desktop's X server says: the stacking order of top-level windows and their pixels."""

    def __init__(self, desktop):
        from Xlib import display
        self.conn = display.Display(desktop.display.name)
        self.root = self.conn.screen().root

    def close(self) -> None:
        self.conn.close()

    def top_level(self, window_id: int) -> int:
        """The root's child that holds `window_id` (Tk's wrapper, or the window manager's frame)."""
        window = self.conn.create_resource_object("window", window_id)
        while (parent := window.query_tree().parent).id != self.root.id:
            window = parent
        return window.id

    def named(self, prefix: str) -> tuple[int, int, int, int] | None:
        """Where (x, y, width, height) a viewable window whose _NET_WM_NAME starts with `prefix` is on the screen (read
        here: xdotool cannot convert a UTF-8 name without the locale's data, which this machine may lack)."""
        from Xlib import X
        name_atom, utf8 = self.conn.get_atom("_NET_WM_NAME"), self.conn.get_atom("UTF8_STRING")
        windows = list(self.root.query_tree().children)
        while windows:
            window = windows.pop()
            if window.get_attributes().map_state != X.IsViewable:
                continue
            windows.extend(window.query_tree().children)
            name = window.get_full_property(name_atom, utf8)
            if name is not None and bytes(name.value).decode("utf-8", "replace").startswith(prefix):
                geometry = window.get_geometry()
                origin = window.translate_coords(self.root, 0, 0)
                return -origin.x, -origin.y, geometry.width, geometry.height
        return None

    def stacking(self) -> list[int]:
        """The root's children, bottom to top."""
        return [child.id for child in self.root.query_tree().children]

    def visible_fraction(self, top_id: int) -> float:
        """How much of top-level window `top_id` the screen shows as the window itself drew it (the compositor keeps
        each window's own image, so a window over it changes the screen's pixels, not the window's)."""
        from Xlib import X
        window = self.conn.create_resource_object("window", top_id)
        geometry = window.get_geometry()
        width, height = geometry.width, geometry.height
        own = window.get_image(0, 0, width, height, X.ZPixmap, 0xFFFFFFFF)
        shown = self.root.get_image(geometry.x + geometry.border_width, geometry.y + geometry.border_width,
                                    width, height, X.ZPixmap, 0xFFFFFFFF)
        mine = Image.frombytes("RGB", (width, height), own.data, "raw", "BGRX")
        screen = Image.frombytes("RGB", (width, height), shown.data, "raw", "BGRX")
        differing = ImageChops.difference(mine, screen).convert("L").point(lambda v: 255 if v > 8 else 0)
        return 1 - differing.histogram()[255] / (width * height)


def xdotool(desktop, *args: str) -> str:
    """xdotool in a locale this machine has: it reads window names (UTF-8) through the C library's locale."""
    done = subprocess.run(["xdotool", *args], capture_output=True, text=True, timeout=10,
                          env=desktop.env(LC_ALL="C.UTF-8"))
    return done.stdout.strip()


def found(desktop, *search: str) -> int | None:
    ids = xdotool(desktop, "search", "--onlyvisible", *search).split()
    return int(ids[0]) if ids else None


def focused_name(desktop) -> str:
    return xdotool(desktop, "getwindowfocus", "getwindowname")


def focused_deskeye_window(desktop) -> int | None:
    """The focused window if it is one of DeskEye's Tk windows (class DeskEye: the Ask box; the overlay never takes
    the focus), found by class because its title is in the user's language."""
    focus = xdotool(desktop, "getwindowfocus")
    if not focus:
        return None
    classes = xdotool(desktop, "search", "--onlyvisible", "--class", "^DeskEye$").split()
    return int(focus) if focus in classes else None


def assert_stays_above_the_overlay(desktop, window_id: int, what: str) -> None:
    screen = Screen(desktop)
    try:
        overlay = screen.top_level(found(desktop, "--name", "^DeskEye overlay$"))
        window = screen.top_level(window_id)
        time.sleep(OPEN_FOR_S)
        order = screen.stacking()
        is_above, visible = order.index(window) > order.index(overlay), screen.visible_fraction(window)
        assert is_above and visible >= MIN_VISIBLE, (f"after {OPEN_FOR_S} s {what} is stacked "
                                                     f"{'above' if is_above else 'below'} the overlay and "
                                                     f"{visible:.1%} of it shows on the screen")
    finally:
        screen.close()


def tray_menu(desktop, pid: int) -> int | None:
    """The app's visible popup menu (GTK's, from the tray icon)."""
    for window_id in xdotool(desktop, "search", "--onlyvisible", "--pid", str(pid), "--name", "").split():
        kind = subprocess.run(["xprop", "-id", window_id, "_NET_WM_WINDOW_TYPE"], capture_output=True, text=True,
                              env=desktop.env()).stdout
        if "POPUP_MENU" in kind or "DROPDOWN_MENU" in kind:
            return int(window_id)
    return None


@pytest.mark.slow
def test_the_overlays_right_click_menu_stays_above_it(running):
    desktop, app = running
    x, y, width, height = app.overlay_rect()
    xdotool(desktop, "mousemove", str(x + width // 2), str(y + height // 2), "click", "3")
    menu = wait_until(lambda: found(desktop, "--class", "^Menu$"), 10)
    assert menu, "right-clicking the overlay opened no menu"
    try:
        assert_stays_above_the_overlay(desktop, menu, "its right-click menu")
    finally:
        xdotool(desktop, "mousemove", "20", "880", "click", "1")      # a click elsewhere closes a popup menu
        assert wait_until(lambda: not found(desktop, "--class", "^Menu$"), 10), "a click elsewhere left the menu open"


@pytest.mark.slow
def test_the_tray_menu_stays_above_the_overlay(running):
    desktop, app = running
    screen = Screen(desktop)
    try:
        icon = wait_until(lambda: screen.named("DeskEye ("), 20)      # its tooltip title: "DeskEye (idle)"
    finally:
        screen.close()
    assert icon, "the DeskEye icon never appeared in the tray"
    x, y, width, height = icon
    xdotool(desktop, "mousemove", str(x + width // 2), str(y + height // 2), "click", "1")
    menu = wait_until(lambda: tray_menu(desktop, app.proc.pid), 10)
    assert menu, "clicking the tray icon opened no menu"
    try:
        assert_stays_above_the_overlay(desktop, menu, "the tray icon's menu")
    finally:
        xdotool(desktop, "key", "Escape")
        assert wait_until(lambda: not tray_menu(desktop, app.proc.pid), 10), "Escape left the tray menu open"


def open_ask_box(desktop) -> int:
    xdotool(desktop, "key", "ctrl+alt+a")
    ask_box = wait_until(lambda: focused_deskeye_window(desktop), 10)
    assert ask_box, "the Ask hotkey did not open and focus the Ask box"
    xdotool(desktop, "type", "--delay", "20", "what is on screen")
    return ask_box


def close_ask_box(desktop) -> None:
    xdotool(desktop, "key", "Escape")
    assert wait_until(lambda: focused_name(desktop) == "Report - editor", 10), "the focus did not go back to the editor"


@pytest.mark.slow
def test_the_ask_box_stays_above_the_overlay(running):
    desktop, app = running
    ask_box = open_ask_box(desktop)
    try:
        assert_stays_above_the_overlay(desktop, ask_box, "the Ask box")
    finally:
        close_ask_box(desktop)


@pytest.mark.slow
def test_opening_and_closing_the_ask_box_describes_nothing(running):
    desktop, app = running
    before = settle(app)
    open_ask_box(desktop)                   # the focus leaves the editor: its title bar in the region turns inactive
    try:
        time.sleep(QUIET_S)
        assert app.chat_requests() == before, "opening the Ask box started a describe"
    finally:
        close_ask_box(desktop)              # and back: active again
    time.sleep(QUIET_S + ANSWER_S)
    assert app.chat_requests() == before, "closing the Ask box started a describe"


# ---------------------------------------------------------------- the two rules, on their own

@pytest.mark.slow
def test_the_change_detector_holds_while_an_own_window_is_open_and_a_moment_after():
    from deskeye.see.change import ChangeDetector
    now = [0.0]
    detector = ChangeDetector(12, own_window_settle_s=2.0, clock=lambda: now[0])
    white, black = Image.new("RGB", (640, 480), "white"), Image.new("RGB", (640, 480), "black")
    detector.mark_described(white)
    assert detector.should_describe(black) and not detector.is_held
    detector.own_window_opened()                    # the Ask box
    detector.own_window_opened()                    # and a menu over it
    detector.own_window_closed()
    now[0] = 60.0
    assert detector.is_held and not detector.should_describe(black)    # one is still open, however long
    detector.own_window_closed()
    now[0] = 61.9
    assert detector.is_held and not detector.should_describe(black)    # settling
    now[0] = 62.1
    assert not detector.is_held and detector.should_describe(black)
    detector.own_window_closed()                    # a close too many does not hold for ever
    now[0] = 64.2
    assert not detector.is_held


@pytest.mark.slow
def test_the_overlay_goes_under_deskeyes_own_windows_and_over_the_others():
    from deskeye.see.geometry import Rect
    from deskeye.see.x11_windows import XWindow
    from deskeye.ui.stacking import Move, StackMove, overlay_move

    def window(window_id: int, rect: Rect, is_own: bool = False) -> XWindow:
        return XWindow(window_id, rect, f"w{window_id}", is_own)
    overlay = window(1, Rect(1100, 700, 420, 100), is_own=True)
    editor, newcomer = window(2, Rect(0, 0, 1200, 800)), window(3, Rect(1000, 650, 300, 300))
    elsewhere, menu = window(4, Rect(0, 0, 200, 200)), window(5, Rect(1200, 720, 150, 120), is_own=True)
    assert overlay_move([editor, overlay], 1) == StackMove(Move.STAY)
    assert overlay_move([overlay, elsewhere], 1) == StackMove(Move.STAY)          # above it, but not over it
    assert overlay_move([editor, overlay, newcomer], 1) == StackMove(Move.RAISE)
    assert overlay_move([editor, overlay, menu], 1) == StackMove(Move.STAY)       # the menu stays on top
    assert overlay_move([editor, overlay, menu, newcomer], 1) == StackMove(Move.STAY)   # not over an open menu
    assert overlay_move([editor, menu, overlay], 1) == StackMove(Move.BELOW, 5)
    assert overlay_move([editor, newcomer], 1) == StackMove(Move.STAY)            # not mapped
