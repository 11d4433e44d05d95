"""Answers read aloud (`overlay.speak = true`), for people who cannot read the overlay.

Each answer is spoken in its language: text with Chinese characters by a Mandarin voice (espeak-ng's "cmn"), text
with Latin letters in English, anything else (digits, symbols) in the interface language. It goes through
speech-dispatcher, so the voice, rate and audio device are the ones the user set for their screen reader: one
long-lived `spd-say -e` (pipe mode: each line is spoken; a line starting with "!-!" is an SSIP command, so
"CANCEL SELF" interrupts DeskEye's own utterance and never a screen reader's). Where speech-dispatcher is absent or
does not answer, espeak-ng speaks directly, one process per answer, stopped to interrupt it. Programs are started
from argv lists, never through a shell.

`Speaker.say(text)` returns at once: a speaking thread owns the engine. A new answer interrupts the one being
spoken, and of answers arriving faster than they can be started only the newest is spoken. With no engine at all
DeskEye stays silent and says so once (the log and `on_unavailable`), naming what to install; `stop()` at quit
silences it and ends the thread.
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from deskeye.language import detect_lang, resolve_language
from deskeye.settings import Settings

log = logging.getLogger(__name__)

MANDARIN = "cmn"                  # espeak-ng's Mandarin voice; speech-dispatcher's espeak-ng module knows it too
ENGLISH = "en"
MAX_SPOKEN_CHARS = 1000           # the overlay shows at most this much (spd-say also cuts lines at 16 KiB)
CONNECT_TIMEOUT_S = 10.0          # spd-say connecting (speech-dispatcher may be started on demand)
ECHO_TIMEOUT_S = 5.0              # spd-say echoing a line it was given: it is alive and took it
STOP_TIMEOUT_S = 3.0
MAX_ERROR_CHARS = 600             # of a failing spd-say's stderr, in the log and the notice

_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f]")
_BLANK = re.compile(r"[\x00-\x20\x7f\u2028\u2029]+")
_SSIP_PREFIX = "!-!"              # in spd-say's pipe mode a line starting with this is a command


def unavailable_message(reasons: list[str]) -> str:
    """What the user reads when no engine can speak (one place, for translation)."""
    return ("Answers cannot be read aloud: " + "; ".join(reasons) + ". Install speech-dispatcher (or espeak-ng), "
            "e.g. `sudo apt install speech-dispatcher espeak-ng`, or set overlay.speak = false.")


def voice_for(text: str, fallback: str = ENGLISH) -> str:
    """The voice for `text`: Mandarin for Chinese characters, English for Latin letters, else `fallback`."""
    if detect_lang(text) == "zh":
        return MANDARIN
    return ENGLISH if _LATIN.search(text) else fallback


def interface_voice(language: str) -> str:
    """The voice of the interface language (`ui.language`: auto|en|zh_CN|zh_TW; auto = the locale)."""
    return MANDARIN if resolve_language(language).startswith("zh") else ENGLISH


def spoken_text(text: str) -> str:
    """`text` as one line to speak: whitespace and control characters folded, bounded, never an SSIP command."""
    line = _BLANK.sub(" ", str(text)).strip().rstrip("…").strip()[:MAX_SPOKEN_CHARS]
    return line.replace(_SSIP_PREFIX, "! ")


@dataclass(frozen=True)
class Utterance:
    """What was handed to an engine: the text, the voice chosen for it, and the engine's name."""
    text: str
    voice: str
    engine: str


class SpeechUnavailable(Exception):
    """An engine cannot speak (not installed, not answering); the message says why."""


class Engine(Protocol):
    name: str

    def speak(self, text: str, voice: str) -> None: ...   # interrupts what this engine is saying
    def close(self) -> None: ...


class SpeechDispatcher:
    """speech-dispatcher through one `spd-say -e` (stdout line-buffered with stdbuf: each line it echoes back
    proves it is connected and has taken the line before). spd-say runs in the C locale: it exits at once under a
    locale that is not installed, and needs none (the language is set for each answer, the text is UTF-8 bytes)."""
    name = "speech-dispatcher"

    def __init__(self):
        if not (shutil.which("spd-say") and shutil.which("stdbuf")):
            raise SpeechUnavailable("speech-dispatcher is not installed (no spd-say)")
        self._proc = subprocess.Popen(["stdbuf", "-oL", "spd-say", "-e", "-P", "text", "-N", "deskeye"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      bufsize=0, env={**os.environ, "LC_ALL": "C"})
        self._echo = b""
        try:
            self._send(["CANCEL SELF"], CONNECT_TIMEOUT_S)
        except SpeechUnavailable:
            self.close()
            raise

    def speak(self, text: str, voice: str) -> None:
        self._send(["CANCEL SELF", f"SET SELF LANGUAGE {voice}", None], ECHO_TIMEOUT_S, text)

    def close(self) -> None:
        proc = self._proc
        try:
            if proc.poll() is None:
                proc.stdin.write(f"{_SSIP_PREFIX}CANCEL SELF\n".encode())
            proc.stdin.close()                       # spd-say ends at the end of its input
            proc.wait(STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            proc.stdout.close()
            proc.stderr.close()

    def _send(self, commands: list[str | None], timeout_s: float, text: str = "") -> None:
        """Write SSIP commands (None: the text itself) a line each, and wait until spd-say has echoed the last one
        (its own notes on stdout, such as "Invalid language!", are passed over)."""
        lines = [(text if command is None else _SSIP_PREFIX + command).encode() for command in commands]
        try:
            data = memoryview(b"".join(line + b"\n" for line in lines))
            while data:                              # an unbuffered pipe may take part of it at a time
                data = data[self._proc.stdin.write(data):]
        except OSError:
            raise SpeechUnavailable(f"spd-say stopped: {self._error()}") from None
        deadline = time.monotonic() + timeout_s
        while self._read_line(deadline) != lines[-1]:
            pass

    def _read_line(self, deadline: float) -> bytes:
        out = self._proc.stdout
        while b"\n" not in self._echo:
            if not select.select([out], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise SpeechUnavailable("spd-say did not answer in time")
            chunk = os.read(out.fileno(), 4096)
            if not chunk:
                raise SpeechUnavailable(f"spd-say ended: {self._error()}")
            self._echo += chunk
        line, self._echo = self._echo.split(b"\n", 1)
        return line

    def _error(self) -> str:
        """spd-say's own words on why it ended (its stderr), else its exit status."""
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        words = " ".join(self._proc.stderr.read(MAX_ERROR_CHARS).decode(errors="replace").split())
        return words or f"exit status {self._proc.returncode}"


class EspeakNg:
    """espeak-ng playing to the default audio device, one process per answer."""
    name = "espeak-ng"

    def __init__(self):
        if not shutil.which("espeak-ng"):
            raise SpeechUnavailable("espeak-ng is not installed")
        self._proc: subprocess.Popen | None = None

    def speak(self, text: str, voice: str) -> None:
        self.close()
        self._proc = subprocess.Popen(["espeak-ng", "-v", voice, "-b", "1", "--stdin"], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.close()
        except OSError as exc:
            raise SpeechUnavailable(f"espeak-ng stopped: {exc}") from None

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


ENGINES: tuple[Callable[[], Engine], ...] = (SpeechDispatcher, EspeakNg)   # tried in this order


class Speaker:
    """Reads answers aloud off the UI thread; see the module docstring. Nothing starts until the first `say()`."""

    def __init__(self, *, enabled: bool, fallback_voice: str = ENGLISH,
                 on_unavailable: Callable[[str], None] = lambda message: None,
                 on_spoken: Callable[[Utterance], None] = lambda utterance: None,
                 engines: tuple[Callable[[], Engine], ...] = ENGINES):
        self.enabled = enabled
        self.fallback_voice = fallback_voice
        self.on_unavailable = on_unavailable       # called once, on the speaking thread, with unavailable_message
        self.on_spoken = on_spoken                 # called on the speaking thread for each answer handed on
        self._engines = engines
        self._engine: Engine | None = None
        self._pending: str | None = None
        self._stopped = False
        self._said_unavailable = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_settings(cls, settings: Settings, **callbacks) -> Speaker:
        """`overlay.speak`; text without letters in the voice of `ui.language` (where that setting exists)."""
        ui = getattr(settings, "ui", None)
        return cls(enabled=settings.overlay.speak,
                   fallback_voice=interface_voice(getattr(ui, "language", "auto")), **callbacks)

    def say(self, text: str) -> None:
        """Speak `text` (any thread; returns at once), interrupting what is being said."""
        line = spoken_text(text) if self.enabled else ""
        if not line:
            return
        with self._changed:
            if self._stopped:
                return
            self._pending = line
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deskeye-speech", daemon=True)
                self._thread.start()
            self._changed.notify()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S * 2) -> None:
        """Silence it and end the speaking thread (at quit); `say` does nothing afterwards."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._stopped or self._pending is not None)
                    if self._stopped:
                        return
                    line, self._pending = self._pending, None
                self._speak(line)
        finally:
            self._close_engine()

    def _speak(self, line: str) -> None:
        voice = voice_for(line, self.fallback_voice)
        for _ in range(2):                         # an engine that stopped answering is reopened (or the next) once
            engine = self._engine or self._open_engine()
            if engine is None:
                return
            try:
                engine.speak(line, voice)
            except SpeechUnavailable as exc:
                log.warning("%s stopped speaking: %s", engine.name, exc)
                self._close_engine()
                continue
            self.on_spoken(Utterance(line, voice, engine.name))
            return

    def _open_engine(self) -> Engine | None:
        reasons = []
        for make in self._engines:
            try:
                self._engine = make()
            except (SpeechUnavailable, OSError) as exc:
                reasons.append(str(exc))
                continue
            if reasons:
                log.info("speaking with %s (%s)", self._engine.name, "; ".join(reasons))
            return self._engine
        if not self._said_unavailable:
            self._said_unavailable = True
            message = unavailable_message(reasons)
            log.warning("%s", message)
            self.on_unavailable(message)
        return None

    def _close_engine(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            try:
                engine.close()
            except OSError as exc:
                log.debug("closing %s: %s", engine.name, exc)
