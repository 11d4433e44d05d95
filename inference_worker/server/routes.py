"""What each endpoint answers, as (status, body) pairs; the HTTP gates live in server.py.

POST /v1/chat/completions  OpenAI chat completions (text + base64 data-URL images, json_schema output)
GET  /v1/models            the served model
GET  /health               503 {"status": "loading", "progress"} until the engine is ready, then 200
GET  /metrics              Prometheus text
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from inference_worker.config import WorkerConfig
from inference_worker.serving.validation import check_schema
from inference_worker.engines.base import Engine
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import ProtocolError, RequestLimits, completion_body, parse_chat_request
from inference_worker.serving.service import ModelService, ServiceError

MODEL_ALIAS = "deskeye"


class Routes:
    def __init__(self, config: WorkerConfig, service: ModelService, metrics: WorkerMetrics):
        self.config = config
        self.service = service
        self.metrics = metrics
        self.limits = RequestLimits(max_tokens=config.max_tokens_limit, max_images=config.max_images)
        self.created_s = int(time.time())

    def health(self) -> tuple[int, dict[str, Any]]:
        service = self.service
        if service.state == "ready" and service.engine is not None:
            return 200, {"status": "ok", "engine": service.engine.kind, "model": service.engine.model_name}
        if service.state == "failed":
            return 503, {"status": "failed", "error": service.load_error}
        return 503, {"status": service.state, "progress": service.progress}

    def models(self) -> tuple[int, dict[str, Any]]:
        engine = self._ready_engine()
        return 200, {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": self.created_s, "owned_by": "deskeye",
        }]}

    def metrics_text(self) -> tuple[int, str]:
        return 200, self.metrics.render()

    def chat_completions(self, body: Any) -> tuple[int, dict[str, Any]]:
        _reject_unsupported(body)
        request = parse_chat_request(body, self.limits)
        engine = self._ready_engine()
        self._check_model(request.model, engine)
        if request.json_schema is not None:
            check_schema(request.json_schema)
        completion = self.service.answer(request, self.config.request_timeout_s)
        return 200, completion_body(completion, request_id=f"chatcmpl-{uuid.uuid4().hex}",
                                    model=engine.model_name, created=int(time.time()))

    def _ready_engine(self) -> Engine:
        engine = self.service.engine
        if self.service.state != "ready" or engine is None:
            raise ServiceError(f"The model is not ready ({self.service.state}: {self.service.progress}); "
                               "poll GET /health until it answers 200.", status=503, code="model_not_ready")
        return engine

    def _check_model(self, name: str, engine: Engine) -> None:
        if name in ("", MODEL_ALIAS, engine.model_name, self.config.model):
            return
        raise ProtocolError(f"Unknown model {name!r}; this worker serves {engine.model_name!r} "
                            f"(or use {MODEL_ALIAS!r}).", status=404, param="model", code="model_not_found")


def _reject_unsupported(body: Any) -> None:
    if not isinstance(body, dict):
        return   # parse_chat_request names this error
    if body.get("stream"):
        raise ProtocolError("'stream': true is not supported by this worker; send 'stream': false.",
                            param="stream")
    if body.get("n", 1) != 1:
        raise ProtocolError("'n' must be 1: this worker returns one choice per request.", param="n")
