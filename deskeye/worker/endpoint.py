"""Where the app sends its requests, and what the server there accepts.

`Endpoint` is a worker's URL, key and model, and its `WorkerLimits`: the largest image, request, answer and body it
accepts. DeskEye's own worker publishes them in its state file (beside its URL and per-launch key, written once it
listens); the app reads them from there, so what it sends (an image file scaled down, a deep answer's room) follows
the worker it started instead of a copy of its defaults. A server that publishes none (an external one, an older
worker) is taken to accept the worker's defaults, `FALLBACK_LIMITS`, defined here once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class WorkerLimits:
    """What one request to the server may hold (the worker's `--max-*` options)."""
    max_image_pixels: int            # one image
    max_request_pixels: int          # all of a request's images together
    max_images: int                  # images in one request
    max_tokens_limit: int            # the most `max_tokens` a request may ask for
    max_prompt_tokens: int           # the longest prompt, in tokens; 0 = the model's context
    max_body_bytes: int              # the request body (a base64 PNG is a third larger than the file)

    @property
    def max_pixels_per_frame(self) -> int:
        """The largest single image a one-image request may carry."""
        return min(self.max_image_pixels, self.max_request_pixels)

    @classmethod
    def from_state(cls, published: object) -> WorkerLimits:
        """The state file's "limits": each key that is a whole number >= 0 replaces the fallback, any other is
        ignored (and logged): a worker that publishes fewer keys, or none, still gets a complete set."""
        if published is None:
            return FALLBACK_LIMITS
        if not isinstance(published, dict):
            log.warning("the worker's state file has limits that are not an object (%r); using the defaults",
                        published)
            return FALLBACK_LIMITS
        read = {}
        for field in dataclasses.fields(cls):
            value = published.get(field.name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                read[field.name] = value
            elif value is not None:
                log.warning("the worker's state file has limits.%s = %r, not a whole number >= 0; using %d",
                            field.name, value, getattr(FALLBACK_LIMITS, field.name))
        return dataclasses.replace(FALLBACK_LIMITS, **read)


# The worker's own defaults (inference_worker/config.py; tests/test_worker_limits.py checks they agree): what a
# server that publishes no limits is taken to accept.
FALLBACK_LIMITS = WorkerLimits(max_image_pixels=7680 * 4320, max_request_pixels=7680 * 4320, max_images=4,
                               max_tokens_limit=1024, max_prompt_tokens=0, max_body_bytes=32 * 1024 * 1024)


@dataclass(frozen=True)
class Endpoint:
    """Where to send requests. `generation` changes with every (re)launch, so a stale endpoint is detectable."""
    url: str                     # base URL without /v1, e.g. http://127.0.0.1:41234
    api_key: str
    model: str = ""              # the model id the worker serves ("" = ask GET /v1/models)
    generation: int = 0
    engine: str = ""             # our worker's engine kind ("ocr", "transformers"); "" for external servers
    limits: WorkerLimits = FALLBACK_LIMITS


def external_base_url(url: str) -> str:
    """`http://host:8000/v1/` -> `http://host:8000`: users paste either form."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def read_endpoint(state_file: Path, generation: int) -> Endpoint | None:
    """The endpoint a worker's state file names, once GET /health there answers 200; None before (the file not
    written yet, or the worker still loading)."""
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        url, api_key = str(state["url"]).rstrip("/"), str(state["api_key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None                          # not written yet
    health = ready_health(url, api_key)
    if health is None:
        return None
    model = str(health.get("model") or state.get("model") or "")
    engine = str(health.get("engine") or state.get("engine") or "")
    return Endpoint(url, api_key, model, generation, engine, WorkerLimits.from_state(state.get("limits")))


def ready_health(url: str, api_key: str) -> dict | None:
    """GET /health: its JSON body when it answers 200 (ready), None otherwise (loading, not listening)."""
    request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=HEALTH_TIMEOUT_S) as response:
            if response.status != 200:
                return None
            body = json.loads(response.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None                          # 503 while loading, or not listening yet
    return body if isinstance(body, dict) else {}


def answers_health(url: str, timeout_s: float) -> bool:
    """Any HTTP answer to GET /health within `timeout_s` (503 while busy loading still answers): the worker is alive."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/health"), timeout=timeout_s) as response:
            response.read()
        return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False
