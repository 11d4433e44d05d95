"""DeskEye's settings: one validated object, loaded once and passed in. Never read from globals.

The file is TOML at `<platform config dir>/deskeye/settings.toml` (platformdirs). Every option, its
default and its meaning is written by `deskeye settings --init` (generated from these dataclasses by
deskeye/settings_cli.py; an option's `# comment` here describes it unless that file's table does).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin

from deskeye.errors import SettingsError



def package_rules_dir() -> Path:
    """DeskEye's router data and default hooks, shipped inside the package (works from a built wheel)."""
    from importlib.resources import files
    return Path(str(files("deskeye") / "rules"))


DEFAULT_EXCLUDED_TITLES = [
    "1Password", "Bitwarden", "KeePass", "KeePassXC", "LastPass", "Dashlane", "Keeper", "Enpass",
    "Proton Pass", "pass:", "Private Browsing", "InPrivate", "Incognito", "Tor Browser",
]


@dataclass
class CaptureSettings:
    monitor: int = 1                  # 1 = primary; 0 = all monitors stitched; 2.. = others (mss numbering)
    region: str = ""                  # "X,Y,W,H" in pixels from the monitor's top-left; "" = 800x600 centred
    interval_s: float = 3.0           # seconds between grabs
    change_threshold: int = 12        # grey-level difference (0-255) of a 64x48 thumbnail cell that counts as changed
    min_changed_percent: float = 0.8  # a change over at least this % of the cells is described at once
    small_change_interval_s: float = 60.0   # a smaller change (clock, cursor, spinner) at most this often; 0 = never
    excluded_titles: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDED_TITLES))
    extra_excluded_titles: list[str] = field(default_factory=list)   # the user's additions
    debug_save_frames_dir: str = ""   # "" = never write a screenshot to disk

    def __post_init__(self):
        _check(self.monitor >= 0, "capture.monitor", "an integer >= 0 (0 = all, 1 = primary)",
               value=self.monitor)
        _check(self.interval_s >= 0.2, "capture.interval_s", "a number of seconds >= 0.2", value=self.interval_s)
        _check(0 <= self.change_threshold <= 255, "capture.change_threshold", "an integer from 0 to 255",
               value=self.change_threshold)
        _check(0 <= self.min_changed_percent <= 100, "capture.min_changed_percent", "a percentage from 0 to 100",
               value=self.min_changed_percent)
        _check(self.small_change_interval_s >= 0, "capture.small_change_interval_s",
               "a number of seconds >= 0 (0 = small changes are never described on their own)",
               value=self.small_change_interval_s)
        if self.region:
            parse_region(self.region, key="capture.region")


@dataclass
class HotkeySettings:
    describe: str = "<ctrl>+<alt>+d"   # pynput GlobalHotKeys syntax
    pause: str = "<ctrl>+<alt>+p"
    ask: str = "<ctrl>+<alt>+a"        # opens the Ask box

    def __post_init__(self):
        from deskeye.hotkey_syntax import check_hotkey
        seen: dict[str, str] = {}
        for name in ("describe", "pause", "ask"):
            canonical = check_hotkey(getattr(self, name), f"hotkeys.{name}")
            if canonical in seen:
                raise SettingsError(f"hotkeys.{name} and hotkeys.{seen[canonical]} are the same key combination "
                                    f"({getattr(self, name)!r}); give each its own.")
            seen[canonical] = name


@dataclass
class OverlaySettings:
    fade_after_s: float = 8.0         # hide the answer after this many seconds; 0 = keep it
    alpha: float = 0.88               # window opacity (needs a compositor to blend)
    width_px: int = 420
    margin_px: int = 16
    font_size: int = 11
    position: str = "bottom-right"    # corner of the monitor: bottom-right | top-right | bottom-left | top-left

    def __post_init__(self):
        _check(self.fade_after_s >= 0, "overlay.fade_after_s", "a number of seconds >= 0", value=self.fade_after_s)
        _check(0.1 <= self.alpha <= 1.0, "overlay.alpha", "a number from 0.1 to 1.0", value=self.alpha)
        _check(self.width_px >= 120, "overlay.width_px", "an integer >= 120", value=self.width_px)
        _check(self.margin_px >= 0, "overlay.margin_px", "an integer >= 0", value=self.margin_px)
        from deskeye.placement import POSITIONS
        _check(self.position in POSITIONS, "overlay.position", " | ".join(POSITIONS), value=self.position)


ENGINES = ("auto", "ocr", "transformers", "openvino")


@dataclass
class WorkerSettings:
    engine: str = "auto"              # auto = the model below if set and loadable (openvino for an IR folder), else ocr
    model: str = ""                   # local folder or Hugging Face id of a vision-language model
    device: str = "auto"              # auto | cuda | cpu
    dtype: str = "auto"               # auto | bf16 | fp16 | fp32
    url: str = ""                     # an external OpenAI-compatible server instead of our worker
    api_key: str = ""                 # key for `url`; "" = read the environment variable below
    api_key_env: str = "DESKEYE_WORKER_API_KEY"
    remote_model: str = ""            # model name to ask an external server for ("" = its first model)
    startup_timeout_s: float = 180.0
    request_timeout_s: float = 120.0
    max_restarts: int = 5             # restarts within restart_window_s before giving up
    restart_window_s: float = 300.0
    max_tokens: int = 256
    ground_with_ocr: bool = False     # add the OCR text of the frame to the model's prompt

    def __post_init__(self):
        _check(self.engine in ENGINES, "worker.engine", " | ".join(ENGINES), value=self.engine)
        _check(self.device in ("auto", "cuda", "cpu"), "worker.device", "auto | cuda | cpu", value=self.device)
        _check(self.dtype in ("auto", "bf16", "fp16", "fp32"), "worker.dtype", "auto | bf16 | fp16 | fp32",
               value=self.dtype)
        _check(self.url == "" or self.url.startswith(("http://", "https://")), "worker.url",
               "an http:// or https:// URL, or \"\" to run DeskEye's own worker", value=self.url)
        _check(self.max_tokens >= 16, "worker.max_tokens", "an integer >= 16", value=self.max_tokens)


@dataclass
class MemorySettings:
    turns: int = 3                    # (question, answer) turns carried into the next prompt

    def __post_init__(self):
        _check(0 <= self.turns <= 20, "memory.turns", "an integer from 0 to 20", value=self.turns)


@dataclass
class RouterSettings:
    data_dir: str = ""                # "" = the router data shipped with DeskEye (deskeye/rules/)
    min_confidence: float = 0.0       # below this a quick/deep verdict falls back to standard

    def __post_init__(self):
        _check(0.0 <= self.min_confidence < 1.0, "router.min_confidence", "a number from 0 to 1 (0 = never fall back)",
               value=self.min_confidence)


@dataclass
class ProviderSettings:
    calendar_ics: str = ""            # path to an .ics file for "next meeting" / "am I free at 4pm"
    imap_host: str = ""
    imap_port: int = 993
    imap_user: str = ""
    imap_password_env: str = "DESKEYE_IMAP_PASSWORD"   # else the OS keyring, service "deskeye-imap"
    imap_tls: bool = True             # False only for a local test server
    imap_ca_file: str = ""            # PEM CA file to trust for imap_host, e.g. a self-signed server's ("" = system CAs)
    imap_mailbox: str = "INBOX"       # the mailbox whose unseen messages are counted
    imap_timeout_s: float = 5.0       # connect/read timeout for the IMAP server, seconds

    def __post_init__(self):
        _check(1 <= self.imap_port <= 65535, "providers.imap_port", "a TCP port from 1 to 65535", value=self.imap_port)
        _check(self.imap_timeout_s > 0, "providers.imap_timeout_s", "a number of seconds > 0",
               value=self.imap_timeout_s)
        _check(bool(self.imap_mailbox.strip()), "providers.imap_mailbox", "a mailbox name such as INBOX",
               value=self.imap_mailbox)


@dataclass
class HookSettings:
    rules_file: str = ""              # the user's hooks.toml; "" = <config dir>/hooks.toml if it exists
    dry_run: bool = False             # log what would run, run nothing
    enabled: bool = True
    audit_log: str = ""               # JSON-lines audit of every firing; "" = <platform log dir>/deskeye/hooks.log
    command_timeout_s: float = 10.0   # a hook's command is killed after this many seconds

    def __post_init__(self):
        _check(self.command_timeout_s > 0, "hooks.command_timeout_s", "a number of seconds > 0",
               value=self.command_timeout_s)


@dataclass
class Settings:
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    hotkeys: HotkeySettings = field(default_factory=HotkeySettings)
    overlay: OverlaySettings = field(default_factory=OverlaySettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    providers: ProviderSettings = field(default_factory=ProviderSettings)
    hooks: HookSettings = field(default_factory=HookSettings)
    config_dir: Path = field(default_factory=lambda: default_config_dir())

    @property
    def rules_dir(self) -> Path:
        return Path(self.router.data_dir).expanduser() if self.router.data_dir else package_rules_dir()

    @property
    def excluded_titles(self) -> list[str]:
        return self.capture.excluded_titles + self.capture.extra_excluded_titles


def default_config_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_config_dir("deskeye", appauthor=False))


def default_settings_path() -> Path:
    return default_config_dir() / "settings.toml"


def parse_region(text: str, *, key: str = "--region") -> tuple[int, int, int, int]:
    try:
        x, y, w, h = (int(v) for v in text.split(","))
    except ValueError:
        raise SettingsError(f"{key} must be X,Y,W,H in pixels (e.g. 100,100,800,600); got {text!r}.") from None
    if w <= 0 or h <= 0 or x < 0 or y < 0:
        raise SettingsError(f"{key}: width and height must be positive and X,Y not negative; got {text!r}.")
    return x, y, w, h


def load_settings(path: Path | None = None) -> Settings:
    """Read settings from `path` (default: the platform config file; missing file = defaults)."""
    path = path or default_settings_path()
    if not path.exists():
        return Settings(config_dir=path.parent)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    return settings_from_dict(data, source=str(path), config_dir=path.parent)


def settings_from_dict(data: dict[str, Any], *, source: str = "settings", config_dir: Path | None = None) -> Settings:
    sections = {f.name: f for f in fields(Settings) if f.name != "config_dir"}
    built = {}
    for name, value in data.items():
        if name not in sections:
            raise SettingsError(f"{source}: unknown section [{name}]; known: {', '.join(sections)}.")
        if not isinstance(value, dict):
            raise SettingsError(f"{source}: [{name}] must be a table.")
        built[name] = _build_section(sections[name].type, name, value, source)
    return Settings(**built, config_dir=config_dir or default_config_dir())


def _build_section(type_name: Any, section: str, values: dict[str, Any], source: str):
    cls = globals()[type_name] if isinstance(type_name, str) else type_name
    known = {f.name: f for f in fields(cls)}
    for key, value in values.items():
        if key not in known:
            raise SettingsError(f"{source}: unknown key {section}.{key}; known: {', '.join(known)}.")
        _check_type(section, key, value, known[key], source)
    try:
        return cls(**values)
    except SettingsError as exc:
        raise SettingsError(f"{source}: {exc}") from None


_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool, "list[str]": list}


def _check_type(section: str, key: str, value: Any, f: dataclasses.Field, source: str) -> None:
    expected = _TYPES.get(str(f.type))
    ok = isinstance(value, expected) if expected else True
    if isinstance(value, bool) and str(f.type) in ("int", "float"):
        ok = False
    if ok and str(f.type) == "list[str]":
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        raise SettingsError(f"{source}: {section}.{key} must be {f.type}; got {value!r}.")


_UNSET = object()


def _check(ok: bool, key: str, allowed: str, *, value: Any = _UNSET) -> None:
    if not ok:
        shown = "" if value is _UNSET else f" {value!r}"
        raise SettingsError(f"{key}: invalid value{shown}; allowed: {allowed}.")


def with_overrides(settings: Settings, **sections: dict[str, Any]) -> Settings:
    """A copy with some keys replaced (CLI flags), validated like the file."""
    changes = {name: dataclasses.replace(getattr(settings, name), **values) for name, values in sections.items()}
    return dataclasses.replace(settings, **changes)


def worker_api_key(settings: WorkerSettings) -> str:
    """The key for an external server: the setting, else its environment variable (read here, on demand)."""
    return settings.api_key or os.environ.get(settings.api_key_env, "")
