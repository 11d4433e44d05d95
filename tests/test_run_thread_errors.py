"""`deskeye run` and a thread that dies because the X server closed its connection.

pynput's hotkey listener reads keys on its own X connection. When the X server goes away it often notices first,
before Xlib's IO-error handler has run on another thread (CI saw it: a 30-line pynput traceback in the user's
terminal under "lost the X display"). `cmd_run` installs `_quiet_x_connection_errors` as the thread exception hook
from its start: an X connection error becomes one line, and every other exception keeps its traceback.
"""

from __future__ import annotations

import logging
import threading

import pytest
from Xlib.error import ConnectionClosedError

from deskeye import run


def _die_in_thread(name: str, exc: BaseException) -> None:
    def raise_it() -> None:
        raise exc
    thread = threading.Thread(target=raise_it, name=name)
    thread.start()
    thread.join()


@pytest.fixture
def run_hook(monkeypatch):
    """The hook as `cmd_run` installs it, before the display is known to be lost."""
    monkeypatch.setattr(threading, "excepthook", run._quiet_x_connection_errors)
    monkeypatch.setattr(run, "_display_gone", threading.Event())
    return run._display_gone


def test_a_closed_x_connection_before_the_display_is_known_lost_is_one_line(run_hook, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger=run.__name__):
        _die_in_thread("deskeye-hotkeys", ConnectionClosedError("server"))
    assert "Traceback" not in capsys.readouterr().err
    assert [r.getMessage() for r in caplog.records] == [
        "deskeye: deskeye-hotkeys stopped: the X server closed its connection (Display connection closed by server)."]


def test_after_the_display_is_lost_its_threads_end_silently(run_hook, capsys, caplog):
    run_hook.set()
    with caplog.at_level(logging.DEBUG, logger=run.__name__):
        _die_in_thread("deskeye-hotkeys", ConnectionClosedError("server"))
        _die_in_thread("deskeye-overlay", BrokenPipeError("the X socket"))
    assert "Traceback" not in capsys.readouterr().err
    assert all(r.levelno == logging.DEBUG for r in caplog.records) and len(caplog.records) == 2


def test_any_other_exception_keeps_its_traceback(run_hook, capsys):
    _die_in_thread("deskeye-worker-watch", ValueError("a real bug"))
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: a real bug" in err
    _die_in_thread("deskeye-capture", OSError("disk full"))          # the display is not lost: an OSError is a bug
    assert "OSError: disk full" in capsys.readouterr().err
