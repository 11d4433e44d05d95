"""How the service tries again when an answer does not match its request's JSON schema.

A cut-off or invalid answer is generated again, first with twice the tokens (capped at the worker's
--max-tokens-limit), then greedily, up to --max-retries times; the service re-queues the attempt first in line
(service.py) and answers 502 when none is valid.
"""

from __future__ import annotations

import dataclasses

from inference_worker.protocol import ChatRequest


def retry_request(request: ChatRequest, retry: int, max_tokens_limit: int) -> ChatRequest:
    """The request for retry number `retry` (1, 2, ...): twice the tokens each time, greedy from the 2nd."""
    sampling = request.sampling
    max_tokens = min(max_tokens_limit, sampling.max_tokens * 2 ** retry)
    temperature = sampling.temperature if retry < 2 else 0.0
    return dataclasses.replace(request, sampling=dataclasses.replace(
        sampling, max_tokens=max_tokens, temperature=temperature))
