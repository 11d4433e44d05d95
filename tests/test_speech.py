"""Answers read aloud (`overlay.speak = true`), measured as sound.

Everything is real. A PulseAudio server with a null sink is the sound card: it plays in real time, so an interrupted
answer really is cut short, and `parec` records what reaches it. `spd-say` starts speech-dispatcher on demand, as
on a desktop (in a private runtime folder); espeak-ng speaks where speech-dispatcher is absent (a PATH without
spd-say). sox measures each recording: how long it holds speech (silences cut out) and its RMS level. The yardstick
for a voice is the same text rendered by `espeak-ng -w` with that voice: an English voice spells Chinese characters
out one by one ("Chinese letter ..."), so it takes far longer over a Chinese answer than the Mandarin voice does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from deskeye.errors import SettingsError
from deskeye.settings import settings_from_dict
from deskeye.ui.speech import ENGLISH, MANDARIN, Speaker, Utterance, spoken_text
from tests.fixtures.polling import wait_until

pytestmark = [pytest.mark.desktop, pytest.mark.subprocess]

RATE = 22050                                   # what the recordings are made at (mono, signed 16 bit)
SOX_RAW = ["-t", "raw", "-r", str(RATE), "-e", "signed", "-b", "16", "-c", "1"]
SPEECH_ONLY = ["silence", "1", "0.05", "1%", "-1", "0.1", "1%"]   # cut every silence longer than 0.1 s
SINK = "deskeye_capture"
LOCALES = ["en_US.UTF-8", "zh_CN.UTF-8"]
ENGINES = ["speech-dispatcher", "espeak-ng"]
TEXTS = {ENGLISH: "The dialog says the file could not be saved because the disk is full.",
         MANDARIN: "窗口里有一个保存失败的对话框，文件没有保存。"}
LONG_TEXT = " ".join(["The report lists twelve open items, each with an owner and a due date."] * 10)
SECOND_TEXT = "The file was saved."
SPEAK_TIMEOUT_S = 60.0                         # a loaded machine; speech-dispatcher may be starting
QUIET_S = 2.0                                  # no new speech for this long: the speaking is over
#: the test's own tools, found once: some tests run DeskEye on a PATH without speech programs
TOOL = {name: shutil.which(name) or name for name in ("parec", "pactl", "pulseaudio", "sox", "espeak-ng")}


# ------------------------------------------------------------------ the sound card and what it heard

def sox_stat(path: Path, *effects: str, raw: bool = True) -> dict[str, float]:
    """`sox FILE -n [effects] stat`: its figures by name ("Length (seconds)", "RMS     amplitude", ...)."""
    done = subprocess.run([TOOL["sox"], *(SOX_RAW if raw else []), str(path), "-n", *effects, "stat"],
                          capture_output=True, text=True, timeout=60)
    figures = {}
    for line in done.stderr.splitlines():
        name, _, value = line.partition(":")
        with contextlib.suppress(ValueError):
            figures[name.strip()] = float(value)
    assert "Length (seconds)" in figures, done.stderr
    return figures


class Recording:
    """Everything the null sink plays while it is open, as raw audio in `path`."""

    def __init__(self, path: Path):
        self.path = path
        with path.open("wb") as out:
            self._proc = subprocess.Popen([TOOL["parec"], "-d", f"{SINK}.monitor", "--raw", f"--rate={RATE}",
                                           "--channels=1", "--format=s16le"], stdout=out, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: path.stat().st_size > 0, 10), "parec records nothing"

    def speech_s(self) -> float:
        """Seconds of sound in the recording so far, silences cut out."""
        return sox_stat(self.path, *SPEECH_ONLY)["Length (seconds)"]

    def rms(self) -> float:
        return sox_stat(self.path, *SPEECH_ONLY)["RMS     amplitude"]

    def wait_for_speech(self, min_s: float, timeout_s: float = SPEAK_TIMEOUT_S) -> float:
        return wait_until(lambda: (s := self.speech_s()) >= min_s and s, timeout_s, interval_s=0.2) or 0.0

    def wait_until_quiet(self, timeout_s: float = SPEAK_TIMEOUT_S * 2) -> float:
        """The seconds of speech once nothing new was heard for QUIET_S."""
        deadline, last, since = time.monotonic() + timeout_s, -1.0, time.monotonic()
        while time.monotonic() < deadline:
            now = self.speech_s()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= QUIET_S:
                return now
            time.sleep(0.25)
        raise AssertionError(f"still speaking after {timeout_s} s ({last:.1f} s of speech)")

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)


class Sound:
    """A private PulseAudio server (null sink) this process's programs play to; speech-dispatcher runs in
    `runtime` (a private XDG_RUNTIME_DIR) when spd-say starts it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.runtime = folder / "run"
        self.runtime.mkdir(mode=0o700)
        self._count = 0

    @contextlib.contextmanager
    def recording(self):
        self._count += 1
        recording = Recording(self.folder / f"recording-{self._count}.raw")
        try:
            yield recording
        finally:
            recording.close()

    @functools.cache
    def reference_s(self, text: str, voice: str) -> float:
        """Seconds of speech in `text` rendered by espeak-ng with `voice`, to a file."""
        wav = self.folder / f"reference-{voice}-{abs(hash(text))}.wav"
        subprocess.run([TOOL["espeak-ng"], "-v", voice, "-w", str(wav), text], check=True, timeout=120,
                       capture_output=True)
        return sox_stat(wav, *SPEECH_ONLY, raw=False)["Length (seconds)"]

    def speech_dispatchers(self) -> list[psutil.Process]:
        """The speech-dispatcher servers (and their modules) spd-say started for these tests."""
        found = []
        for proc in psutil.process_iter(["cmdline", "environ"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if "speech-dispatcher" in " ".join(proc.info["cmdline"]) and \
                        (proc.info["environ"] or {}).get("XDG_RUNTIME_DIR") == str(self.runtime):
                    found.append(proc)
        return found


@pytest.fixture(scope="module")
def sound(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sound")
    sound = Sound(folder)
    socket = folder / "pulse.sock"
    home = folder / "home"
    home.mkdir()
    log = folder / "pulseaudio.log"
    with log.open("wb") as log_file:
        pulse = subprocess.Popen([TOOL["pulseaudio"], "-n", "--daemonize=no", "--exit-idle-time=-1",
                                  "--use-pid-file=no", "--disable-shm=yes",
                                  "-L", f"module-null-sink sink_name={SINK} rate={RATE} channels=1",
                                  "-L", f"module-native-protocol-unix socket={socket} auth-anonymous=1"],
                                 env={**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(sound.runtime)},
                                 stdout=subprocess.DEVNULL, stderr=log_file)
    saved = {key: os.environ.get(key) for key in ("PULSE_SERVER", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME")}
    os.environ.update(PULSE_SERVER=f"unix:{socket}", XDG_RUNTIME_DIR=str(sound.runtime),
                      XDG_CONFIG_HOME=str(folder / "config"))     # speech-dispatcher: the system's settings
    try:
        assert wait_until(lambda: subprocess.run([TOOL["pactl"], "info"], capture_output=True).returncode == 0, 30), \
            f"PulseAudio did not start: {log.read_text(errors='replace')[-2000:]}"
        yield sound
    finally:
        for proc in sound.speech_dispatchers():
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        pulse.terminate()
        pulse.wait(10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch, tmp_path) -> str:
    """The engine DeskEye should speak with: espeak-ng runs on a PATH without spd-say (speech-dispatcher absent)."""
    if request.param == "espeak-ng":
        monkeypatch.setenv("PATH", str(path_with(tmp_path / "bin", "espeak-ng")))
    return request.param


def speech_processes() -> list[str]:
    """spd-say and espeak-ng processes this test process started and that are still running."""
    names = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.name() in ("spd-say", "espeak-ng") and proc.status() != psutil.STATUS_ZOMBIE:
                names.append(proc.name())
    return names


def path_with(folder: Path, *programs: str) -> Path:
    folder.mkdir()
    for program in programs:
        (folder / program).symlink_to(TOOL[program])
    return folder


def speaker(**settings) -> tuple[Speaker, list[Utterance]]:
    """A Speaker made from real settings (`overlay.speak = true` unless given), and what it hands to its engine."""
    spoken: list[Utterance] = []
    made = Speaker.for_settings(settings_from_dict({"overlay": {"speak": True, **settings}}),
                                on_spoken=spoken.append)
    return made, spoken


def speak_and_measure(sound: Sound, text: str) -> tuple[float, float, list[Utterance]]:
    """Speak `text` and record it until quiet: (seconds of speech, RMS, utterances)."""
    talker, spoken = speaker()
    with sound.recording() as recording:
        try:
            talker.say(text)
            assert recording.wait_for_speech(0.3), f"nothing was heard; handed on: {spoken}"
            heard = recording.wait_until_quiet()
            return heard, recording.rms(), spoken
        finally:
            talker.stop()


# ------------------------------------------------------------------ tests

@pytest.mark.slow
@pytest.mark.parametrize("locale", LOCALES)
@pytest.mark.parametrize("voice", [ENGLISH, MANDARIN])
def test_an_answer_is_spoken_whole_in_its_own_language_in_either_locale(sound, engine, voice, locale, monkeypatch):
    monkeypatch.setenv("LANG", locale)
    monkeypatch.setenv("LC_ALL", locale)
    text = TEXTS[voice]
    heard, rms, spoken = speak_and_measure(sound, text)
    assert spoken == [Utterance(text, voice, engine)]
    expected = sound.reference_s(text, voice)
    assert 0.6 * expected < heard < 1.5 * expected, (heard, expected)      # all of it, once
    assert rms > 0.01
    if voice == MANDARIN:                  # the Mandarin voice, not an English one spelling the characters out
        assert heard < 0.8 * sound.reference_s(text, ENGLISH), (heard, sound.reference_s(text, ENGLISH))


@pytest.mark.slow
@pytest.mark.parametrize(("locale", "voice"), [("en_US.UTF-8", ENGLISH), ("zh_CN.UTF-8", MANDARIN)])
def test_an_answer_without_letters_is_spoken_in_the_interface_language(sound, locale, voice, monkeypatch):
    monkeypatch.setenv("LANG", locale)
    monkeypatch.setenv("LC_ALL", locale)
    heard, rms, spoken = speak_and_measure(sound, "12:30")
    assert [u.voice for u in spoken] == [voice] and heard > 0.3 and rms > 0.01


@pytest.mark.slow
def test_a_new_answer_interrupts_the_one_being_spoken(sound, engine):
    talker, spoken = speaker()
    with sound.recording() as recording:
        try:
            talker.say(LONG_TEXT)
            assert recording.wait_for_speech(1.0), f"the first answer was not heard; handed on: {spoken}"
            talker.say(SECOND_TEXT)
            heard = recording.wait_until_quiet()
        finally:
            talker.stop()
    assert [u.text for u in spoken] == [LONG_TEXT, SECOND_TEXT] and {u.engine for u in spoken} == {engine}
    whole_first = sound.reference_s(LONG_TEXT, ENGLISH)          # about 40 s
    assert heard < 0.5 * whole_first, (heard, whole_first)       # the first stopped early...
    assert heard > 1.0 + 0.5 * sound.reference_s(SECOND_TEXT, ENGLISH), heard   # ...and the second was spoken


@pytest.mark.slow
def test_quit_silences_the_answer_being_spoken_and_leaves_no_process(sound):
    talker, spoken = speaker()
    with sound.recording() as recording:
        talker.say(LONG_TEXT)
        assert recording.wait_for_speech(1.0), f"the answer was not heard; handed on: {spoken}"
        talker.stop()
        heard = recording.wait_until_quiet()
        talker.say(SECOND_TEXT)                                   # after quit: nothing more is said
        time.sleep(QUIET_S)
        assert recording.speech_s() == pytest.approx(heard, abs=0.05)
    assert heard < 0.5 * sound.reference_s(LONG_TEXT, ENGLISH), heard
    assert [u.text for u in spoken] == [LONG_TEXT]
    assert not [t for t in threading.enumerate() if t.name == "deskeye-speech"]
    assert speech_processes() == []


@pytest.mark.slow
def test_speak_false_by_default_speaks_nothing_and_starts_nothing(sound):
    talker = Speaker.for_settings(settings_from_dict({}))
    assert talker.enabled is False
    with sound.recording() as recording:
        talker.say(TEXTS[ENGLISH])
        time.sleep(QUIET_S * 2)
        assert recording.speech_s() == 0.0
    assert not [t for t in threading.enumerate() if t.name == "deskeye-speech"]
    assert speech_processes() == []


@pytest.mark.slow
def test_no_speech_engine_is_said_once_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(path_with(tmp_path / "bin")))          # neither spd-say nor espeak-ng
    notices: list[str] = []
    talker, spoken = speaker()
    talker.on_unavailable = notices.append
    try:
        talker.say("first answer")
        assert wait_until(lambda: notices, 10)
        talker.say("second answer")
        time.sleep(1.0)
    finally:
        talker.stop()
    assert len(notices) == 1 and spoken == []
    assert re.search(r"speech-dispatcher.*espeak-ng.*apt install speech-dispatcher", notices[0]), notices


def test_overlay_speak_is_a_checked_setting():
    assert settings_from_dict({}).overlay.speak is False
    assert settings_from_dict({"overlay": {"speak": True}}).overlay.speak is True
    with pytest.raises(SettingsError, match=r"overlay\.speak must be bool.*'yes'"):
        settings_from_dict({"overlay": {"speak": "yes"}})


@pytest.mark.slow
def test_the_app_reads_the_answer_on_its_overlay_aloud_and_stops_at_quit(sound, xdisplay, tmp_path):
    """The real app under Xvfb with the OCR engine: a describe's answer is shown and spoken; quit ends the speech."""
    from deskeye.compose import build_app
    from tests.fixtures.desktop import use_private_xdg_home
    from tests.fixtures.tk_windows import open_test_window

    window = open_test_window(xdisplay, "Notes - editor", "800x600+560+240",
                              lines=["Quarterly report draft", "Revenue grew by twelve percent",
                                     "Costs are under review", "Meeting with finance on Friday"])
    restore_xdg = use_private_xdg_home(tmp_path / "home")
    settings = settings_from_dict({"capture": {"region": "560,240,800,600", "interval_s": 86_400.0},
                                   "overlay": {"speak": True, "fade_after_s": 0.0},
                                   "worker": {"engine": "ocr", "startup_timeout_s": 150.0}},
                                  config_dir=tmp_path / "config")
    app = build_app(settings, use_tray=False, use_hotkeys=False, temp_root=tmp_path)
    spoken: list[Utterance] = []
    app.speaker.on_spoken = spoken.append
    try:
        with sound.recording() as recording:
            app.start()
            app.describe_now()
            shown = app.overlay.wait_for(lambda content: content is not None and content.kind == "answer", 240)
            assert shown is not None and "Revenue" in shown.summary, shown
            assert wait_until(lambda: spoken, 30), "the answer was not handed to a speech engine"
            assert spoken[-1].text == spoken_text(shown.summary) and spoken[-1].voice == ENGLISH
            assert recording.wait_for_speech(1.0), "the answer was not heard"
            app.quit()
            assert app.wait(60), "the app did not stop"
            heard = recording.wait_until_quiet()
        assert heard < 0.6 * sound.reference_s(spoken_text(shown.summary), ENGLISH), heard    # cut short by quit
        assert not [t for t in threading.enumerate() if t.name == "deskeye-speech"]
    finally:
        app.quit()
        app.wait(60)
        restore_xdg()
        window.close()
