"""How the OpenVINO runtime compiles the IR parts: INT8 weights as exported, u8 KV cache, the LATENCY hint, one
inference thread per physical core, and a CACHE_DIR of compiled blobs under the user cache dir (a restart then
loads the blobs instead of compiling). `compile_part` turns every runtime failure into one line; an unusable
CACHE_DIR (not a folder, unwritable, corrupt blobs) costs a warning and a compile without the cache, not the start.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_worker.engines.openvino.ir_folder import EXPORT_HINT, IRFolderError

log = logging.getLogger("inference_worker")

KV_CACHE_PRECISIONS = ("u8", "f16", "f32")
PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")
#: the properties read back from every compiled part (tests and /health-style reports)
REPORTED_PROPERTIES = ("KV_CACHE_PRECISION", "PERFORMANCE_HINT", "INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT",
                       "CACHE_DIR")


def default_cache_dir() -> Path:
    """<user cache dir>/deskeye/openvino (e.g. ~/.cache/deskeye/openvino)."""
    import platformdirs
    return Path(platformdirs.user_cache_dir("deskeye")) / "openvino"


def physical_cores() -> int:
    """Physical CPU cores (hyper-threads share one core's units: more threads than cores slows decoding)."""
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@dataclass(frozen=True)
class RuntimeOptions:
    """The compile settings; `cache_dir` None = default_cache_dir(), `num_threads` 0 = physical_cores()."""
    cache_dir: Path | None = None
    num_threads: int = 0
    kv_cache_precision: str = "u8"
    performance_hint: str = "LATENCY"
    inference_precision: str = ""        # "" = the CPU's default (f32, or bf16 on CPUs with AMX); "f32" for parity
    device: str = "CPU"

    def __post_init__(self):
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = one per physical core); got {self.num_threads}.")
        if self.kv_cache_precision not in KV_CACHE_PRECISIONS:
            raise ValueError(f"kv_cache_precision must be one of {', '.join(KV_CACHE_PRECISIONS)}; "
                             f"got {self.kv_cache_precision!r}.")
        if self.performance_hint not in PERFORMANCE_HINTS:
            raise ValueError(f"performance_hint must be one of {', '.join(PERFORMANCE_HINTS)}; "
                             f"got {self.performance_hint!r}.")
        if self.inference_precision not in ("", "f32", "bf16", "f16"):
            raise ValueError(f"inference_precision must be '', f32, bf16 or f16; got {self.inference_precision!r}.")

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_cache_dir()

    @property
    def resolved_num_threads(self) -> int:
        return self.num_threads or physical_cores()

    def compile_config(self, *, with_cache: bool = True, is_stateful: bool = False) -> dict[str, Any]:
        config: dict[str, Any] = {"PERFORMANCE_HINT": self.performance_hint,
                                  "INFERENCE_NUM_THREADS": self.resolved_num_threads}
        if is_stateful:
            config["KV_CACHE_PRECISION"] = self.kv_cache_precision
        if self.inference_precision:
            config["INFERENCE_PRECISION_HINT"] = self.inference_precision
        if with_cache:
            config["CACHE_DIR"] = str(self.resolved_cache_dir)
        return config


@dataclass
class CompileReport:
    """How long compiling took and whether the blob cache was used (for the benchmark's warm-restart target)."""
    compile_s: float = 0.0
    is_cache_usable: bool = True
    cache_problem: str = ""


def compile_part(core: Any, xml: Path, options: RuntimeOptions, report: CompileReport, *,
                 is_stateful: bool = False) -> Any:
    """Compile one IR part; IRFolderError (one line) when the IR itself is unreadable."""
    started = time.perf_counter()
    try:
        model = core.read_model(str(xml))
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign .xml/.bin: one line
        raise IRFolderError(f"{xml.name} in {xml.parent} cannot be read ({_first_line(exc)}); export the model "
                            f"again with {EXPORT_HINT}.") from None
    compiled = None
    if report.is_cache_usable:
        compiled = _compile_with_cache(core, model, options, report, is_stateful)
    if compiled is None:
        try:
            compiled = core.compile_model(model, options.device,
                                          options.compile_config(with_cache=False, is_stateful=is_stateful))
        except Exception as exc:  # noqa: BLE001
            raise IRFolderError(f"OpenVINO cannot compile {xml.name} for {options.device} "
                                f"({_first_line(exc)}).") from None
    report.compile_s += time.perf_counter() - started
    return compiled


def _compile_with_cache(core: Any, model: Any, options: RuntimeOptions, report: CompileReport,
                        is_stateful: bool) -> Any | None:
    """The part compiled (or loaded) through CACHE_DIR; None, after one warning, when the cache is unusable."""
    cache_dir = options.resolved_cache_dir
    problem = check_cache_dir(cache_dir)
    if not problem:
        try:
            return core.compile_model(model, options.device, options.compile_config(is_stateful=is_stateful))
        except Exception as exc:  # noqa: BLE001 - e.g. a corrupt blob: compile without the cache instead
            problem = f"OpenVINO could not use it ({_first_line(exc)})"
    report.is_cache_usable, report.cache_problem = False, problem
    log.warning("OpenVINO CACHE_DIR %s is unusable: %s; compiling without it (restarts stay slow). Delete that "
                "folder or pass another --cache-dir.", cache_dir, problem)
    return None


def check_cache_dir(cache_dir: Path) -> str:
    """"" when `cache_dir` is (or can be made) a writable folder, else what is wrong with it."""
    if cache_dir.exists() and not cache_dir.is_dir():
        return "it is a file, not a folder"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"it cannot be created ({exc.strerror or exc})"
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        return "it is not writable"
    return ""


def read_properties(compiled: Any) -> dict[str, str]:
    """The REPORTED_PROPERTIES a compiled part reports (as strings), those it does not know left out."""
    properties = {}
    for name in REPORTED_PROPERTIES:
        try:
            properties[name] = str(compiled.get_property(name))
        except Exception:  # noqa: BLE001 - a property this device does not report
            continue
    return properties


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    fallback = lines[0] if lines else ""
    text = next((line for line in lines if not line.startswith(("Exception from", "Check "))), fallback)
    return (text or type(exc).__name__)[:300]
