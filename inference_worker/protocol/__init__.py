"""What crosses the process boundary between the DeskEye app and the inference worker.

The wire format is OpenAI chat completions (so any OpenAI-compatible server can stand in for our worker), plus
DeskEye's response schema and the request's "deskeye" extension (window facts). This package is the worker's side
of it, one concept per module:

- `requests`: the request subset the worker accepts, described by pydantic models (`ChatCompletionRequest`, also
  the OpenAPI description at /openapi.json) and turned into the worker's own frozen `ChatRequest`
  (`parse_chat_request`);
- `window_facts`: the request's "deskeye": {"windows": [...]} extension;
- `completion`: what an engine hands back (`Completion` and its typed `CompletionFacts`);
- `responses`: the response bodies, built from pydantic models (one definition for the wire and OpenAPI).

The app builds requests with its own `deskeye/prompt.py` and window reader (tests/test_prompt.py keeps the two
sides agreeing). Pure Python: no torch, no PIL, no I/O. Import names from here: the modules are an inside view.
"""

from inference_worker.errors import ErrorBody, ErrorDetail, ProtocolError
from inference_worker.protocol.completion import (CacheLevel, Completion, CompletionFacts, OcrFacts, OcrGrounding,
                                                  Timing)
from inference_worker.protocol.requests import (
    DEFAULT_MAX_TOKENS, JSON_OBJECT_SCHEMA, MAX_DATA_URL_HEADER_CHARS, MAX_SEED, MIN_SEED, SUPPORTED_IMAGE_MIME,
    ChatCompletionRequest, ChatMessage, ChatRequest, ContentPart, DeskEyeExtension, ImagePart, ImageUrl, ImageUrlPart,
    JsonSchemaFormat, Message, RequestLimits, ResponseFormat, SamplingParams, StreamOptions, TextPart,
    chat_request_from, decode_data_url, parse_chat_json, parse_chat_request, protocol_error_from)
from inference_worker.protocol.responses import (
    MAX_KEY_OBJECTS, OBJECT_MAX_CHARS, SUMMARY_MAX_CHARS, AssistantMessage, ChatCompletion, ChatCompletionChunk, Choice,
    ChunkChoice, ChunkDelta, DeskEyeFacts, Health, ModelCard, ModelList, Usage, chunk_body, completion_body,
    usage_of)
from inference_worker.protocol.window_facts import (MAX_WINDOW_COORD, MAX_WINDOW_FACTS, WINDOW_TEXT_MAX_CHARS,
                                                    WindowFact, parse_window_facts)

__all__ = [
    "ErrorBody", "ErrorDetail", "ProtocolError",
    # completion
    "CacheLevel", "Completion", "CompletionFacts", "OcrFacts", "OcrGrounding", "Timing",
    # requests
    "DEFAULT_MAX_TOKENS", "JSON_OBJECT_SCHEMA", "MAX_DATA_URL_HEADER_CHARS", "MAX_SEED", "MIN_SEED",
    "SUPPORTED_IMAGE_MIME", "ChatCompletionRequest", "ChatMessage", "ChatRequest", "ContentPart", "DeskEyeExtension",
    "ImagePart", "ImageUrl", "ImageUrlPart", "JsonSchemaFormat", "Message", "RequestLimits", "ResponseFormat",
    "SamplingParams", "StreamOptions", "TextPart", "chat_request_from", "decode_data_url", "parse_chat_json",
    "parse_chat_request", "protocol_error_from",
    # responses
    "MAX_KEY_OBJECTS", "OBJECT_MAX_CHARS", "SUMMARY_MAX_CHARS", "AssistantMessage", "ChatCompletion",
    "ChatCompletionChunk", "Choice", "ChunkChoice", "ChunkDelta", "DeskEyeFacts", "Health", "ModelCard", "ModelList",
    "Usage", "chunk_body", "completion_body", "usage_of",
    # window facts
    "MAX_WINDOW_COORD", "MAX_WINDOW_FACTS", "WINDOW_TEXT_MAX_CHARS", "WindowFact", "parse_window_facts",
]
