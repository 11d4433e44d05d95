"""Private browser windows are never captured, in English and Chinese, on a real X server (Xvfb, bare and with
the openbox window manager).

Each window here is a real X11 top-level window (Tk) carrying what the browser's own window carries, as read
with xprop from Firefox ESR 153 and Chromium 156 private windows on X11: the title (the browsers' real strings,
see PRIVATE_WINDOW_TITLES in deskeye/settings.py), WM_CLASS, WM_WINDOW_ROLE "browser" and _NET_WM_PID naming
the window's own process, whose command line holds the flags the browser was started with. `deskeye describe
--region` runs as a subprocess under LANG=en_US.UTF-8 and LANG=zh_CN.UTF-8: it refuses with exit code 3 and
names the window, and still describes an ordinary window.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.fixtures.polling import wait_until
from tests.fixtures.processes import stop_process
from tests.fixtures.real_desktop import start_real_desktop

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

LOCALES = ["en_US.UTF-8", "zh_CN.UTF-8"]
REGION = "100,100,600,200"              # every window below sits inside it
GEOMETRY = "560x160+120+120"
REFUSED = 3                             # deskeye's exit code when privacy refuses (deskeye.oneshot.PrivacyRefusal)
FIREFOX = ("Navigator", "firefox-esr")  # WM_CLASS as Firefox ESR sets it
CHROMIUM = ("chromium", "Chromium")
CHROME = ("google-chrome", "Google-chrome")
EDGE = ("microsoft-edge", "Microsoft-edge")
BRAVE = ("brave-browser", "Brave-browser")

# (browser's WM_CLASS, the private window's real title): each refused by its title alone, in any locale.
PRIVATE_TITLES = [
    (FIREFOX, "Mozilla Firefox Private Browsing"),
    (FIREFOX, "Bank statement — Mozilla Firefox Private Browsing"),
    (FIREFOX, "新标签页 — Mozilla Firefox 隐私浏览"),
    (FIREFOX, "新分頁 — Mozilla Firefox 隱私瀏覽模式"),
    (FIREFOX, "新分頁 — Mozilla Firefox 隱私瀏覽"),
    (CHROMIUM, "New Incognito Tab - Chromium"),
    (CHROMIUM, "新的无痕式标签页 - Chromium"),
    (CHROMIUM, "新無痕分頁 - Chromium"),
    (CHROME, "新的无痕式标签页 - Google Chrome"),
    (EDGE, "New InPrivate tab - Microsoft Edge"),
    (BRAVE, "New Private Tab - Brave"),
    (BRAVE, "新无痕标签页 - Brave"),
    (BRAVE, "新隱私分頁 - Brave"),
]
# Ordinary (not private) windows' titles that share a word with a private one: no default entry may match them.
ORDINARY_TITLES = [
    "新标签页 - Brave", "新分頁 - Brave", "隱私權政策 - Brave", "隐私设置 - Brave", "設定 - 隱私權和安全性 - Brave",
    "Privacy Policy - Brave", "Private Equity Funds - Brave", "新分頁 — Mozilla Firefox", "新的标签页 - Chromium",
]
# (WM_CLASS, an ordinary page's title, the flag the browser process was started with): refused by the flag.
PRIVATE_PROCESSES = [
    (CHROMIUM, "账户余额 - Chromium", "--incognito"),
    (FIREFOX, "账户余额 — Mozilla Firefox", "--private-window"),
    (CHROME, "Bank statement - Google Chrome", "--incognito"),
    (EDGE, "帳戶餘額 - Microsoft Edge", "--inprivate"),
    (BRAVE, "账户余额 - Brave", "--tor"),
]

WINDOW_SCRIPT = r"""
import json, sys, tkinter as tk
from Xlib import X, Xatom, display
spec = json.loads(sys.argv[1])               # sys.argv[2:]: the flags this "browser" was started with
root = tk.Tk()
root.withdraw()
root.title(spec["title"])
root.geometry(spec["geometry"])
root.configure(bg="white")
for text in spec["lines"]:
    tk.Label(root, text=text, bg="white", fg="black", anchor="w", font=("DejaVu Sans", 20)).pack(
        fill="x", padx=20, pady=6)
root.update_idletasks()
conn = display.Display()
top = conn.create_resource_object("window", root.winfo_id()).query_tree().parent   # Tk's wrapper: the top level
top.set_wm_class(*spec["wm_class"])
top.change_property(conn.intern_atom("WM_WINDOW_ROLE"), Xatom.STRING, 8, b"browser")
top.change_property(conn.intern_atom("_NET_WM_PID"), Xatom.CARDINAL, 32, [__import__("os").getpid()])
conn.sync()
root.deiconify()
root.update()
while top.get_attributes().map_state != X.IsViewable:
    root.update()
if spec["focus"]:
    root.focus_force()
root.update()
root.tk.call("winfo", "id", ".")
print(top.id, flush=True)
sys.stdin.read()
"""


@dataclass
class BrowserWindow:
    __test__ = False
    proc: subprocess.Popen
    window_id: int


def open_browser_window(display, wm_class, title, *flags, lines=("DeskEye test window",), geometry=GEOMETRY,
                        focus=False, lang="C.UTF-8") -> BrowserWindow:
    """A real top-level X window on `display` with a browser's title, WM_CLASS, role and _NET_WM_PID, owned by a
    process started with `flags`; returned once it is viewable."""
    spec = {"title": title, "wm_class": list(wm_class), "geometry": geometry, "lines": list(lines), "focus": focus}
    proc = subprocess.Popen([sys.executable, "-c", WINDOW_SCRIPT, json.dumps(spec), *flags],
                            env=display.env(LANG=lang, LC_ALL=lang), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    if not line.strip().isdigit():
        stop_process(proc)
        raise AssertionError(f"the test window {title!r} did not map: {proc.stderr.read()}")
    return BrowserWindow(proc, int(line))


def close_browser_window(window: BrowserWindow) -> None:
    window.proc.stdin.close()
    stop_process(window.proc, timeout_s=5)


@pytest.fixture
def browser_window(xdisplay):
    """Factory for open_browser_window on the session's Xvfb; all are closed at the end of the test."""
    opened: list[BrowserWindow] = []

    def factory(*args, **kwargs) -> BrowserWindow:
        opened.append(open_browser_window(xdisplay, *args, **kwargs))
        return opened[-1]

    yield factory
    for window in opened:
        close_browser_window(window)


@pytest.fixture
def deskeye(tmp_path, xdisplay):
    """Run `deskeye --settings <tmp>/settings.toml ARGS` on a display (the session's Xvfb unless given) under a
    locale; XDG folders are private to the test and no model is configured (the worker reads with OCR)."""
    settings = tmp_path / "settings.toml"
    settings.write_text("[worker]\nstartup_timeout_s = 240.0\nrequest_timeout_s = 240.0\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DESKEYE_"))}
    for name in ("XDG_CONFIG_HOME", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        (tmp_path / name).mkdir(mode=0o700)
        env[name] = str(tmp_path / name)

    def run(*args: str, lang: str, display=xdisplay) -> subprocess.CompletedProcess:
        run_env = {**env, "DISPLAY": display.name, "LANG": lang, "LC_ALL": lang, "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(settings), *args],
                              capture_output=True, text=True, timeout=600, env=run_env)
    run.settings = settings
    return run


# The refusal as the user reads it, in the language of their locale (the window's title is quoted as it is).
REFUSAL_WORDS = {
    "en_US.UTF-8": {"not_looking": "DeskEye is not looking", "nothing": "Nothing was captured or sent.",
                    "in_region": "a window in the watched region", "matches": "matches the exclusion entry",
                    "private": "is a private browser window ({browser} was started with {flag})",
                    "started": "started with {flag}"},
    "zh_CN.UTF-8": {"not_looking": "DeskEye 没有查看屏幕", "nothing": "没有截取或发送任何内容。",
                    "in_region": "监视区域中的一个窗口", "matches": "与排除项",
                    "private": "是浏览器的隐私窗口（{browser} 以 {flag} 启动）", "started": "以 {flag} 启动"},
}


def _refused_for(proc: subprocess.CompletedProcess, title: str, lang: str = "en_US.UTF-8") -> bool:
    words = REFUSAL_WORDS[lang]
    return (proc.returncode == REFUSED and proc.stdout == "" and words["not_looking"] in proc.stderr
            and repr(title) in proc.stderr and words["nothing"] in proc.stderr)


@pytest.mark.parametrize("lang", LOCALES)
@pytest.mark.parametrize("wm_class, title", PRIVATE_TITLES, ids=[t for _, t in PRIVATE_TITLES])
def test_a_private_window_is_refused_by_its_real_title_in_both_locales(deskeye, browser_window, lang, wm_class,
                                                                        title):
    browser_window(wm_class, title, lang=lang)
    proc = deskeye("describe", "--region", REGION, "--json", lang=lang)
    assert _refused_for(proc, title, lang), (proc.returncode, proc.stderr)
    words = REFUSAL_WORDS[lang]
    assert words["in_region"] in proc.stderr and words["matches"] in proc.stderr, proc.stderr
    assert "starting the worker" not in proc.stderr


def test_the_default_entries_match_every_private_title_and_no_ordinary_one():
    """The default entries, as matched (NFKC, case-folded, anywhere in the title): each private title above is
    caught, and no ordinary title sharing a word with one (隱私, 新分頁, Private) is."""
    from deskeye.see.privacy import matching_exclusion
    from deskeye.settings import Settings

    entries = Settings().excluded_titles
    assert [title for _, title in PRIVATE_TITLES if not matching_exclusion(title, entries)] == []
    assert matching_exclusion("新隱私分頁 - Brave", entries) == "新隱私分頁"
    assert matching_exclusion("新无痕标签页 - Brave", entries) == "无痕"
    assert {title: matching_exclusion(title, entries) for title in ORDINARY_TITLES} == {
        title: "" for title in ORDINARY_TITLES}


@pytest.mark.parametrize("lang", LOCALES)
@pytest.mark.parametrize("wm_class, title, flag", PRIVATE_PROCESSES, ids=[f for *_, f in PRIVATE_PROCESSES])
def test_a_browser_started_private_is_refused_whatever_its_title_says(deskeye, browser_window, lang, wm_class,
                                                                      title, flag):
    """Chromium marks only its new-tab page in the title; the flag on the browser's command line is the sign
    that does not depend on the language."""
    browser_window(wm_class, title, "--no-first-run", flag, lang=lang)
    proc = deskeye("describe", "--region", REGION, "--json", lang=lang)
    assert _refused_for(proc, title, lang), (proc.returncode, proc.stderr)
    assert REFUSAL_WORDS[lang]["private"].format(browser=wm_class[1].casefold(), flag=flag) in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("lang", LOCALES)
def test_an_ordinary_browser_window_is_still_described(deskeye, browser_window, lang):
    """The same browser, the same page title, no private flag: captured and read."""
    browser_window(CHROMIUM, "账户余额 - Chromium", "--no-first-run", lines=["Deploy window closes Friday"],
                   lang=lang)
    proc = deskeye("describe", "--region", REGION, "--json", lang=lang)
    assert proc.returncode == 0, proc.stderr
    assert "friday" in json.loads(proc.stdout)["summary"].lower(), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("lang", LOCALES)
def test_a_configured_entry_is_never_silently_dropped(deskeye, browser_window, lang):
    """An entry with stray spaces still matches; a blank one is refused at load, naming the key, instead of
    matching nothing (or, as one space, everything)."""
    browser_window(FIREFOX, "Secret Vault — Mozilla Firefox", lang=lang)
    base = deskeye.settings.read_text(encoding="utf-8")
    deskeye.settings.write_text(base + '[capture]\nextra_excluded_titles = ["  secret vault "]\n', encoding="utf-8")
    proc = deskeye("describe", "--region", REGION, "--json", lang=lang)
    assert _refused_for(proc, "Secret Vault — Mozilla Firefox", lang), (proc.returncode, proc.stderr)

    deskeye.settings.write_text(base + '[capture]\nextra_excluded_titles = ["Vault", " "]\n', encoding="utf-8")
    proc = deskeye("describe", "--region", REGION, "--json", lang=lang)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr)
    assert "capture.extra_excluded_titles: invalid value ' '" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def openbox_desktop():
    """Xvfb with the openbox window manager: windows are reparented into frames, as on a user's desktop."""
    desktop = start_real_desktop(1280, 800)
    yield desktop
    desktop.stop()


@pytest.mark.parametrize("lang", LOCALES)
@pytest.mark.parametrize("wm_class, title, flags", [
    (FIREFOX, "新分頁 — Mozilla Firefox 隱私瀏覽模式", ()),
    (CHROMIUM, "账户余额 - Chromium", ("--incognito",)),
], ids=["title", "flag"])
def test_a_private_window_in_a_window_managers_frame_is_refused(deskeye, openbox_desktop, lang, wm_class, title,
                                                                 flags):
    """Under openbox the window sits in the manager's frame (and, being new, is the active one); its title, class
    and process are read from the client inside the frame, and the refusal names it."""
    window = open_browser_window(openbox_desktop.display, wm_class, title, *flags, lang=lang)
    try:
        assert [cls for _, cls in openbox_desktop.client_windows()] == [" ".join(wm_class)]   # managed, framed
        proc = deskeye("describe", "--region", REGION, "--json", lang=lang, display=openbox_desktop.display)
        assert _refused_for(proc, title, lang), (proc.returncode, proc.stderr)
        assert all(REFUSAL_WORDS[lang]["started"].format(flag=flag) in proc.stderr for flag in flags), proc.stderr
    finally:
        close_browser_window(window)


def test_the_active_private_window_is_read_from_the_x_server(browser_window):
    """The active window's title, WM_CLASS and process are read from the X server: the focused window is refused
    by its title, or by its browser's flag, with no region given."""
    from deskeye.see.privacy import active_window, check_privacy
    from deskeye.settings import Settings

    window = browser_window(CHROMIUM, "新的无痕式标签页 - Chromium", focus=True)
    seen = active_window()
    assert seen.title == "新的无痕式标签页 - Chromium" and seen.wm_class == CHROMIUM and seen.pid == window.proc.pid
    verdict = check_privacy(Settings().excluded_titles)
    assert verdict.is_excluded and verdict.matched == "无痕" and verdict.where == "the active window"

    browser_window(FIREFOX, "账户余额 — Mozilla Firefox", "-private-window", focus=True)
    _wait_for_active("账户余额 — Mozilla Firefox")
    verdict = check_privacy(Settings().excluded_titles)
    assert verdict.is_excluded and verdict.flag == "-private-window" and verdict.browser == "firefox-esr"
    assert verdict.reason.startswith("DeskEye is not looking: the active window ('账户余额 — Mozilla Firefox') is a "
                                     "private browser window")


def _wait_for_active(title: str) -> None:
    from deskeye.see.privacy import active_window_title
    assert wait_until(lambda: active_window_title() == title, 10), active_window_title()
