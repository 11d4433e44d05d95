"""`deskeye settings`: show where the settings live and what is in effect; `--init` writes a documented file.

While DeskEye runs with this settings file, what is in effect is the running app's (its run state,
deskeye/live_settings.py), followed by the values in the file that wait for a restart; else it is the file's.

The documented file is generated from the dataclasses in deskeye/settings.py (names, types, defaults) plus
the descriptions below (an option missing from the table is described by its `# comment` in settings.py),
so the file, the docs and the defaults cannot drift apart: a test checks that every option has a
description and that the written file loads back as the defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import stat
import sys
import textwrap
from pathlib import Path
from typing import Any

from deskeye.errors import SettingsError
from deskeye.live_settings import applies_live, running_settings
from deskeye.files import write_file_atomically
from deskeye.settings import Settings, default_settings_path, field_bounds

RUNNING_HEADER = "# in effect in the running DeskEye (process {pid}):"
PENDING_HEADER = "# in the file, pending a restart of DeskEye (the running one keeps the value above):"
FILE_ERROR_LINE = "# the file's last change was not used: {error}"
LIVE_NOTE = "A change applies while DeskEye runs."
LIVE_EXCEPT_NOTE = "A change applies while DeskEye runs, except to {names} (restart DeskEye)."
RESTART_NOTE = "A change applies when DeskEye restarts."

SECTION_DESCRIPTIONS = {
    "capture": "What part of the screen DeskEye watches, and how often.",
    "hotkeys": "Global hotkeys (pynput syntax: <ctrl>+<alt>+d).",
    "overlay": "The translucent always-on-top answer window.",
    "worker": "The model process. By default DeskEye starts its own worker (deskeye-worker); set `url` to use "
              "an external OpenAI-compatible server (vLLM, llama.cpp server, Ollama, transformers serve) instead.",
    "memory": "Conversation memory kept by the app.",
    "router": "Routing of typed questions to quick / standard / deep answers.",
    "providers": "Local data sources for quick answers (calendar, mail).",
    "hooks": "Automation hooks fired by detected key objects.",
    "ui": "DeskEye's own words: the tray, the Ask box, the overlay's notices, and the language answers are asked in.",
}

DESCRIPTIONS = {
    "capture.monitor": "Monitor to capture: 1 = primary, 2.. = others, 0 = all monitors stitched together.",
    "capture.region": 'Screen region "X,Y,W,H" in pixels; "" = an 800x600 region centred on the monitor.',
    "capture.interval_s": "Seconds between grabs.",
    "capture.change_threshold": "How much a cell of the 64x48 grey thumbnail must move (grey levels, 0-255) to "
                                "count as changed. Unchanged frames are skipped.",
    "capture.min_changed_percent": "A change over at least this percentage of the thumbnail's cells (about one "
                                   "line of text at 0.8) is described at once.",
    "capture.small_change_interval_s": "A smaller change (a clock, a cursor, a spinner) is described at most this "
                                       "often, in seconds; 0 = never on its own. Hotkey describes are always "
                                       "immediate.",
    "capture.excluded_titles": "Never capture while the active window's title contains one of these "
                               "(password managers, private browsing).",
    "capture.extra_excluded_titles": "Your own additions to excluded_titles.",
    "capture.debug_save_frames_dir": 'Folder to save captured frames to, for debugging; "" = never write '
                                     "a screenshot to disk.",
    "capture.portal": 'On Wayland: "auto" (the portal\'s ScreenCast where offered, else its Screenshot), '
                      '"screencast" or "screenshot".',
    "capture.source": 'On Wayland: "monitor", or "window": one window you pick in the desktop\'s sharing '
                      "dialog (only it is seen; capture.region, if set, is then in that window's pixels).",
    "hotkeys.describe": "Describe the region now.",
    "hotkeys.pause": "Pause / resume the capture loop.",
    "hotkeys.ask": "Open the Ask box (type a question, Enter to ask, Esc to close).",
    "overlay.fade_after_s": "Hide the answer after this many seconds; 0 = keep it until the next one.",
    "overlay.alpha": "Window opacity (blending needs a compositor).",
    "overlay.width_px": "Window width in pixels.",
    "overlay.margin_px": "Distance from the screen corner in pixels.",
    "overlay.position": "Corner of the monitor (inside the panels' work area): bottom-right | top-right | "
                        "bottom-left | top-left. The default capture region keeps out of that side's column.",
    "overlay.font_size": "Font size in points.",
    "worker.engine": 'auto = the model below if one is set and loads, else OCR; "ocr" = text recognition only '
                     '(CPU, no model); "transformers" = the model, or fail.',
    "worker.model": 'A local model folder or Hugging Face id of a vision-language model; "" = none (OCR engine).',
    "worker.device": "auto | cuda | cpu.",
    "worker.dtype": "auto | bf16 | fp16 | fp32.",
    "worker.decode_weights": "auto | int8 | model: on the CPU, int8 copies of the text model's weights make each "
                             "written word ~1.5x faster for one more byte of memory per text parameter (auto: for "
                             "models of 100M parameters or more); model = the model's exact arithmetic.",
    "worker.url": 'An external OpenAI-compatible server, e.g. "http://127.0.0.1:8000"; "" = run DeskEye\'s own '
                  "worker. The server must support response_format json_schema.",
    "worker.api_key": 'API key for `url`; "" = read it from the environment variable named by api_key_env '
                      "(better: keeps the key out of this file).",
    "worker.api_key_env": "Environment variable holding the API key for `url`.",
    "worker.remote_model": 'Model name to request from the external server; "" = the first one it lists.',
    "worker.startup_timeout_s": "Seconds to wait for the worker to load its model and answer /health.",
    "worker.request_timeout_s": "Seconds to wait for one answer.",
    "worker.max_restarts": "Restarts of a crashed worker allowed within restart_window_s before giving up.",
    "worker.restart_window_s": "The window, in seconds, for max_restarts.",
    "worker.max_tokens": "Longest answer, in tokens.",
    "worker.ground_with_ocr": "Also give the model the text OCR reads on the frame.",
    "worker.ocr_first": "With a vision model (a local one or `url`): show the OCR engine's answer for the same "
                        "frame at once, marked \"first look (OCR)\", until the model's answer replaces it. "
                        "Runs a small OCR worker beside the model; hooks and memory take only the model's "
                        "answer. false = one stage, the model's answer only.",
    "memory.turns": "(question, answer) turns carried into the next prompt.",
    "router.data_dir": 'Folder with the router\'s training data; "" = the data shipped with DeskEye (deskeye/rules/).',
    "router.min_confidence": "Below this confidence a quick or deep verdict falls back to standard.",
    "providers.calendar_ics": 'An .ics file for "next meeting" and "am I free at 4pm"; "" = none.',
    "providers.imap_host": 'IMAP server for "any new mail?"; "" = none.',
    "providers.imap_port": "IMAP port.",
    "providers.imap_user": "IMAP user name.",
    "providers.imap_password_env": 'Environment variable with the IMAP password; else the OS keyring, '
                                   'service "deskeye-imap".',
    "providers.imap_tls": "Use TLS (false only for a local test server).",
    "providers.quick_answer_timeout_s": "Seconds a quick answer (calendar, mail) may take; a slower one is given "
                                        "up and you are told why.",
    "hooks.rules_file": 'Your hooks.toml; "" = hooks.toml in the settings folder, if it exists.',
    "hooks.dry_run": "Log what hooks would run; run nothing.",
    "hooks.enabled": "Fire hooks at all.",
}


_FIELD_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+?)\s*$")


def inline_comments(cls: type) -> dict[str, str]:
    """`name: type = default   # meaning` lines of a settings dataclass: the fallback descriptions."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):                 # no source (frozen app): the table above still documents
        return {}
    return {m.group(1): m.group(2) for m in map(_FIELD_COMMENT.match, source.splitlines()) if m}


def describe_option(section: str, option: str) -> str:
    """The option's description: the table above, else its comment in deskeye/settings.py ("" = undocumented)."""
    key = f"{section}.{option}"
    if key in DESCRIPTIONS:
        return DESCRIPTIONS[key]
    comment = inline_comments(type(getattr(Settings(), section))).get(option, "")
    return comment[:1].upper() + comment[1:]


def section_fields() -> dict[str, list[dataclasses.Field]]:
    """Each settings section and its options, from the dataclasses (the single source of truth)."""
    defaults = Settings()
    return {f.name: list(dataclasses.fields(getattr(defaults, f.name)))
            for f in dataclasses.fields(Settings) if f.name != "config_dir"}


def option_kind(option: dataclasses.Field) -> str:
    """The option's type, and for a number its allowed range: "float, 0.2 to 86400"."""
    bounds = field_bounds(option)
    return f"{option.type}, {bounds.low} to {bounds.high}" if bounds else str(option.type)


def toml_value(value: Any) -> str:
    import tomli_w
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def documented_toml(settings: Settings | None = None, *, commented: bool = True) -> str:
    """The settings as TOML; with `commented`, each option preceded by its description and default."""
    settings = settings or Settings()
    lines = ["# DeskEye settings. Every option is shown with its default value.",
             "# Delete what you do not change; `deskeye settings` shows what is in effect."] if commented else []
    for section, options in section_fields().items():
        lines.append("")
        if commented:
            lines += _comment(f"{SECTION_DESCRIPTIONS[section]} {when_applied(section, options)}")
        lines.append(f"[{section}]")
        for option in options:
            value = getattr(getattr(settings, section), option.name)
            if commented:
                lines += _comment(f"{describe_option(section, option.name)} ({option_kind(option)})")
            lines.append(f"{option.name} = {toml_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def when_applied(section: str, options: list[dataclasses.Field]) -> str:
    """Whether a change to the section's options applies while DeskEye runs (deskeye/live_settings.py)."""
    live = [option.name for option in options if applies_live(f"{section}.{option.name}")]
    if not live:
        return RESTART_NOTE
    later = [option.name for option in options if option.name not in live]
    return LIVE_EXCEPT_NOTE.format(names=", ".join(later)) if later else LIVE_NOTE


def _comment(text: str) -> list[str]:
    return [f"# {line}" for line in textwrap.wrap(text, width=100)]


def is_empty_file(path: Path) -> bool:
    """A 0-byte regular file: it holds no settings (the defaults are in effect), so --init may replace it.
    Such a file is what an interrupted write of an older DeskEye left behind on a full disk."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == 0


def init_settings_file(path: Path) -> bool:
    """Write the documented defaults to `path` unless settings are there (an empty file holds none). True if
    written. The write is atomic: on a full disk it raises SettingsError and leaves no file, no temp file and
    an existing empty file as it was."""
    target = path.resolve()             # a symlinked settings file is written where it points
    if target.exists() and not is_empty_file(target):
        return False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(target, documented_toml().encode("utf-8"))
    except OSError as exc:
        raise SettingsError(f"cannot write {path}: {exc.strerror or exc}; nothing was changed. Free some space "
                            "or choose another file with --settings PATH.") from None
    return True


def cmd_settings(args, settings: Settings) -> int:
    path = Path(args.settings) if getattr(args, "settings", None) else default_settings_path()
    if args.init:
        was_empty = is_empty_file(path)
        if init_settings_file(path):
            replaced = "Replaced the empty settings file with" if was_empty else "Wrote"
            print(f"{replaced} the documented defaults to {path}", file=sys.stderr)
        else:
            print(f"{path} already exists; left it unchanged (move it away to write fresh defaults).",
                  file=sys.stderr)
    if not path.exists():
        state = "  (not found: the defaults are in effect)"
    else:
        state = "  (empty: the defaults are in effect)" if is_empty_file(path) else ""
    print(f"# settings file: {path}{state}")
    running = running_settings(path)
    if running is None:
        print(documented_toml(settings, commented=False), end="")
        return 0
    print(RUNNING_HEADER.format(pid=running.pid))
    print(documented_toml(running.in_effect, commented=False), end="")
    if running.pending:
        print(PENDING_HEADER)
        for key, value in running.pending.items():
            print(f"#   {key} = {toml_value(value)}")
    if running.file_error:
        print(FILE_ERROR_LINE.format(error=" ".join(running.file_error.split())))
    return 0
