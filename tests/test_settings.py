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
