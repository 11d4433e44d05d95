"""What one request's JSON Schema may cost, and the one way a schema is refused (a 400 naming the place)."""

from __future__ import annotations

from dataclasses import dataclass

from inference_worker.errors import ProtocolError

PARAM = "response_format"
WHERE = "response_format.json_schema.schema"

@dataclass(frozen=True)
class SchemaLimits:
    """Caps on what one request's schema may cost. Defaults fit any realistic structured-output schema
    (OpenAI's own: 5,000 properties, 10 levels); `max_cache_bytes` bounds what compiled schemas keep."""
    max_bytes: int = 256 * 1024                # the schema as compact JSON
    max_depth: int = 64                        # JSON nesting (objects and arrays), ~32 schema levels
    max_nodes: int = 20_000                    # objects, arrays and scalars in the schema
    max_pattern_chars: int = 1_000
    max_pattern_memory_bytes: int = 1 << 20    # RE2's compile budget per pattern
    max_validation_steps: int = 200_000        # keyword evaluations while validating one answer
    max_validation_ms: int = 250               # and the time they may take (legitimate schemas need ~1 ms)
    max_in_place_expansion: int = 10_000       # subschemas $ref/allOf/anyOf/... apply to one value, expanded
    max_answer_depth: int = 64                 # nesting of the answer validated against a schema
    max_cache_bytes: int = 32 * 1024 * 1024

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchemaLimits.{name} must be a positive integer; got {value!r}")


DEFAULT_LIMITS = SchemaLimits()


class ValidationBudgetExceeded(RuntimeError):
    """Validating one answer took more keyword evaluations than `SchemaLimits.max_validation_steps`, or longer
    than `max_validation_ms`."""


def refuse(message: str) -> ProtocolError:
    return ProtocolError(f"{WHERE}: {message}", param=PARAM)
