"""`deskeye doctor`: one line per part DeskEye needs — display, capture, GPU, model, worker — each OK or FAIL
with how to fix it. Exit code 1 if anything failed. Cheap checks only: no model is loaded here (the worker
check starts the worker, which loads it, exactly as the app would).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from deskeye.errors import DeskEyeError
from deskeye.language import _
from deskeye.settings import Settings, worker_api_key

NO_GPU = "no GPU: the OCR engine or a small model on CPU will be used"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass(frozen=True)
class Check:
    name: str
    is_ok: bool
    detail: str
    is_warning: bool = False     # works, but the user must know (e.g. privacy exclusions that cannot be enforced)

    def line(self) -> str:
        return f"{'FAIL' if not self.is_ok else 'WARN' if self.is_warning else 'OK  '}  {self.name:<8} {self.detail}"


def cmd_doctor(args, settings: Settings) -> int:
    results = run_checks(settings)
    for result in results:
        print(result.line(), flush=True)
    return 0 if all(r.is_ok for r in results) else 1


def run_checks(settings: Settings) -> list[Check]:
    checks: list[tuple[str, Callable[[Settings], Check]]] = [
        ("display", check_display), ("capture", check_capture), ("hotkeys", check_hotkeys), ("gpu", check_gpu),
        ("model", check_model), ("worker", check_worker),
    ]
    if settings.worker.url:                      # an external server: does it honour DeskEye's schema?
        checks.append(("output", check_output_mode))
    if _is_wayland():                            # which window list privacy reads there (X11: the X server's)
        checks.insert(2, ("privacy", check_window_list))
    results = []
    for name, check in checks:
        try:
            results.append(check(settings))
        except Exception as exc:                 # a doctor reports; it does not crash
            results.append(Check(name, False, f"check failed unexpectedly: {type(exc).__name__}: {exc}"))
    return results


# ------------------------------------------------------------------ display and capture

def check_display(settings: Settings) -> Check:
    """The session and its X display (DeskEye's windows are X11 ones, through Xwayland on Wayland); whether DeskEye
    can see the screen there is the capture line's."""
    from deskeye.see.session import NO_DISPLAY, Session, SessionType

    session = Session.detect()
    if session.kind == SessionType.NATIVE:
        return Check("display", True, f"{sys.platform}: the desktop is always there")
    if not session.display:
        return Check("display", False, _(NO_DISPLAY))
    if not x_display_reachable(session.display):
        return Check("display", False, f"cannot open the X display {session.display!r}: is the X server running, "
                                       "and may this user connect to it (xhost / XAUTHORITY)?")
    return Check("display", True, f"X display {session.display} reachable; {session.describe()}")


def x_display_reachable(display: str) -> bool:
    """XOpenDisplay through libX11 (what mss uses): cheap, no subprocess."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("X11")
    if not name:
        return False
    xlib = ctypes.cdll.LoadLibrary(name)
    xlib.XOpenDisplay.restype = ctypes.c_void_p
    xlib.XOpenDisplay.argtypes = [ctypes.c_char_p]
    xlib.XCloseDisplay.argtypes = [ctypes.c_void_p]
    handle = xlib.XOpenDisplay(display.encode())
    if not handle:
        return False
    xlib.XCloseDisplay(handle)
    return True


def check_capture(settings: Settings) -> Check:
    """One grab of the watched region, as the app makes it: the session's backend, and the pixels checked (an empty
    or wrongly black grab fails with its cause and fix: deskeye/see/capture.py `check_pixels`)."""
    from deskeye.see.capture import ScreenGrabber, is_black

    grabber = ScreenGrabber.for_settings(settings)
    try:
        started = time.perf_counter()
        frame = grabber.grab()
        elapsed_ms = (time.perf_counter() - started) * 1000
        backend = grabber.backend().name
    except DeskEyeError as exc:
        return Check("capture", False, str(exc))
    finally:
        grabber.close_thread()
    rect = frame.rect
    pixels = ("black, with no window there: the desktop's own background" if is_black(frame.image)
              else "pixels checked: not black")
    return Check("capture", True, f"grabbed {rect.width}x{rect.height} at {rect.left},{rect.top} of monitor "
                                  f"{settings.capture.monitor} in {elapsed_ms:.0f} ms with {backend} ({pixels})")


def _is_wayland() -> bool:
    from deskeye.see.session import Session, SessionType
    return Session.detect().kind == SessionType.WAYLAND


def check_window_list(settings: Settings) -> Check:
    """Which window list privacy reads in this session (deskeye/see/window_list.py), and whether it answers; a WARN
    naming the excluded titles that cannot be enforced where the desktop tells no one."""
    from deskeye.see.window_list import SessionWindows

    windows = SessionWindows()
    try:
        notice = windows.titles_unknown_notice(settings.excluded_titles)
        if notice:
            return Check("privacy", True, notice, is_warning=True)
        found = windows.read().windows
        return Check("privacy", True, f"{windows.describe()} ({len(found)} on screen now)")
    except DeskEyeError as exc:
        return Check("privacy", False, str(exc))
    finally:
        windows.close_thread()


def check_hotkeys(settings: Settings) -> Check:
    """How the user's keys reach DeskEye in this session, as the app says it at start (deskeye/ui/hotkey_route.py):
    never a failure, since `deskeye trigger` works everywhere; on Wayland it says how to bind it."""
    from deskeye.see.session import Session, SessionType
    from deskeye.ui.hotkey_route import hotkey_route
    from deskeye.hotkey_syntax import display_name
    from deskeye.ui.portal_shortcuts import portal_offers_shortcuts
    session = Session.detect()
    bound = None
    if session.kind == SessionType.WAYLAND and portal_offers_shortcuts(session.environ):
        bound = {name: display_name(getattr(settings.hotkeys, name)) for name in ("describe", "ask", "pause")}
    return Check("hotkeys", True, hotkey_route(settings.hotkeys, session=session, portal_bound=bound).message)


# ------------------------------------------------------------------ GPU and model

def check_gpu(settings: Settings) -> Check:
    gpus = nvml_gpus() or nvidia_smi_gpus()
    if gpus:
        return Check("gpu", True, "; ".join(gpus))
    if settings.worker.device == "cuda":
        return Check("gpu", False, "worker.device is \"cuda\" but no NVIDIA GPU was found (no nvidia-ml-py, "
                                   "no nvidia-smi). Install the NVIDIA driver, or set worker.device = \"auto\".")
    return Check("gpu", True, NO_GPU)


def nvml_gpus() -> list[str]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:                            # not installed, or no driver (NVMLError_LibraryNotFound)
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            total_gib = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
            gpus.append(f"GPU {index}: {name}, {total_gib:.0f} GiB")
        return gpus
    finally:
        pynvml.nvmlShutdown()


def nvidia_smi_gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [f"GPU {i}: {line.strip()}" for i, line in enumerate(out.splitlines()) if line.strip()]


def check_model(settings: Settings) -> Check:
    worker = settings.worker
    if worker.url:
        return Check("model", True, f"served by the external server ({worker.remote_model or 'its first model'})")
    if not worker.model:
        if worker.engine in ("transformers", "openvino"):
            return Check("model", False, f"worker.engine is \"{worker.engine}\" but worker.model is empty: set "
                                         "worker.model to a model folder or Hugging Face id.")
        return Check("model", True, "none configured: using the OCR engine")
    if worker.engine == "ocr":
        return Check("model", True, f"{worker.model} is configured but worker.engine is \"ocr\": not used")
    folder, where = locate_model(worker.model)
    if folder is None:
        return Check("model", False, where)
    if worker.engine == "openvino" or is_openvino_folder(folder):
        return check_openvino_folder(folder, where, worker.engine)
    missing = missing_model_files(folder)
    if missing:
        return Check("model", False, f"{where} is incomplete: {missing}. Download it again "
                                     f"(e.g. `hf download {worker.model}`).")
    return Check("model", True, f"{where}: config, weights and tokenizer present (not loaded)")


#: the parts an OpenVINO IR export of a vision-language model holds (the worker checks them again, and the family,
#: when it loads: inference_worker/engines/openvino/ir_folder.py)
OPENVINO_PARTS = ("openvino_language_model", "openvino_text_embeddings_model", "openvino_vision_embeddings_model")
OPENVINO_EXPORT_HINT = "bash scripts/export_openvino.sh MODEL_DIR_OR_ID OUT_DIR"


def is_openvino_folder(folder: Path) -> bool:
    return (folder / f"{OPENVINO_PARTS[0]}.xml").is_file()


def check_openvino_folder(folder: Path, where: str, engine: str) -> Check:
    """An OpenVINO IR folder: every IR file, config and tokenizer present (a file check: nothing compiled)."""
    names = {p.name for p in folder.iterdir()}
    missing = [name for part in OPENVINO_PARTS for name in (f"{part}.xml", f"{part}.bin") if name not in names]
    if "config.json" not in names:
        missing.append("config.json")
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        missing.append("a tokenizer (tokenizer.json)")
    if missing:
        return Check("model", False, f"{where} is missing {', '.join(missing)}: the export is incomplete; export it "
                                     f"again with {OPENVINO_EXPORT_HINT}.")
    how = "" if engine == "openvino" else " (worker.engine auto: served by OpenVINO on the CPU)"
    return Check("model", True, f"{where}: OpenVINO IR model, every part present (not compiled){how}")


def locate_model(model: str) -> tuple[Path | None, str]:
    """A local folder, or the local Hugging Face cache's snapshot of an id. (folder, description) or (None, why)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            return None, f"worker.model {model} is a file; give the model's folder."
        return path, f"folder {path}"
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        return None, f"worker.model {model}: no such folder (and not a Hugging Face id like org/name)."
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(model, local_files_only=True)
    except ImportError:
        return None, (f"worker.model {model} is not a local folder, and huggingface_hub is not installed to look "
                      "in the Hugging Face cache: pip install 'deskeye[worker]'.")
    except Exception:
        return None, (f"worker.model {model} is not in the local Hugging Face cache. Download it first "
                      f"(`hf download {model}`) or give a local folder.")
    return Path(folder), f"{model} (Hugging Face cache)"


def missing_model_files(folder: Path) -> str:
    """What a loadable checkpoint folder lacks ("" = nothing): config, every weight shard, a tokenizer."""
    names = {p.name for p in folder.iterdir()}
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    for index in [n for n in names if n.endswith(".index.json")]:
        try:
            shards = set(json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            missing.append(f"a readable {index}")
            continue
        missing += sorted(s for s in shards if not (folder / s).is_file())
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        missing.append("weights (*.safetensors)")
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        missing.append("a tokenizer (tokenizer.json)")
    return ", ".join(missing)


# ------------------------------------------------------------------ worker

def check_worker(settings: Settings) -> Check:
    if settings.worker.url:
        return check_external_server(settings)
    from deskeye.worker.supervisor import WorkerSupervisor

    supervisor = WorkerSupervisor(settings)
    started = time.perf_counter()
    try:
        supervisor.start()
        endpoint = supervisor.endpoint(timeout_s=1)
        return Check("worker", True, f"started and healthy in {time.perf_counter() - started:.1f} s "
                                     f"(engine {endpoint.engine or '?'}, model {endpoint.model or '?'})")
    except DeskEyeError as exc:
        return Check("worker", False, str(exc))
    finally:
        supervisor.stop()


def check_external_server(settings: Settings) -> Check:
    import urllib.error
    import urllib.request

    from deskeye.worker.client import printable
    from deskeye.worker.endpoint import external_base_url

    url = external_base_url(settings.worker.url)
    request = urllib.request.Request(f"{url}/v1/models",
                                     headers={"Authorization": f"Bearer {worker_api_key(settings.worker)}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            models = [printable(str(m.get("id", "?")))[:80] for m in json.load(response).get("data", [])
                      if isinstance(m, dict)]
    except urllib.error.HTTPError as exc:
        hint = (f" Set worker.api_key or ${settings.worker.api_key_env}." if exc.code in (401, 403) else "")
        return Check("worker", False, f"the external server at {url} answered HTTP {exc.code} to /v1/models.{hint}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Check("worker", False, f"cannot reach the external server at {url} ({exc}): is it running? "
                                      "(settings: worker.url)")
    if not models:
        return Check("worker", False, f"the external server at {url} lists no models; load one there.")
    wanted = settings.worker.remote_model
    if wanted and wanted not in models:
        return Check("worker", False, f"the external server at {url} does not serve worker.remote_model "
                                      f"{wanted!r}; it serves: {', '.join(models[:8])}.")
    return Check("worker", True, f"external server at {url} serves {', '.join(models[:4])}")


def check_output_mode(settings: Settings) -> Check:
    """One describe of a blank frame: does the external server honour response_format json_schema?"""
    if not check_external_server(settings).is_ok:
        return Check("output", False, "not checked: the external server does not answer (see the worker line)")
    import io

    from PIL import Image

    from deskeye.worker.client import WorkerClient
    from deskeye.worker.output_mode import JSON_SCHEMA
    from deskeye.worker.supervisor import WorkerSupervisor
    from deskeye.prompt import DESCRIBE_QUESTION

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(buffer, format="PNG")
    supervisor = WorkerSupervisor(settings)
    client = WorkerClient(supervisor, settings)
    try:
        supervisor.start()
        answer = client.ask(DESCRIBE_QUESTION, buffer.getvalue())
    except DeskEyeError as exc:
        return Check("output", False, f"a test describe failed: {exc}")
    finally:
        client.close()
        supervisor.stop()
    if answer.output_mode == JSON_SCHEMA:
        return Check("output", True, f"json_schema: the server honours response_format ({answer.latency_ms} ms)")
    return Check("output", True, f"{answer.output_mode}: the server IGNORES response_format, so DeskEye asks for "
                                 "JSON in the prompt and parses it (less reliable); a server with structured "
                                 "output (vLLM, SGLang, llama.cpp, Ollama) avoids this")
