"""Ask the worker (ours or any OpenAI-compatible server) one question about one frame.

The request goes through the official `openai` client: the messages come from
`deskeye.prompt.build_messages`, the output is constrained with `deskeye_response_format()`
and read back with `parse_description`, so the wire format lives in one place. A cut-off answer is asked again
with more room, and a server that ignores `response_format` gets the JSON asked for in the prompt instead
(`deskeye/worker/output_mode.py`; `Answer.output_mode` says which). If the connection drops
because our worker died, the client waits for the supervisor's restart and sends the same request once
more, so no hotkey press is silently lost.

With `on_text`, the answer is streamed (`stream=True`, Server-Sent Events): `on_text` is called with the
summary decoded so far each time it grows (DeskEye's schema puts the summary first), so the overlay can show the
answer as it is generated; the full answer is parsed and returned at the end as without streaming.

What is sent is bounded (deskeye/prompt.py): a question longer than MAX_QUESTION_CHARS is cut (its start and its
end are sent) and `Answer.notes` tells the user so; the conversation memory sent is the newest turns that fit in
MAX_MEMORY_CHARS. A model reads a bounded prompt, and a long one holds the model thread for its whole prefill.

The answer is untrusted model text: it is returned as data and never put into a shell, URL or path.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from deskeye.worker import output_mode
from deskeye.errors import AnswerError, WorkerUnavailable
from deskeye.settings import Settings
from deskeye.worker.endpoint import Endpoint, WorkerLimits
from deskeye.worker.supervisor import WorkerSupervisor
from deskeye.language import answer_language, ui_language
from deskeye.prompt import Turn, bound_memory, bound_question, build_messages, parse_description
from deskeye.see.window_facts import WindowFact, deskeye_extension

_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: the opening of a DeskEye answer up to its summary string, and that string's characters so far (linear: the
#: two alternatives never match the same text)
_SUMMARY_OPENING = re.compile(r'\s*\{\s*"summary"\s*:\s*"((?:[^"\\]|\\.)*)')
MAX_ESCAPE_CHARS = 6                 # the longest JSON escape, \uXXXX, that a chunk may cut in two

TextCallback = Callable[[str], None]
log = logging.getLogger(__name__)


@dataclass
class Answer:
    summary: str
    key_objects: list[str]
    engine: str                  # "ocr", "transformers", ... or "external:<model id>"
    latency_ms: int              # wall time of the request, as seen by the app
    output_mode: str = output_mode.JSON_SCHEMA   # how the JSON was obtained: "json_schema" | "prompt_and_parse"
    #: what the user should know about how they were asked (e.g. their question was cut to what DeskEye sends)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The answer's fields; `notes` only when there are some."""
        fields = asdict(self)
        if not self.notes:
            del fields["notes"]
        else:
            fields["notes"] = list(self.notes)
        return fields

    def shown_text(self) -> str:
        """The summary, then each note on a line of its own: what the overlay or a terminal shows."""
        return "\n".join((self.summary, *self.notes))


class WorkerClient:
    def __init__(self, supervisor: WorkerSupervisor, settings: Settings):
        self.supervisor = supervisor
        self.settings = settings
        self._lock = threading.Lock()
        self._client = None                      # openai.OpenAI for `_client_endpoint`
        self._client_endpoint: Endpoint | None = None
        self._model_ids: dict[Endpoint, str] = {}
        self._output_modes: dict[str, str] = {}   # server URL -> output mode learnt from its answers

    def ask(self, question: str, image_png: bytes | None, memory: list[Turn] = (), *,
            max_tokens: int | None = None, context: str | None = None,
            on_text: TextCallback | None = None,
            windows: "list[WindowFact] | tuple[WindowFact, ...]" = ()) -> Answer:
        """One answer. Raises WorkerUnavailable (no worker) or AnswerError (an answer DeskEye cannot use).

        `on_text`: stream the answer and call it with the summary text decoded so far, each time it grows.
        `windows`: the window facts of the frame (deskeye.see.window_facts), sent as the request's "deskeye" field,
        with the language to answer in when the server is DeskEye's own worker (`deskeye_body`)."""
        import openai

        question, note = bound_question(question)
        turns, num_left_out = bound_memory(list(memory))
        if num_left_out:
            log.info("%d earlier turn(s) of the conversation left out of the prompt (longer than DeskEye sends)",
                     num_left_out)
        notes = (note,) if note else ()
        messages = build_messages(question, image_png, turns, context, language=ui_language())
        language = answer_language(question, ui_language())
        max_tokens = max_tokens or self.settings.worker.max_tokens
        endpoint = self.supervisor.endpoint()
        try:
            extra_body = deskeye_body(endpoint, windows, language)
            return self._with_notes(self._ask_once(endpoint, messages, max_tokens, on_text, extra_body), notes)
        except openai.APITimeoutError:
            raise self._timeout_error(endpoint) from None
        except openai.APIConnectionError:
            endpoint = self.supervisor.recover(endpoint)     # raises WorkerUnavailable if it stays down
        try:
            extra_body = deskeye_body(endpoint, windows, language)
            return self._with_notes(self._ask_once(endpoint, messages, max_tokens, on_text, extra_body), notes)
        except openai.APITimeoutError:
            raise self._timeout_error(endpoint) from None
        except openai.APIConnectionError as exc:
            raise WorkerUnavailable(f"Lost the connection to the worker at {endpoint.url} twice ({exc}); "
                                    "it may be crashing. Run `deskeye doctor`.") from None

    def limits(self) -> WorkerLimits:
        """What the worker accepts: the limits it published in its state file, the defaults for a server that
        publishes none. Waits for the worker to serve, as `ask` does (WorkerUnavailable if it does not)."""
        return self.supervisor.endpoint().limits

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client, self._client_endpoint = None, None

    @staticmethod
    def _with_notes(answer: Answer, notes: tuple[str, ...]) -> Answer:
        answer.notes = (*answer.notes, *notes)
        return answer

    # ------------------------------------------------------------------ one request

    def _ask_once(self, endpoint: Endpoint, messages: list[dict], max_tokens: int,
                  on_text: TextCallback | None = None, extra_body: dict | None = None) -> Answer:
        """Ask until the answer is usable: more room for a cut-off answer, prompt-and-parse for a server that
        ignores response_format (see deskeye/worker/output_mode.py); AnswerError when the ladder is exhausted."""
        started = time.perf_counter()
        attempt = output_mode.Attempt(self._output_modes.get(endpoint.url, output_mode.JSON_SCHEMA), max_tokens)
        while True:
            fields = output_mode.request_fields(attempt, messages)
            content, finish_reason, engine = self._request(endpoint, {**fields, "extra_body": extra_body}, on_text)
            outcome = output_mode.judge(attempt, content, finish_reason, max_tokens)
            if outcome.ignored_schema:
                self._note_ignored_schema(endpoint)
            if outcome.description is not None:
                latency_ms = round((time.perf_counter() - started) * 1000)
                return Answer(outcome.description.summary, outcome.description.key_objects, engine, latency_ms,
                              attempt.mode)
            if outcome.next_attempt is None:
                raise AnswerError(self._give_up_message(endpoint, attempt, content, finish_reason))
            log.info("answer from %s unusable (finish_reason %s); asking again: %s", endpoint.url, finish_reason,
                     outcome.next_attempt)
            attempt = outcome.next_attempt

    def _note_ignored_schema(self, endpoint: Endpoint) -> None:
        """Say once per server that it ignores response_format; later questions go straight to prompt-and-parse."""
        if self._output_modes.get(endpoint.url) != output_mode.PROMPT_AND_PARSE:
            log.warning("The server at %s ignores response_format json_schema (its answer is not JSON): DeskEye "
                        "asks for JSON in the prompt and parses the answer instead (output_mode prompt_and_parse). "
                        "A server with structured output (vLLM, SGLang, llama.cpp, Ollama) is more reliable.",
                        endpoint.url)
        self._output_modes[endpoint.url] = output_mode.PROMPT_AND_PARSE

    def _request(self, endpoint: Endpoint, fields: dict, on_text: TextCallback | None) -> tuple[str, str | None, str]:
        """One chat completion (streamed when `on_text`): (content, finish_reason, engine)."""
        import openai

        client = self._openai(endpoint)
        request = dict(model=self._model_id(client, endpoint), temperature=0, **fields)
        try:
            if on_text is not None:
                content, finish_reason, engine = self._stream(endpoint, client, request, on_text)
            else:
                response = client.chat.completions.create(**request)
                content, finish_reason, engine = self._content(endpoint, response)
        except openai.APIStatusError as exc:
            raise self._status_error(endpoint, exc) from None
        return content, finish_reason, engine

    def _stream(self, endpoint: Endpoint, client, request: dict, on_text: TextCallback) -> tuple[str, str | None, str]:
        """Stream the answer, calling `on_text` with the growing summary; (content, finish_reason, engine)."""
        import openai

        stream = client.chat.completions.create(stream=True, **request)
        pieces: list[str] = []
        shown, finish_reason, engine = "", None, ""
        try:
            for chunk in stream:
                engine = engine or self._engine(chunk, default="")
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                finish_reason = choice.finish_reason or finish_reason
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                    summary = partial_summary("".join(pieces))
                    if summary is not None and summary != shown:
                        shown = summary
                        on_text(summary)
        except openai.APIStatusError:
            raise
        except openai.APIError as exc:              # the stream ended with an error event
            raise AnswerError(f"The worker at {endpoint.url} failed while answering: "
                              f"{printable(str(exc.message)[:500])}") from None
        except _transport_errors() as exc:          # the connection broke mid-stream: recover as before it
            raise openai.APIConnectionError(message=f"the stream broke: {exc}",
                                            request=stream.response.request) from None
        finally:
            stream.close()
        return "".join(pieces), finish_reason, engine or f"external:{request['model'] or 'unknown'}"

    def _content(self, endpoint: Endpoint, response) -> tuple[str, str | None, str]:
        if not response.choices:
            raise AnswerError(f"The server at {endpoint.url} returned no answer (empty 'choices').")
        choice = response.choices[0]
        return choice.message.content or "", choice.finish_reason, self._engine(response)

    def _give_up_message(self, endpoint: Endpoint, attempt: output_mode.Attempt, content: str,
                         finish_reason: str | None) -> str:
        if attempt.mode == output_mode.PROMPT_AND_PARSE:
            return (f"The answer from {endpoint.url} is empty: DeskEye asked for JSON in the prompt (the server "
                    "ignores response_format) and got no text back.")
        try:
            parse_description(content)
            problem = ValueError("The model's answer is unusable.")
        except ValueError as exc:
            problem = exc
        return self._unusable_message(endpoint, problem, finish_reason)

    def _engine(self, response, default: str | None = None) -> str:
        extra = (response.model_extra or {}).get("deskeye")
        if isinstance(extra, dict) and isinstance(extra.get("engine"), str):
            return extra["engine"]
        return f"external:{response.model or 'unknown'}" if default is None else default

    # ------------------------------------------------------------------ plumbing

    def _openai(self, endpoint: Endpoint):
        from openai import OpenAI

        with self._lock:
            if self._client_endpoint != endpoint:
                if self._client is not None:
                    self._client.close()
                self._client = OpenAI(base_url=f"{endpoint.url}/v1", api_key=endpoint.api_key or "none",
                                      timeout=self.settings.worker.request_timeout_s, max_retries=0)
                self._client_endpoint = endpoint
            return self._client

    def _model_id(self, client, endpoint: Endpoint) -> str:
        """The model to ask for: the endpoint's (state file / settings), else the server's first listed model."""
        import openai

        if endpoint.model:
            return endpoint.model
        if endpoint not in self._model_ids:
            try:
                models = client.models.list().data
            except openai.AuthenticationError:
                raise WorkerUnavailable(self._auth_message(endpoint)) from None
            except openai.APIStatusError as exc:
                raise WorkerUnavailable(f"The server at {endpoint.url} did not list its models "
                                        f"(HTTP {exc.status_code}); set worker.remote_model.") from None
            if not models:
                raise WorkerUnavailable(f"The server at {endpoint.url} lists no models; load one there, "
                                        "or set worker.remote_model.")
            self._model_ids[endpoint] = models[0].id
        return self._model_ids[endpoint]

    def _status_error(self, endpoint: Endpoint, exc) -> Exception:
        """An HTTP error answer -> WorkerUnavailable (cannot serve now) or AnswerError (this request failed)."""
        status = exc.status_code
        if status in (401, 403):
            return WorkerUnavailable(self._auth_message(endpoint))
        if status == 503:
            return WorkerUnavailable(f"The worker at {endpoint.url} is not ready: {_error_text(exc)}")
        if status in (400, 422):
            return AnswerError(self._rejected_message(endpoint, exc))
        hint = (" Check worker.remote_model (`deskeye doctor` lists the server's models)."
                if status == 404 and self.supervisor.is_external else "")
        return AnswerError(f"The worker at {endpoint.url} failed to answer (HTTP {status}): "
                           f"{_error_text(exc)}{hint}")

    def _timeout_error(self, endpoint: Endpoint) -> WorkerUnavailable:
        return WorkerUnavailable(f"No answer from the worker at {endpoint.url} within "
                                 f"{self.settings.worker.request_timeout_s:.0f} s (worker.request_timeout_s).")

    def _auth_message(self, endpoint: Endpoint) -> str:
        if self.supervisor.is_external:
            return (f"The server at {endpoint.url} rejected the API key. Set worker.api_key, or the "
                    f"environment variable {self.settings.worker.api_key_env}.")
        return f"DeskEye's worker at {endpoint.url} rejected the API key from its own state file; restart DeskEye."

    def _rejected_message(self, endpoint: Endpoint, exc) -> str:
        text = f"The server at {endpoint.url} rejected the request: {_error_text(exc)}"
        if self.supervisor.is_external:
            text += (" DeskEye needs chat completions with images and response_format "
                     "{\"type\": \"json_schema\"}; check that the server and model support both.")
        return text

    def _unusable_message(self, endpoint: Endpoint, exc: ValueError, finish_reason: str | None) -> str:
        text = f"The answer from {endpoint.url} is not a DeskEye description: {exc}"
        if finish_reason == "length":
            text += (" It was cut off at the token limit even after asking again with up to "
                     f"{output_mode.room_cap(self.settings.worker.max_tokens)} tokens (worker.max_tokens).")
        if self.supervisor.is_external:
            text += (" This server may ignore response_format json_schema (structured output); use one that "
                     "supports it (vLLM, llama.cpp server, Ollama, SGLang).")
        return text


def deskeye_body(endpoint: Endpoint, windows: "list[WindowFact] | tuple[WindowFact, ...]",
                 language: str) -> dict | None:
    """The request's extra "deskeye" field. DeskEye's own worker gets the window facts and the language to answer
    in (the OCR engine writes its own words in it); an external server only the window facts, when there are any
    (some, like `transformers serve`, refuse a request with a field they do not know)."""
    if endpoint.engine:
        return {"deskeye": {**deskeye_extension(windows), "language": language}}
    return {"deskeye": deskeye_extension(windows)} if windows else None


def _error_text(exc) -> str:
    """The server's error message, shortened and made printable (shown to the user as data, never run)."""
    body = getattr(exc, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else inner
    return printable(str(message or exc)[:500])


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a broken connection raises while a stream is read: the HTTP library the openai client uses."""
    import importlib

    found: list[type[BaseException]] = [OSError]
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def partial_summary(text: str) -> str | None:
    """The summary string of a DeskEye answer that is still arriving (`{"summary": "A termi`), decoded as far
    as it goes; None when the text does not start with a summary (another field first, or not JSON)."""
    match = _SUMMARY_OPENING.match(text)
    if match is None:
        return None
    body = match.group(1)
    for cut in range(min(len(body), MAX_ESCAPE_CHARS) + 1):   # an escape cut in two by a chunk: drop its start
        try:
            return json.loads(f'"{body[:len(body) - cut]}"')
        except ValueError:
            continue
    return None


def printable(text: str) -> str:
    """Untrusted text for a terminal: control characters (escape sequences) shown as \\x.., never interpreted."""
    return _CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
