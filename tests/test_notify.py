"""Desktop notifications reach a real D-Bus session bus (dbus-daemon started by the tests) and a
notification server on it; notify-send (libnotify) is driven against the same bus."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from deskeye.ui.notify import MAX_BODY_CHARS, Notifier, clean_text
from tests.fixtures.dbus_session import NotificationServer

pytestmark = [pytest.mark.subprocess]

TRICKY = 'Build failed: "tests" <b>bold</b> & $(touch PWNED) `id`; rm -rf ~ — 测试失败'


def test_notify_reaches_the_session_bus_with_title_and_body(notification_server):
    assert Notifier(backend="dbus").notify("DeskEye: answer ready", TRICKY) is True
    [call] = notification_server.wait_for_calls(1)
    assert (call.app_name, call.title, call.body) == ("DeskEye", "DeskEye: answer ready", TRICKY)
    assert call.actions == [] and call.expire_ms == -1


def test_auto_backend_on_linux_uses_dbus(notification_server):
    assert Notifier().notify("title", "body text") is True
    assert [(c.title, c.body) for c in notification_server.wait_for_calls(1)] == [("title", "body text")]


def test_markup_is_escaped_where_the_server_renders_it(dbus_session, monkeypatch):
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", dbus_session)
    server = NotificationServer(dbus_session, capabilities=("body", "body-markup")).start()
    try:
        assert Notifier(backend="dbus").notify("t", "<b>x</b> & y") is True
        [call] = server.wait_for_calls(1)
    finally:
        server.stop()
    assert call.body == "&lt;b&gt;x&lt;/b&gt; &amp; y"


def test_control_characters_dropped_and_length_capped(notification_server):
    assert Notifier(backend="dbus").notify("a\x1b[31mred\x07", "line1\nline2\x00" + "x" * 5000) is True
    [call] = notification_server.wait_for_calls(1)
    assert call.title == "a [31mred"
    assert call.body.startswith("line1\nline2 x") and len(call.body) == MAX_BODY_CHARS


def test_notify_send_backend_reaches_the_same_bus(notification_server):
    body = "-starts with a dash; $(touch PWNED)"
    assert Notifier(backend="notify-send").notify("--help", body) is True
    [call] = notification_server.wait_for_calls(1)
    assert (call.title, call.body, call.app_name) == ("--help", body, "DeskEye")


def test_no_bus_returns_false_without_raising(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={tmp_path}/no-such-bus")
    caplog.set_level("INFO", logger="deskeye.ui.notify")
    assert Notifier(backend="dbus", timeout_s=1).notify("title", "body") is False
    assert "not shown" in caplog.text


def test_osascript_gets_the_texts_as_arguments_not_script(tmp_path, monkeypatch):
    """macOS cannot run here: a stand-in `osascript` on PATH records its argv (a real subprocess)."""
    record = tmp_path / "argv.json"
    fake = tmp_path / "osascript"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    title = 'x" & (do shell script "touch /tmp/PWNED") & "'
    assert Notifier(backend="osascript").notify(title, TRICKY) is True
    argv = json.loads(record.read_text())
    assert argv[-2:] == [title, TRICKY]
    script = [argv[i + 1] for i, a in enumerate(argv[:-2]) if a == "-e"]
    assert script == ["on run argv", "display notification (item 2 of argv) with title (item 1 of argv)", "end run"]


def test_clean_text_keeps_newlines_and_unicode():
    assert clean_text("第一行\n第二行\x0b!\t", 100) == "第一行\n第二行 !"
    assert clean_text("abcdef", 4) == "abc…"


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="one of auto, dbus"):
        Notifier(backend="growl")
