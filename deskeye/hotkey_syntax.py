"""Hotkey strings in pynput's GlobalHotKeys syntax ("<ctrl>+<alt>+d"), checked without importing pynput.

pynput cannot be imported without a display, yet `deskeye settings` must refuse exactly what `deskeye run`
refuses. This mirrors pynput 1.8's `HotKey.parse`: parts joined by '+', each a single character or a key
name in angle brackets (or `<N>`, a virtual key code); no part twice. It also asks for at least one key
that is not a modifier, which pynput accepts but can never fire on its own.
"""

from __future__ import annotations

from deskeye.errors import SettingsError

MODIFIERS = frozenset("alt alt_l alt_r alt_gr cmd cmd_l cmd_r ctrl ctrl_l ctrl_r shift shift_l shift_r".split())
KEY_NAMES = MODIFIERS | frozenset(
    "backspace caps_lock delete down end enter esc home left page_down page_up right space tab up "
    "media_play_pause media_volume_mute media_volume_down media_volume_up media_previous media_next insert menu "
    "num_lock pause print_screen scroll_lock".split() + [f"f{i}" for i in range(1, 21)])
EXAMPLE = '"<ctrl>+<alt>+d" (modifiers and named keys in angle brackets, joined by \'+\')'


def split_parts(text: str) -> list[str]:
    """pynput's split: a '+' right after a separator is a key itself ("<ctrl>++")."""
    parts, start = [], 0
    for i, char in enumerate(text):
        if char == "+" and i != start:
            parts.append(text[start:i])
            start = i + 1
    if start == len(text):
        raise ValueError("it ends with '+'" if text else "it is empty")
    parts.append(text[start:])
    return parts


def canonical_part(part: str) -> str:
    if len(part) == 1:
        return part.lower()
    if len(part) > 2 and part[0] == "<" and part[-1] == ">":
        name = part[1:-1].lower()
        if name in KEY_NAMES or name.isdigit():
            return f"<{name}>"
        raise ValueError(f"{part} is not a key name; known names include <ctrl>, <alt>, <shift>, <cmd>, <f1>-<f20>")
    raise ValueError(f"{part!r} is neither one character nor a <key name>")


def check_hotkey(text: str, key: str) -> str:
    """The canonical form of `text` (for comparing hotkeys), or SettingsError naming `key` and the fix."""
    try:
        parts = [canonical_part(p) for p in split_parts(text)]
        if len(set(parts)) != len(parts):
            raise ValueError("a key appears twice")
        if all(p[1:-1] in MODIFIERS for p in parts if p.startswith("<")) and all(p.startswith("<") for p in parts):
            raise ValueError("it has only modifier keys")
    except ValueError as exc:
        raise SettingsError(f"{key} = {text!r} is not a valid hotkey ({exc}). Use pynput syntax, e.g. {EXAMPLE}.") \
            from None
    return "+".join(sorted(parts))


# How a key is named to the user ("Ctrl+Alt+P"): the names on keyboards, the same in every language DeskEye speaks.
_SHOWN_NAMES = {
    "alt": "Alt", "alt_l": "Left Alt", "alt_r": "Right Alt", "alt_gr": "AltGr", "cmd": "Super", "cmd_l": "Left Super",
    "cmd_r": "Right Super", "ctrl": "Ctrl", "ctrl_l": "Left Ctrl", "ctrl_r": "Right Ctrl", "shift": "Shift",
    "shift_l": "Left Shift", "shift_r": "Right Shift", "backspace": "Backspace", "caps_lock": "Caps Lock",
    "delete": "Delete", "down": "Down", "end": "End", "enter": "Enter", "esc": "Esc", "home": "Home", "left": "Left",
    "page_down": "Page Down", "page_up": "Page Up", "right": "Right", "space": "Space", "tab": "Tab", "up": "Up",
    "media_play_pause": "Play/Pause", "media_volume_mute": "Mute", "media_volume_down": "Volume Down",
    "media_volume_up": "Volume Up", "media_previous": "Previous Track", "media_next": "Next Track",
    "insert": "Insert", "menu": "Menu", "num_lock": "Num Lock", "pause": "Pause", "print_screen": "Print Screen",
    "scroll_lock": "Scroll Lock", **{f"f{i}": f"F{i}" for i in range(1, 21)},
}


def display_name(hotkey: str) -> str:
    """A hotkey as the user reads it: "<ctrl>+<alt>+p" -> "Ctrl+Alt+P", "<ctrl>++" -> "Ctrl+Plus", keys in the
    order written. A string that is not a valid hotkey is returned as it is (settings refuse it before it is shown)."""
    try:
        parts = [canonical_part(p) for p in split_parts(hotkey)]
    except ValueError:
        return hotkey
    return "+".join(_shown_part(p) for p in parts)


def _shown_part(part: str) -> str:
    if len(part) == 1:
        return "Plus" if part == "+" else part.upper()
    name = part[1:-1]
    return _SHOWN_NAMES.get(name) or f"Key {name}"      # <65>: a virtual key code
