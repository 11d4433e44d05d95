"""What an engine hands back for one request: the answer (`Completion`) and how it was made (`CompletionFacts`).

Typed, so every engine reports the same facts under the same names: the service adds its own (engine kind, queue
and total time), the metrics count them, and the server serialises them as the response's `deskeye` field
(responses.py). Plain dataclasses: engines fill them on the model thread without validation costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

class CacheLevel(StrEnum):
    """How much of a row's prompt came from the frame cache (KV for transformers, vision features for OpenVINO)."""
    OFF = "off"           # the engine keeps no frame cache, or it is turned off
    NONE = "none"         # the request had no image to look up
    MISS = "miss"
    SIMILAR = "similar"   # a near-identical frame's entry was reused (an approximation)
    EXACT = "exact"


@dataclass
class Timing:
    """Milliseconds. The engine fills what it measured; the service adds queue_ms and total_ms."""
    ttft_ms: float | None = None      # joining the decode to the first token
    decode_ms: float | None = None    # first token to last
    vision_ms: float | None = None    # the image encoding's part of ttft_ms
    queue_ms: float | None = None     # arrival to the model thread taking it
    total_ms: float | None = None     # arrival to the answer


@dataclass
class OcrFacts:
    """What the OCR reader did for one request."""
    num_lines: int
    num_regions_read: int
    area_read_fraction: float
    full_reads: int
    read_ms: float
    total_ms: float


@dataclass
class OcrGrounding:
    """The OCR text an OCR-grounded engine (--ground-with-ocr) added to the model's prompt."""
    num_lines: int
    num_chars: int


@dataclass
class CompletionFacts:
    """What an engine and the service know about how an answer was made: the response's `deskeye` field (typed here,
    serialised by the server), the worker's metrics and the benchmarks read it."""
    engine: str = ""                          # the engine kind, set by the service
    cache: CacheLevel = CacheLevel.OFF
    constrained: bool = False                 # whether a grammar constrained the output
    grammar_ms: float | None = None           # this row's share of the grammar's time
    batch_size: int | None = None             # the most rows decoded together while this row decoded
    mean_live_rows: float | None = None
    timing: Timing = field(default_factory=Timing)
    ocr: OcrFacts | None = None               # the OCR engine's reading
    ocr_grounding: OcrGrounding | None = None   # the OCR text an OCR-grounded engine added to the model's prompt
    logits: list[Any] | None = None           # per-step logits, only when an engine keeps them for a test


@dataclass
class Completion:
    """What one request produced, before it is wrapped in the OpenAI envelope."""
    text: str
    finish_reason: str            # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    retries: int = 0              # constrained-output retries it took
    facts: CompletionFacts = field(default_factory=CompletionFacts)
