"""Shared fixtures. Each fixture module owns one concept; see tests/fixtures/."""

import os

import pytest

pytest_plugins = ["tests.fixtures.worker", "tests.fixtures.xvfb", "tests.fixtures.tiny_models", "tests.fixtures.tk_windows",
                  "tests.fixtures.dbus_session", "tests.fixtures.imap_server", "tests.fixtures.vllm_server"]

# The files that took longest in a whole run (junit times, 2 cores, 2026-12), longest first. scripts/test.sh runs the
# files side by side (pytest-xdist, --dist loadfile --no-loadscope-reorder: in collection order, where xdist would
# put the files with the most tests first): these go first so that the run does not end waiting on a five-minute
# soak that started last. Any order is correct; this one is faster. test_ocr_wording.py is new and not measured yet.
LONGEST_FIRST = ("test_soak.py", "test_openvino_engine.py", "test_real_size_smoke.py", "test_speech.py",
                 "test_static_screen.py", "test_two_stage.py", "test_vllm_e2e.py", "test_gpu_check_dry.py",
                 "test_own_windows_on_top.py", "test_supervisor.py", "test_ocr_real_windows.py",
                 "test_prepare_processes.py", "test_worker_http.py", "test_kv_soak.py", "test_worker_contract.py",
                 "test_app_xvfb.py", "test_wayland_privacy.py", "test_screen_sizes.py", "test_external_server.py",
                 "test_gnome_wayland.py", "test_wayland_own_windows.py")


def _xlib_tables_per_connection() -> None:
    """python-xlib 0.33 keeps the extensions' event and error classes and opcodes in class attributes of its protocol
    Display, shared by every connection of the process. A test process that talks in-process to two X servers whose
    extensions number their events differently (Xvfb, then Xwayland under sway or GNOME) gets them mixed: the next
    connection fails in its constructor ("TypeError: 'type' object does not support item assignment") or misreads
    events. DeskEye talks to one X server; the tests talk to many, one after the other. So here each connection
    starts from the library's own tables, as a fresh process would."""
    from Xlib import error
    from Xlib.protocol import display as protocol_display, event
    original_init = protocol_display.Display.__init__
    if getattr(original_init, "deskeye_per_connection", False):
        return

    def init(self, *args, **kwargs):
        self.extension_major_opcodes = {}
        self.error_classes = error.xerror_class.copy()
        self.event_classes = event.event_class.copy()
        original_init(self, *args, **kwargs)
    init.deskeye_per_connection = True
    protocol_display.Display.__init__ = init


_xlib_tables_per_connection()


def pytest_collection_modifyitems(items) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def private_runtime_folder(tmp_path_factory):
    """Every process a test starts without a runtime folder of its own gets this test process's: never the user's
    (a DeskEye the developer runs keeps its trigger socket), never another test process's (the files run side by
    side)."""
    folder = tmp_path_factory.mktemp("xdg_runtime")
    folder.chmod(0o700)
    saved = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    else:
        os.environ["XDG_RUNTIME_DIR"] = saved
