"""Settings file: `deskeye settings [--init]`, and the errors a bad file gives (exit 2, naming the key)."""

import dataclasses
import re
import subprocess
import sys
import tomllib

import pytest

from deskeye.cli import main
from deskeye.settings import Settings, load_settings
from deskeye.settings_cli import (DESCRIPTIONS, SECTION_DESCRIPTIONS, describe_option, documented_toml,
                                  section_fields)
from tests.fixtures.small_fs import full_filesystem  # noqa: F401 - a fixture

pytestmark = [pytest.mark.subprocess]


def _sections(settings: Settings) -> dict:
    return {name: dataclasses.asdict(getattr(settings, name)) for name in section_fields()}


def test_every_option_is_described_and_no_description_is_stale():
    options = {f"{section}.{f.name}" for section, fs in section_fields().items() for f in fs}
    undocumented = [key for key in options if not describe_option(*key.split("."))]
    assert undocumented == []
    assert set(DESCRIPTIONS) <= options
    assert set(SECTION_DESCRIPTIONS) == set(section_fields())


def test_init_writes_documented_defaults_that_load_back(tmp_path, capsys):
    path = tmp_path / "conf" / "settings.toml"
    assert main(["--settings", str(path), "settings", "--init"]) == 0
    text = path.read_text(encoding="utf-8")
    assert _sections(load_settings(path)) == _sections(Settings())
    for section, options in section_fields().items():       # each option is documented above its default
        for option in options:
            first_words = " ".join(describe_option(section, option.name).split()[:3])
            assert f"# {first_words}" in text, f"{section}.{option.name}"
            assert f"\n{option.name} = " in text
    out = capsys.readouterr()
    assert f"settings file: {path}" in out.out and "Wrote" in out.err


def test_init_keeps_an_existing_file(tmp_path, capsys):
    path = tmp_path / "settings.toml"
    path.write_text('[worker]\nengine = "ocr"\n', encoding="utf-8")
    assert main(["--settings", str(path), "settings", "--init"]) == 0
    assert path.read_text(encoding="utf-8") == '[worker]\nengine = "ocr"\n'
    out = capsys.readouterr()
    assert "already exists" in out.err


def test_show_prints_path_and_effective_settings(tmp_path, capsys):
    path = tmp_path / "settings.toml"
    path.write_text('[worker]\nengine = "ocr"\nmax_tokens = 64\n[memory]\nturns = 1\n', encoding="utf-8")
    assert main(["--settings", str(path), "settings"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"# settings file: {path}"
    effective = tomllib.loads(out)
    assert effective["worker"]["engine"] == "ocr" and effective["worker"]["max_tokens"] == 64
    assert effective["memory"]["turns"] == 1
    assert effective["capture"]["interval_s"] == Settings().capture.interval_s


def test_default_location_follows_xdg_config_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    assert f"# settings file: {tmp_path / 'xdg' / 'deskeye' / 'settings.toml'}  (not found" in out


@pytest.mark.parametrize("body, expected", [
    ('[worker]\nengine = "gpu"\n', ["worker.engine", "'gpu'", "auto | ocr | transformers"]),
    ('[worker]\nmax_tokens = "many"\n', ["worker.max_tokens", "int", "'many'"]),
    ('[overlay]\nalpha = 5.0\n', ["overlay.alpha", "5.0", "0.1 to 1.0"]),
    ('[worker]\nmodle = "x"\n', ["worker.modle", "known:", "model"]),
    ('[wroker]\nengine = "ocr"\n', ["[wroker]", "known:", "worker"]),
    ('[capture]\nregion = "10,10"\n', ["capture.region", "X,Y,W,H"]),
    ('[capture]\nportal = "pipewire"\n', ["capture.portal", "'pipewire'", "auto | screencast | screenshot"]),
    ('[capture]\nsource = "tab"\n', ["capture.source", "'tab'", "monitor | window"]),
    ('[capture]\nsource = "window"\nportal = "screenshot"\n', ["capture.source", "ScreenCast portal"]),
    ("[worker\n", ["not valid TOML"]),
])
def test_bad_file_exits_2_naming_key_and_allowed_values(tmp_path, capsys, body, expected):
    path = tmp_path / "settings.toml"
    path.write_text(body, encoding="utf-8")
    assert main(["--settings", str(path), "settings"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deskeye: {path}") and "Traceback" not in err
    for fragment in expected:
        assert fragment in err


def test_bad_file_as_a_real_process_has_no_traceback(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text('[worker]\ndevice = "tpu"\n', encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(path), "describe"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == (f"deskeye: {path}: worker.device: invalid value 'tpu'; "
                                   "allowed: auto | cuda | cpu.")


def test_documented_toml_round_trips_non_default_values():
    settings = dataclasses.replace(Settings(), worker=dataclasses.replace(Settings().worker, url="http://h:1",
                                                                          ground_with_ocr=True))
    data = tomllib.loads(documented_toml(settings))
    assert data["worker"]["url"] == "http://h:1" and data["worker"]["ground_with_ocr"] is True


def test_settings_refuse_the_hotkeys_run_would_refuse(tmp_path):
    from deskeye.errors import SettingsError
    from deskeye.settings import HotkeySettings
    for bad, reason in (("<ctrl>+<bogus>", "<bogus> is not a key name"), ("<ctrl>+<alt>", "only modifier keys"),
                        ("<ctrl>+", "ends with '+'"), ("ctrl+alt+d", "neither one character"),
                        ("<ctrl>+a+a", "a key appears twice")):
        with pytest.raises(SettingsError, match=rf"hotkeys.ask = .* is not a valid hotkey \(.*{re.escape(reason)}"):
            HotkeySettings(ask=bad)
    with pytest.raises(SettingsError, match="hotkeys.ask and hotkeys.describe are the same key combination"):
        HotkeySettings(ask="<alt>+<ctrl>+D")
    assert HotkeySettings().ask == "<ctrl>+<alt>+a"
    path = tmp_path / "s.toml"
    path.write_text('[hotkeys]\npause = "<ctrl>+<nope>"\n')
    with pytest.raises(SettingsError, match=r"s.toml: hotkeys.pause = '<ctrl>\+<nope>' is not a valid hotkey"):
        load_settings(path)


# ---------------------------------------------------------------- numbers: finite and in range, or refused at load

def _number_options() -> list[tuple[str, str, str]]:
    return [(section, f.name, str(f.type)) for section, fs in section_fields().items() for f in fs
            if str(f.type) in ("int", "float")]


@pytest.mark.parametrize("section, key, toml_value, range_text", [
    ("worker", "request_timeout_s", "nan", "from 1 to 3600"),
    ("worker", "startup_timeout_s", "-5", "from 1 to 86400"),
    ("overlay", "fade_after_s", "inf", "from 0 to 86400"),
    ("capture", "interval_s", "inf", "from 0.2 to 86400"),
    ("overlay", "font_size", str(2 ** 63), "from 6 to 72"),
])
def test_values_that_broke_later_are_refused_at_load_naming_key_and_range(tmp_path, capsys, section, key,
                                                                          toml_value, range_text):
    path = tmp_path / "settings.toml"
    path.write_text(f"[{section}]\n{key} = {toml_value}\n", encoding="utf-8")
    assert main(["--settings", str(path), "settings"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deskeye: {path}: {section}.{key}: invalid value ") and "Traceback" not in err
    assert "allowed: " in err and range_text in err


@pytest.mark.parametrize("section, key, kind", _number_options(), ids=lambda v: str(v))
def test_every_number_option_refuses_non_finite_and_out_of_range_values(tmp_path, section, key, kind):
    from deskeye.errors import SettingsError
    bad = ["9223372036854775807", "-9223372036854775807"] if kind == "int" else ["nan", "inf", "-inf", "1e300",
                                                                                 "-1e300"]
    path = tmp_path / "settings.toml"
    for value in bad:
        path.write_text(f"[{section}]\n{key} = {value}\n", encoding="utf-8")
        with pytest.raises(SettingsError) as caught:
            load_settings(path)
        message = str(caught.value)
        assert f"{section}.{key}: invalid value" in message, (value, message)
        assert re.search(r"allowed: an? (integer|number)\b.* from \S+ to \S+", message), (value, message)


def test_a_number_of_the_wrong_type_is_told_its_range(tmp_path, capsys):
    path = tmp_path / "settings.toml"
    path.write_text('[overlay]\nfont_size = "huge"\n', encoding="utf-8")
    assert main(["--settings", str(path), "settings"]) == 2
    assert "overlay.font_size must be int (an integer of points from 6 to 72); got 'huge'." in capsys.readouterr().err


def test_documented_file_states_each_number_range(tmp_path):
    text = documented_toml()
    assert "(float, 0.2 to 86400)\ninterval_s = 3.0" in text.replace("\n# ", " ").replace("# ", "")
    assert "(int, 6 to 72)\nfont_size = 11" in text.replace("\n# ", " ").replace("# ", "")


# ---------------------------------------------------------------- the settings file itself: a regular UTF-8 file

def _load_in_subprocess(path, timeout_s: float = 30.0) -> tuple[subprocess.CompletedProcess, float]:
    """`deskeye settings` on `path` in a child with 2 GiB of address space (so a file that never ends cannot eat
    the machine) and a timeout (so a FIFO that blocks fails the test instead of hanging it)."""
    import resource
    import time

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "deskeye.cli", "--settings", str(path), "settings"],
                              capture_output=True, text=True, timeout=timeout_s, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {path} did not finish within {timeout_s} s (it blocked or read forever)")
    return proc, time.monotonic() - started


def _make_fifo(tmp_path):
    import os
    path = tmp_path / "settings.toml"
    os.mkfifo(path)
    return path


def _make_folder(tmp_path):
    path = tmp_path / "settings.toml"
    path.mkdir()
    return path


@pytest.mark.parametrize("make, kind", [
    (_make_folder, "is a folder"),
    (_make_fifo, "is a FIFO (named pipe)"),
    (lambda tmp_path: "/dev/zero", "is a character device"),
], ids=["folder", "fifo", "dev-zero"])
def test_settings_path_that_is_not_a_regular_file_is_refused_quickly(tmp_path, make, kind):
    path = make(tmp_path)
    proc, elapsed_s = _load_in_subprocess(path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"deskeye: {path}: {kind}; the settings file must be a regular file: "
                                   "give the path of one.")
    assert elapsed_s < 20


def test_settings_file_with_invalid_utf8_names_the_byte_offset(tmp_path):
    path = tmp_path / "settings.toml"
    body = b'[worker]\nengine = "ocr"\n# caf\xe9 au lait\n'
    path.write_bytes(body)
    offset = body.index(b"\xe9")
    proc, _ = _load_in_subprocess(path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"deskeye: {path}: not valid UTF-8 at byte offset {offset} (0xe9); "
                                   "save the settings file as UTF-8.")


@pytest.mark.slow
def test_settings_file_over_the_size_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("# padding\n" * ((8 << 20) // 10), encoding="utf-8")     # valid TOML, 8 MiB of comments
    proc, _ = _load_in_subprocess(path)
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(rf"deskeye: {re.escape(str(path))}: {path.stat().st_size} bytes, too large for a settings "
                        r"file \(at most \d+\); check that the path names the right file\.", proc.stderr.strip())


# ---------------------------------------------------------------- writes: atomic, nothing left behind

def test_init_replaces_an_empty_file_and_says_so(tmp_path, capsys):
    path = tmp_path / "settings.toml"
    path.write_bytes(b"")                      # what an older version left on a full disk
    assert main(["--settings", str(path), "settings", "--init"]) == 0
    assert f"Replaced the empty settings file with the documented defaults to {path}" in capsys.readouterr().err
    assert path.read_text(encoding="utf-8") == documented_toml()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.toml"]
    path.write_bytes(b"")
    assert main(["--settings", str(path), "settings"]) == 0
    assert f"# settings file: {path}  (empty: the defaults are in effect)" in capsys.readouterr().out


@pytest.mark.slow
def test_init_on_a_full_disk_leaves_no_file_no_temp_file_and_the_old_empty_file_as_it_was(full_filesystem, capsys):
    folder = full_filesystem.root / "conf"
    path = folder / "settings.toml"
    assert main(["--settings", str(path), "settings", "--init"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"deskeye: cannot write {path}: No space left on device; nothing was changed. "
                           "Free some space or choose another file with --settings PATH.")
    assert full_filesystem.entries(folder) == []          # no 0-byte settings file, no temp file

    path.write_bytes(b"")                                 # an empty file takes no space, even on a full disk
    assert main(["--settings", str(path), "settings", "--init"]) == 2
    assert full_filesystem.entries(folder) == ["settings.toml"] and path.read_bytes() == b""

    full_filesystem.free()                                # room again: --init is not blocked by the empty file
    assert main(["--settings", str(path), "settings", "--init"]) == 0
    assert path.read_text(encoding="utf-8") == documented_toml()
    assert full_filesystem.entries(folder) == ["settings.toml"]


@pytest.mark.slow
def test_init_past_a_file_size_limit_leaves_no_partial_file_and_no_temp_file(tmp_path):
    from tests.fixtures.small_fs import FSIZE_LIMIT_PRELUDE
    folder = tmp_path / "conf"
    folder.mkdir()
    path = folder / "settings.toml"
    script = FSIZE_LIMIT_PRELUDE + (
        "import sys\nfrom deskeye.cli import main\n"
        f"sys.exit(main(['--settings', {str(path)!r}, 'settings', '--init']))\n")
    expected = (f"deskeye: cannot write {path}: File too large; nothing was changed. "
                "Free some space or choose another file with --settings PATH.")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr.strip()) == (2, expected)
    assert list(folder.iterdir()) == []                       # no partial settings file, no temp file

    path.write_bytes(b"")                                     # an older version's empty file stays as it was
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr.strip()) == (2, expected)
    assert sorted(p.name for p in folder.iterdir()) == ["settings.toml"] and path.read_bytes() == b""


def test_atomic_write_failure_keeps_the_old_content(full_filesystem):
    from deskeye.files import write_file_atomically
    path = full_filesystem.root / "conf" / "settings.toml"
    full_filesystem.free()
    path.write_text('[worker]\nengine = "ocr"\n', encoding="utf-8")
    from tests.fixtures.small_fs import _fill
    _fill(full_filesystem.filler)
    with pytest.raises(OSError, match="No space left on device"):
        write_file_atomically(path, documented_toml().encode("utf-8"))
    assert path.read_text(encoding="utf-8") == '[worker]\nengine = "ocr"\n'
    assert full_filesystem.entries(path.parent) == ["settings.toml"]
