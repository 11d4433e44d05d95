"""`deskeye run` on a whole desktop (openbox, xcompmgr, dunst, an XEmbed tray host) as a user drives it:
xdotool clicks the tray icon, picks menu entries, types into the Ask box; what the overlay shows is read back
from the screen with OCR; requests are counted at the worker (/metrics). No StatusNotifierItem host runs
host runs headless as xfce4-panel (its systray plugin owns org.kde.StatusNotifierWatcher): there DeskEye is an
Ayatana AppIndicator, found on the panel by its colour and clicked like the XEmbed icon.
"""

from __future__ import annotations

import re
import subprocess
import time
from datetime import datetime

import psutil
import pytest

from deskeye.see.geometry import Rect
from deskeye.see.x11_windows import OwnWindows
from tests.fixtures.deskeye_process import start_deskeye
from tests.fixtures.desktop import start_desktop
from tests.fixtures.polling import wait_until
from tests.fixtures.tk_windows import open_test_window

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

SETTINGS = '[worker]\nengine = "ocr"\n[overlay]\nfade_after_s = 0.0\n[hooks]\ndry_run = true\n'
LINES = ["Quarterly report draft", "Revenue grew by twelve percent", "Costs are under review"]


@pytest.fixture(scope="module")
def desktop():
    session = start_desktop(1600, 900, tray="trayer")
    yield session
    session.stop()


def tray_icon(desktop) -> str:
    ids = wait_until(lambda: desktop.xdotool("search", "--onlyvisible", "--name", r"^DeskEye \("), 20)
    assert ids, "the DeskEye icon never appeared in the tray"
    return ids.split()[0]


def geometry(desktop, window_id: str) -> tuple[int, int, int, int]:
    values = dict(line.split("=", 1) for line in desktop.xdotool("getwindowgeometry", "--shell", window_id).splitlines())
    return int(values["X"]), int(values["Y"]), int(values["WIDTH"]), int(values["HEIGHT"])


def menu_windows(desktop, pid: int) -> list[str]:
    """Visible windows of the app that are popup menus."""
    found = []
    for window_id in desktop.xdotool("search", "--onlyvisible", "--pid", str(pid), "--name", "").split():
        out = subprocess.run(["xprop", "-id", window_id, "_NET_WM_WINDOW_TYPE"], capture_output=True, text=True,
                             env=desktop.env()).stdout
        if "POPUP_MENU" in out or "DROPDOWN_MENU" in out:
            found.append(window_id)
    return found


def click_icon_and_open_menu(desktop, pid: int, button: str = "1") -> str:
    x, y, width, height = geometry(desktop, tray_icon(desktop))
    assert width >= 16 and height >= 16, f"the tray icon is {width}x{height} px"
    desktop.xdotool("mousemove", str(x + width // 2), str(y + height // 2), "click", button)
    menus = wait_until(lambda: menu_windows(desktop, pid), 10)
    assert menus, "clicking the tray icon opened no menu"
    return menus[0]


@pytest.mark.slow
def test_tray_menu_ask_box_quick_answer_and_quit(desktop):
    window = open_test_window(desktop.display, "Report - editor", "800x600+174+150", lines=LINES)
    app = start_deskeye(desktop, settings=SETTINGS)
    try:
        assert app.read_until("deskeye: watching", 60), "".join(app.output)
        assert wait_until(lambda: app.chat_requests() >= 1, 120)       # the first screen was described
        time.sleep(2)                                                  # the first describe has settled
        before = app.chat_requests()

        menu = click_icon_and_open_menu(desktop, app.proc.pid)
        own = OwnWindows(pid=app.proc.pid, display_name=desktop.display.name)
        try:                                                           # the tray's menu counts as DeskEye's own
            menu_rect = Rect(*geometry(desktop, menu))
            assert any(w.is_own and w.rect == menu_rect for w in own.windows()), own.windows()
        finally:
            own.close_thread()
        desktop.xdotool("key", "Down", "Down", "Return")             # the second entry: "Ask…"
        assert wait_until(lambda: desktop.xdotool("search", "--onlyvisible", "--name", "Ask DeskEye"), 10)
        assert wait_until(lambda: desktop.xdotool("getwindowfocus", "getwindowname") == "Ask DeskEye", 10)
        desktop.xdotool("type", "--delay", "20", "what time is it")
        desktop.xdotool("key", "Return")
        text = wait_until(lambda: (t := app.overlay_text()) and re.search(r"\d{1,2}:\d{2}", t) and t, 30)
        assert text, f"the overlay never showed a time: {app.overlay_text()!r}"
        shown = re.search(r"(\d{1,2}):(\d{2})", text)
        shown_minutes = int(shown.group(1)) * 60 + int(shown.group(2))
        now = datetime.now()
        assert abs(shown_minutes - (now.hour * 60 + now.minute)) <= 1, text
        assert app.chat_requests() == before                           # answered without the worker

        worker = app.worker()
        click_icon_and_open_menu(desktop, app.proc.pid, button="3")
        for _ in range(5):
            desktop.xdotool("key", "Down")                             # the fifth entry: "Quit"
        desktop.xdotool("key", "Return")
        assert app.proc.wait(30) == 0
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert not desktop.xdotool("search", "--name", r"^DeskEye \(")
    finally:
        app.stop()
        window.close()


@pytest.mark.slow
def test_the_icon_docks_again_when_the_tray_host_restarts_and_in_tint2(desktop):
    app = start_deskeye(desktop, settings=SETTINGS)
    try:
        assert app.read_until("deskeye: watching", 60), "".join(app.output)
        tray_icon(desktop)
        desktop.stop_one("tray")
        assert wait_until(lambda: not desktop.has_tray(), 10)
        desktop.start_tray("tint2")                                   # another host: docks there
        x, y, width, height = geometry(desktop, tray_icon(desktop))
        assert y > 800 and width >= 16                                # tint2's panel is at the bottom
        click_icon_and_open_menu(desktop, app.proc.pid)
        desktop.xdotool("key", "Escape")
        desktop.stop_one("tray")
        desktop.start_tray("trayer")                                  # and back
        x, y, width, height = geometry(desktop, tray_icon(desktop))
        assert y < 40 and width >= 16
    finally:
        app.stop()


@pytest.mark.slow
def test_ask_hotkey_opens_the_ask_box_right_click_opens_the_menu_and_notifications_miss_the_overlay(desktop):
    window = open_test_window(desktop.display, "Report - editor", "800x600+174+150", lines=LINES)
    app = start_deskeye(desktop, settings=SETTINGS)
    try:
        assert app.read_until("deskeye: watching", 60), "".join(app.output)
        assert wait_until(app.overlay_rect, 120)                       # the first description is shown
        desktop.xdotool("key", "ctrl+alt+a")
        assert wait_until(lambda: desktop.xdotool("getwindowfocus", "getwindowname") == "Ask DeskEye", 10)
        ask_box = geometry(desktop, desktop.xdotool("search", "--onlyvisible", "--name", "Ask DeskEye").split()[0])
        overlay = app.overlay_rect()
        assert abs(ask_box[0] - overlay[0]) < 60 and ask_box[1] < overlay[1]   # just above the overlay
        desktop.xdotool("key", "Escape")
        assert wait_until(lambda: not desktop.xdotool("search", "--onlyvisible", "--name", "Ask DeskEye"), 10)

        x, y, width, height = overlay
        desktop.xdotool("mousemove", str(x + width // 2), str(y + height // 2), "click", "3")
        menu = wait_until(lambda: desktop.xdotool("search", "--onlyvisible", "--class", "^Menu$"), 10)
        assert menu, "right-clicking the overlay opened no menu"
        desktop.xdotool("key", "Escape")

        subprocess.run(["notify-send", "Build finished", "All 412 tests passed"], env=desktop.env(), check=True,
                       timeout=10)
        bubble = wait_until(lambda: desktop.xdotool("search", "--onlyvisible", "--class", "Dunst"), 10)
        assert bubble, "dunst showed no notification"
        bx, by, bw, bh = geometry(desktop, bubble.split()[0])
        ox, oy, ow, oh = app.overlay_rect()
        assert bx + bw <= ox or ox + ow <= bx or by + bh <= oy or oy + oh <= by, ((bx, by, bw, bh), (ox, oy, ow, oh))
    finally:
        app.stop()
        window.close()


def find_colour(desktop, colour: tuple[int, int, int], area: tuple[int, int, int, int]):
    """The centre of the pixels of `colour` in `area` (x, y, w, h) of the screen, or None."""
    import mss
    from PIL import Image
    with mss.MSS(display=desktop.display.name) as sct:
        shot = sct.grab({"left": area[0], "top": area[1], "width": area[2], "height": area[3]})
    image = Image.frombytes("RGB", shot.size, shot.bgra, "raw", "BGRX")
    points = [(x, y) for x in range(image.width) for y in range(image.height) if image.getpixel((x, y)) == colour]
    if len(points) < 20:
        return None
    return (area[0] + sum(p[0] for p in points) // len(points), area[1] + sum(p[1] for p in points) // len(points))


@pytest.mark.slow
def test_with_a_status_notifier_host_the_icon_is_an_appindicator_with_the_same_menu():
    from deskeye.ui.tray import IDLE, STATE_COLOURS
    session = start_desktop(1600, 900, tray="xfce4-panel")
    app = start_deskeye(session, settings=SETTINGS)
    try:
        assert app.read_until("deskeye: watching", 60), "".join(app.output)
        idle = tuple(int(STATE_COLOURS[IDLE][i:i + 2], 16) for i in (1, 3, 5))
        spot = wait_until(lambda: find_colour(session, idle, (0, 0, 1600, 40)), 30)
        assert spot, "the DeskEye indicator is not on xfce4-panel"
        items = subprocess.run(["dbus-send", "--session", "--print-reply", "--dest=org.kde.StatusNotifierWatcher",
                                "/StatusNotifierWatcher", "org.freedesktop.DBus.Properties.Get",
                                "string:org.kde.StatusNotifierWatcher", "string:RegisteredStatusNotifierItems"],
                               capture_output=True, text=True, env=session.env(), timeout=10).stdout
        assert "NotificationItem/deskeye" in items                    # an SNI item, not an XEmbed icon
        session.xdotool("mousemove", str(spot[0]), str(spot[1]), "click", "1")
        menus = wait_until(lambda: [w for w in session.xdotool("search", "--onlyvisible", "--name", "").split()
                                    if "MENU" in subprocess.run(["xprop", "-id", w, "_NET_WM_WINDOW_TYPE"],
                                                                capture_output=True, text=True,
                                                                env=session.env()).stdout], 10)
        assert menus, "clicking the indicator opened no menu"
        session.xdotool("key", "Down", "Down", "Return")              # "Ask…"
        assert wait_until(lambda: session.xdotool("search", "--onlyvisible", "--name", "Ask DeskEye"), 10)
    finally:
        app.stop()
        session.stop()
