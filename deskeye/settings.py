"""DeskEye's settings: one validated object, loaded once and passed in. Never read from globals.

The file is TOML at `<platform config dir>/deskeye/settings.toml` (platformdirs). Every option, its
default and its meaning is written by `deskeye settings --init` (generated from these dataclasses by
deskeye/settings_cli.py; an option's `# comment` here describes it unless that file's table does).

Every number carries its allowed range (`_bounded`): a value that is not finite or out of range is refused
at load, naming the key and the range, instead of breaking a timer or a font later. The file itself must be
a regular UTF-8 file of at most MAX_SETTINGS_FILE_BYTES (a folder, a FIFO or a device is refused before it is
read, so nothing blocks: deskeye/files.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from deskeye.errors import SettingsError
from deskeye.files import read_regular_text

MAX_SETTINGS_FILE_BYTES = 1 << 20     # a settings file is a few KB; a bigger "file" is a mistake (or /dev/zero)
_BOUNDS = "deskeye.bounds"            # dataclass field metadata key


@dataclass(frozen=True)
class Bounds:
    """The allowed range of a number setting (inclusive), as the error message and `settings --init` say it."""
    low: int | float
    high: int | float
    unit: str = ""                    # "seconds", "pixels", ...
    note: str = ""                    # what a special value means, e.g. "0 = keep it"

    def allows(self, value: Any, type_name: str) -> bool:
        kinds = int if type_name == "int" else (int, float)
        return (isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
                and self.low <= value <= self.high)

    def describe(self, type_name: str) -> str:
        noun = "an integer" if type_name == "int" else "a number"
        unit = f" of {self.unit}" if self.unit else ""
        note = f" ({self.note})" if self.note else ""
        return f"{noun}{unit} from {self.low} to {self.high}{note}"


def _bounded(default: int | float, low: int | float, high: int | float, unit: str = "", note: str = ""):
    """A number field with its allowed range; checked by _check_numbers in the section's __post_init__."""
    return field(default=default, metadata={_BOUNDS: Bounds(low, high, unit, note)})


def field_bounds(f: dataclasses.Field) -> Bounds | None:
    return f.metadata.get(_BOUNDS)


def _check_numbers(section_obj: Any, section: str) -> None:
    """Every bounded number of a section is finite and in its range (NaN, inf and 2**63 fail here, not later)."""
    for f in fields(section_obj):
        bounds = field_bounds(f)
        if bounds is not None:
            value = getattr(section_obj, f.name)
            _check(bounds.allows(value, str(f.type)), f"{section}.{f.name}", bounds.describe(str(f.type)),
                   value=value)


def package_rules_dir() -> Path:
    """DeskEye's router data and default hooks, shipped inside the package (works from a built wheel)."""
    from importlib.resources import files
    return Path(str(files("deskeye") / "rules"))


# Private browser windows: the words each browser writes into a private window's title, in English, simplified and
# traditional Chinese (matched case-insensitively anywhere in a title; deskeye/see/privacy.py also knows a browser
# started private by its command line, whatever the language). Where each comes from:
PRIVATE_WINDOW_TITLES = [
    # Firefox, on every page: "<page> — Mozilla Firefox Private Browsing" (browser.ftl
    # browser-main-private-window-title, en-US), "… 隐私浏览" (zh-CN) and "… 隱私瀏覽模式" (zh-TW; older "… 隱私瀏覽"):
    # mozilla-l10n/firefox-l10n {zh-CN,zh-TW}/browser/browser/browser.ftl browser-main-window-titles; seen so on
    # Firefox ESR 153 windows (X11).
    "Private Browsing", "隐私浏览", "隱私瀏覽",
    # Chromium and Chrome, on the new-tab page only: "New Incognito Tab - Chromium", "新的无痕式标签页 - Chromium",
    # "新無痕分頁 - Chromium" (IDS_NEW_INCOGNITO_TAB_TITLE in Chromium 156's locales/zh-CN.pak and zh-TW.pak, seen
    # as X11 window titles). Any other page's title says nothing: the command line is the only sign then.
    "Incognito", "无痕", "無痕",
    # Microsoft Edge keeps its word "InPrivate" untranslated; its new-tab page is "New InPrivate tab" (Edge is
    # closed source: not checked on a real Edge window).
    "InPrivate",
    # Brave says "Private" where Chromium says "Incognito", on its private new-tab page only: "New Private Tab -
    # Brave", "新无痕标签页 - Brave" (already matched by "无痕" above), "新隱私分頁 - Brave". From brave/brave-core:
    # IDS_NEW_INCOGNITO_TAB_TITLE "New Private Tab" in components/new_or_sad_tab_strings.grdp (grit message id
    # 8326104954595890674), translated in components/strings/components_strings_zh-CN.xtb (commit affd7d89) and
    # components_strings_zh-TW.xtb (commit 02f4b612); " - Brave" is IDS_BROWSER_WINDOW_TITLE_FORMAT
    # (app/resources/brave_strings_zh-CN.xtb, id 5381622442243174305). The whole zh-TW title, as a bare "隱私" is
    # in ordinary titles ("隱私權政策"). Not checked on a real Brave window; any other page's title says nothing:
    # Brave started private is known by its command line in any language.
    "New Private Tab", "新隱私分頁",
    # Tor Browser is private whatever its window shows.
    "Tor Browser",
]

DEFAULT_EXCLUDED_TITLES = [
    "1Password", "Bitwarden", "KeePass", "KeePassXC", "LastPass", "Dashlane", "Keeper", "Enpass",
    "Proton Pass", "pass:", *PRIVATE_WINDOW_TITLES,
]


@dataclass
class CaptureSettings:
    monitor: int = _bounded(1, 0, 16, note="0 = all monitors, 1 = primary")   # 1 = primary; 0 = all stitched
    region: str = ""                  # "X,Y,W,H" in pixels from the monitor's top-left; "" = 800x600 centred
    interval_s: float = _bounded(3.0, 0.2, 86_400, "seconds")          # seconds between grabs
    change_threshold: int = _bounded(12, 0, 255, "grey levels")       # a 64x48 thumbnail cell's change that counts
    min_changed_percent: float = _bounded(0.8, 0, 100, "percent")     # a change this wide is described at once
    small_change_interval_s: float = _bounded(60.0, 0, 86_400, "seconds",
                                              "0 = small changes are never described on their own")
    excluded_titles: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDED_TITLES))
    extra_excluded_titles: list[str] = field(default_factory=list)   # the user's additions
    debug_save_frames_dir: str = ""   # "" = never write a screenshot to disk
    portal: str = "auto"              # Wayland: auto | screencast | screenshot (deskeye/see/backends.py)
    source: str = "monitor"           # Wayland: monitor | window (one window the user picks in the desktop's dialog)

    def __post_init__(self):
        _check_numbers(self, "capture")
        _check(self.portal in PORTAL_CAPTURES, "capture.portal", " | ".join(PORTAL_CAPTURES), value=self.portal)
        _check(self.source in CAPTURE_SOURCES, "capture.source", " | ".join(CAPTURE_SOURCES), value=self.source)
        _check(self.source != "window" or self.portal != "screenshot", "capture.source",
               'monitor where capture.portal = "screenshot" (a window is shared through the ScreenCast portal)',
               value=self.source)
        if self.region:
            parse_region(self.region, key="capture.region")
        for key in ("excluded_titles", "extra_excluded_titles"):     # a blank entry would match nothing, silently
            for entry in getattr(self, key):
                _check(isinstance(entry, str) and entry.strip() != "", f"capture.{key}",
                       "words of a window title (none blank)", value=entry)


PORTAL_CAPTURES = ("auto", "screencast", "screenshot")     # capture.portal
CAPTURE_SOURCES = ("monitor", "window")                   # capture.source


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


POSITIONS = ("bottom-right", "top-right", "bottom-left", "top-left")   # overlay.position (deskeye/see/placement.py)


@dataclass
class OverlaySettings:
    fade_after_s: float = _bounded(8.0, 0, 86_400, "seconds", "0 = keep it")   # hide the answer after this
    alpha: float = _bounded(0.88, 0.1, 1.0)                  # window opacity (needs a compositor to blend)
    width_px: int = _bounded(420, 120, 8192, "pixels")
    margin_px: int = _bounded(16, 0, 2000, "pixels")
    font_size: int = _bounded(11, 6, 72, "points")
    position: str = "bottom-right"    # corner of the monitor: bottom-right | top-right | bottom-left | top-left
    speak: bool = False               # read each answer aloud (speech-dispatcher, else espeak-ng)

    def __post_init__(self):
        _check_numbers(self, "overlay")
        _check(self.position in POSITIONS, "overlay.position", " | ".join(POSITIONS), value=self.position)


ENGINES = ("auto", "ocr", "transformers", "openvino")


@dataclass
class WorkerSettings:
    engine: str = "auto"              # auto = the model below if set and loadable (openvino for an IR folder), else ocr
    model: str = ""                   # local folder or Hugging Face id of a vision-language model
    device: str = "auto"              # auto | cuda | cpu
    dtype: str = "auto"               # auto | bf16 | fp16 | fp32
    decode_weights: str = "auto"      # auto | int8 | model: what a decode step multiplies by on the CPU
    url: str = ""                     # an external OpenAI-compatible server instead of our worker
    api_key: str = ""                 # key for `url`; "" = read the environment variable below
    api_key_env: str = "DESKEYE_WORKER_API_KEY"
    remote_model: str = ""            # model name to ask an external server for ("" = its first model)
    startup_timeout_s: float = _bounded(180.0, 1, 86_400, "seconds")
    request_timeout_s: float = _bounded(120.0, 1, 3600, "seconds")
    max_restarts: int = _bounded(5, 0, 100)                 # restarts within restart_window_s before giving up
    restart_window_s: float = _bounded(300.0, 1, 86_400, "seconds")
    max_tokens: int = _bounded(256, 16, 32_768, "tokens")
    ground_with_ocr: bool = False     # add the OCR text of the frame to the model's prompt
    ocr_first: bool = True            # with a vision model: show the OCR engine's first look while the model
                                      # answers (a small local OCR worker runs beside it)

    def __post_init__(self):
        _check(self.engine in ENGINES, "worker.engine", " | ".join(ENGINES), value=self.engine)
        _check(self.device in ("auto", "cuda", "cpu"), "worker.device", "auto | cuda | cpu", value=self.device)
        _check(self.dtype in ("auto", "bf16", "fp16", "fp32"), "worker.dtype", "auto | bf16 | fp16 | fp32",
               value=self.dtype)
        _check(self.decode_weights in ("auto", "int8", "model"), "worker.decode_weights", "auto | int8 | model",
               value=self.decode_weights)
        _check(self.url == "" or self.url.startswith(("http://", "https://")), "worker.url",
               "an http:// or https:// URL, or \"\" to run DeskEye's own worker", value=self.url)
        _check_numbers(self, "worker")


@dataclass
class MemorySettings:
    turns: int = _bounded(3, 0, 20)   # (question, answer) turns carried into the next prompt

    def __post_init__(self):
        _check_numbers(self, "memory")


@dataclass
class RouterSettings:
    data_dir: str = ""                # "" = the router data shipped with DeskEye (deskeye/rules/)
    min_confidence: float = _bounded(0.0, 0.0, 0.999, note="0 = never fall back")   # else standard below this

    def __post_init__(self):
        _check_numbers(self, "router")


@dataclass
class ProviderSettings:
    calendar_ics: str = ""            # path to an .ics file for "next meeting" / "am I free at 4pm"
    imap_host: str = ""
    imap_port: int = _bounded(993, 1, 65_535)
    imap_user: str = ""
    imap_password_env: str = "DESKEYE_IMAP_PASSWORD"   # else the OS keyring, service "deskeye-imap"
    imap_tls: bool = True             # False only for a local test server
    imap_ca_file: str = ""            # PEM CA file to trust for imap_host, e.g. a self-signed server's ("" = system CAs)
    imap_mailbox: str = "INBOX"       # the mailbox whose unseen messages are counted
    imap_timeout_s: float = _bounded(5.0, 0.1, 300, "seconds")   # the whole IMAP check (connect, TLS, login, STATUS)
    quick_answer_timeout_s: float = _bounded(3.0, 0.1, 300, "seconds")   # a slower quick answer is given up

    def __post_init__(self):
        _check_numbers(self, "providers")
        _check(bool(self.imap_mailbox.strip()), "providers.imap_mailbox", "a mailbox name such as INBOX",
               value=self.imap_mailbox)


@dataclass
class HookSettings:
    rules_file: str = ""              # the user's hooks.toml; "" = <config dir>/hooks.toml if it exists
    dry_run: bool = False             # log what would run, run nothing
    enabled: bool = True
    audit_log: str = ""               # JSON-lines audit of every firing; "" = <platform log dir>/deskeye/hooks.log
    command_timeout_s: float = _bounded(10.0, 0.1, 3600, "seconds")   # a hook's command is killed after this

    def __post_init__(self):
        _check_numbers(self, "hooks")


@dataclass
class UiSettings:
    language: str = "auto"            # the language DeskEye speaks: auto (the locale's) | en | zh_CN | zh_TW

    def __post_init__(self):
        from deskeye.language import SETTING_VALUES
        _check(self.language in SETTING_VALUES, "ui.language", " | ".join(SETTING_VALUES), value=self.language)


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
    ui: UiSettings = field(default_factory=UiSettings)
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
    """Read settings from `path` (default: the platform config file; a missing or empty file = defaults)."""
    path = path or default_settings_path()
    try:
        text = read_regular_text(path, max_bytes=MAX_SETTINGS_FILE_BYTES, what="settings file")
    except FileNotFoundError:
        return Settings(config_dir=path.parent)
    try:
        data = tomllib.loads(text)
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
        bounds = field_bounds(f)
        allowed = f" ({bounds.describe(str(f.type))})" if bounds else ""
        raise SettingsError(f"{source}: {section}.{key} must be {f.type}{allowed}; got {value!r}.")


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
