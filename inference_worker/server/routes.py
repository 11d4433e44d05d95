"""What each endpoint answers; the HTTP gates live in app.py.

POST /v1/chat/completions  OpenAI chat completions (text + base64 data-URL images, json_schema output); with
                           "stream": true, Server-Sent Events in OpenAI's chunk format (streaming.py)
GET  /v1/models            the served model
GET  /health               503 {"status": "loading"} until the engine is ready, then 200 {"status": "ready"};
                           with the key also the progress, or the engine and model (no key: nothing more, so
                           a stranger on the machine learns no model path)
GET  /metrics              Prometheus text
GET  /openapi.json         the OpenAPI description of all of these

A request whose client disconnects, or that waits longer than --request-timeout-s, is cancelled in the service
(its row stops decoding and is never retried). Parsing, schema checks and image decoding run off the event
loop, so /health answers while a large body is being read.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from inference_worker.config import WorkerConfig
from inference_worker.engines.base import Engine
from inference_worker.errors import CancelledError, ProtocolError, ServiceError
from inference_worker.metrics import METRICS_CONTENT_TYPE, WorkerMetrics
from inference_worker.protocol import (ChatCompletion, ChatCompletionRequest, ChatRequest, Completion, ErrorBody,
                                       Health, ModelCard, ModelList, RequestLimits, completion_body, parse_chat_json)
from inference_worker.schemas import check_schema
from inference_worker.server.streaming import stream_answer
from inference_worker.serving.service import Job, ModelService, timeout_error

MODEL_ALIAS = "deskeye"
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description} for status, description in (
        (400, "the request is not valid; the message names the field"), (401, "no or a wrong bearer key"),
        (404, "unknown model or route"), (408, "the body did not arrive in time"), (411, "no Content-Length"),
        (413, "body, image or image count over a limit"), (415, "unsupported image type"),
        (421, "Host header does not name this worker"), (502, "the answer did not match the schema"),
        (503, "loading, or busy: retry after Retry-After seconds"), (504, "no answer in time"))}

BODY_KEY = "deskeye.body"          # scope key: the request body the gates (app.py) read, for the routes
AUTHORIZED_KEY = "deskeye.authorized"   # scope key: the gates found the bearer key (the ungated /health asks)


class Routes:
    def __init__(self, config: WorkerConfig, service: ModelService, metrics: WorkerMetrics):
        self.config = config
        self.service = service
        self.metrics = metrics
        self.limits = RequestLimits(max_tokens=config.max_tokens_limit, max_images=config.max_images)
        self.created_s = int(time.time())

    def health(self, authorized: bool) -> tuple[int, dict[str, Any]]:
        """Ready or not; the details (which name the model, often a local path) only with the key."""
        service = self.service
        if service.state == "ready" and service.engine is not None:
            status, details = 200, {"engine": service.engine.kind, "model": service.engine.model_name}
        elif service.state == "failed":
            status, details = 503, {"error": service.load_error}
        else:
            status, details = 503, {"progress": service.progress}
        body = Health(status=service.state, **(details if authorized else {}))
        return status, body.model_dump(mode="json")

    def models(self) -> tuple[int, dict[str, Any]]:
        card = ModelCard(id=self.ready_engine().model_name, object="model", created=self.created_s,
                         owned_by="deskeye")
        return 200, ModelList(object="list", data=[card]).model_dump(mode="json")

    def metrics_text(self) -> tuple[int, str]:
        return 200, self.metrics.render()

    def parse(self, raw: bytes) -> ChatRequest:
        """The body -> a request this worker can serve, or ProtocolError (runs on a pool thread)."""
        request = parse_chat_json(raw, self.limits)
        engine = self.ready_engine()
        self._check_model(request.model, engine)
        if request.json_schema is not None:
            check_schema(request.json_schema)
        return request

    async def complete(self, request: ChatRequest, http: Request) -> dict[str, Any]:
        job = self.service.submit_job(request)
        completion = await wait_for_answer(self.service, job, http, self.config.request_timeout_s)
        return self.completion_body(completion)

    def completion_body(self, completion: Completion) -> dict[str, Any]:
        return completion_body(completion, request_id=f"chatcmpl-{uuid.uuid4().hex}",
                               model=self.ready_engine().model_name, created=int(time.time()))

    def ready_engine(self) -> Engine:
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


async def wait_for_answer(service: ModelService, job: Job, http: Request, timeout_s: float) -> Completion:
    """The job's completion; cancels the job when the client disconnects or `timeout_s` passes first."""
    answer = asyncio.wrap_future(job.future)
    gone = asyncio.ensure_future(wait_for_disconnect(http))
    try:
        done, _ = await asyncio.wait({answer, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if answer in done:
        if answer.cancelled():
            raise CancelledError("the worker cancelled it")
        return answer.result()
    service.cancel(job, "the client disconnected" if gone in done else f"no answer within {timeout_s:g} s")
    answer.cancel()
    if gone in done:
        raise CancelledError("the client disconnected")
    raise timeout_error(timeout_s)


async def wait_for_disconnect(http: Request) -> None:
    """Returns when the client closes the connection (the body was already read by the gates)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def register_routes(app: FastAPI, routes: Routes) -> None:
    @app.get("/health", response_model=Health, responses={503: {"model": Health}}, summary="Readiness probe")
    async def health(http: Request) -> Response:          # never blocks: no hop to a pool thread per probe
        status, body = routes.health(bool(http.scope.get(AUTHORIZED_KEY)))
        return JSONResponse(body, status_code=status, headers={"Cache-Control": "no-store"})

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, summary="The served model")
    def models() -> Response:
        status, body = routes.models()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=Response, responses=ERROR_RESPONSES, summary="Prometheus metrics")
    def metrics() -> Response:
        status, text = routes.metrics_text()
        return Response(text, status_code=status, media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={
        **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}, "description": "The answer (JSON), or "
                                 "with stream=true Server-Sent Events of chat.completion.chunk objects"}},
        summary="Chat completions (OpenAI-compatible)")
    async def chat_completions(http: Request) -> Response:
        request = await run_in_threadpool(routes.parse, http.scope.get(BODY_KEY, b""))
        if request.stream:
            return await stream_answer(routes.service, routes.metrics, request,
                                       model=routes.ready_engine().model_name,
                                       timeout_s=routes.config.request_timeout_s)
        return JSONResponse(await routes.complete(request, http), headers={"Cache-Control": "no-store"})

    app.openapi = lambda: openapi_with_request_body(app, "/v1/chat/completions", ChatCompletionRequest)


def openapi_with_request_body(app: FastAPI, path: str, model: type) -> dict[str, Any]:
    """FastAPI's OpenAPI document, with `model` as the JSON body of POST `path` (the gates read the body, so
    FastAPI does not see a body parameter to describe)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    reference = {"$ref": f"#/components/schemas/{model.__name__}"}
    document["paths"][path]["post"]["requestBody"] = {"required": True,
                                                      "content": {"application/json": {"schema": reference}}}
    document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    document["security"] = [{"bearer": []}]
    document["paths"]["/health"]["get"]["security"] = []
    app.openapi_schema = document
    return document
