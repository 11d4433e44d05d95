"""No prompt can hold the model hostage: prompts are bounded by the model's context (and --max-prompt-tokens), a long
prefill goes in pieces that a cancelled request stops between, and the app bounds what it sends.

The trial's inputs, rebuilt: 93 KB of text (64,012 tokens, 15.4 s of prefill on the tiny Idefics3 model whose context
is 1,024), 200 KB of combining accents (79 s), a long request whose client dropped the connection while the model
prefilled it (the next small request waited 10.1 s), and an Ask-box question and memory sent uncapped. Real parts
throughout: tiny random models of the real families, the real `deskeye-worker`, the official `openai` client.
"""

from __future__ import annotations

import io
import re
import threading
import time
from types import SimpleNamespace

import openai
import pytest
from PIL import Image
from transformers import AutoProcessor

from deskeye.worker.client import WorkerClient
from deskeye.ask.memory import ConversationMemory
from deskeye.prompt import (MAX_MEMORY_CHARS, MAX_QUESTION_CHARS, MAX_TURN_CHARS, Turn, bound_memory,
                            bound_question, build_messages)
from deskeye.settings import Settings, with_overrides
from deskeye.worker.supervisor import WorkerSupervisor
from inference_worker.config import ConfigError, WorkerConfig
from inference_worker.engines.base import RowCancelled, run_one
from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.hf.preprocess import template_messages
from inference_worker.engines.prompt_bounds import MAX_CHARS_PER_TOKEN
from inference_worker.errors import ServiceError
from inference_worker.metrics import WorkerMetrics
from inference_worker.protocol import parse_chat_request
from inference_worker.serving.service import ModelService
from tests.fixtures.chat_requests import chat_request, png_bytes
from tests.fixtures.forward_spy import recording_forwards
from tests.fixtures.minicpmo_standin import build_minicpmo_standin
from tests.fixtures.tiny_models import build_tiny_idefics3
from tests.fixtures.worker import WorkerHandle, running_worker
from tests.test_continuous_batching import assert_same_logits

pytestmark = pytest.mark.timeout(900)

TINY_CONTEXT = 1024                    # the tiny fixtures' max_position_embeddings
LONG_CONTEXT = 131_072                 # the long-context Idefics3 built here
MAX_PROMPT_TOKENS = 60_000             # the long-context worker's --max-prompt-tokens
SENTENCE = "The quick brown fox jumps over the lazy dog. "
NUMBER = re.compile(r"[\d,]+")


def text_of_words(num_sentences: int, salt: str = "") -> str:
    return "".join(f"{salt}{i % 97} {SENTENCE}" for i in range(num_sentences))


def user_message(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def numbers_in(message: str) -> list[int]:
    return [int(n.replace(",", "")) for n in NUMBER.findall(message) if n.strip(",")]


def prompt_tokens(processor, text: str) -> int:
    """The prompt's length as the worker's processor makes it (template, then tokenizer), counted here apart."""
    request = parse_chat_request({"messages": user_message(text)})
    prompt = processor.apply_chat_template(template_messages(request.messages), add_generation_prompt=True,
                                           tokenize=False)
    return int(processor(text=[prompt], return_tensors="pt")["input_ids"].shape[1])


# ---------------------------------------------------------------- the fixtures

@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory):
    """The tiny Idefics3 with a 128K context: a prompt long enough to take seconds of prefill is allowed."""
    return build_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3_long"),
                               text_overrides={"max_position_embeddings": LONG_CONTEXT})


@pytest.fixture(scope="module")
def long_context_worker(long_context_dir, tmp_path_factory) -> WorkerHandle:
    args = ["--engine", "transformers", "--model", str(long_context_dir), "--threads", "1",
            "--max-prompt-tokens", str(MAX_PROMPT_TOKENS)]
    with running_worker(args, tmp_path_factory.mktemp("long_context_worker")) as handle:
        yield handle


@pytest.fixture(scope="module")
def idefics3(tiny_idefics3_dir):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    yield engine
    engine.close()


def timed_answer(client: openai.OpenAI, text: str, **options) -> float:
    started = time.monotonic()
    client.chat.completions.create(model="deskeye", messages=user_message(text), temperature=0, **options)
    return time.monotonic() - started


def metric(worker: WorkerHandle, name: str) -> float:
    return worker.metrics().get(name, 0.0)


# ---------------------------------------------------------------- over-long prompts: a 400 that says by how much

def test_a_prompt_over_the_models_context_gets_a_400_naming_its_tokens_the_limit_and_the_excess(
        tiny_worker, tiny_idefics3_dir):
    """~1,500 tokens of text to a model whose context is 1,024: refused at once, whether streamed or not, with the
    prompt's own token count (counted here with the model's processor), the limit (the context less the 256 kept
    for the answer) and the difference; then the worker answers a normal request."""
    text = text_of_words(130)
    assert len(text) < (TINY_CONTEXT - 1) * MAX_CHARS_PER_TOKEN       # passes the text check: its tokens decide
    expected_tokens = prompt_tokens(AutoProcessor.from_pretrained(tiny_idefics3_dir), text)
    limit = TINY_CONTEXT - 256
    assert expected_tokens > limit
    client = tiny_worker.openai_client(timeout=60)
    for stream in (False, True):
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="deskeye", messages=user_message(text), max_tokens=256,
                                           stream=stream)
        elapsed_s = time.monotonic() - started
        message = refused.value.body["message"]
        print(f"stream={stream}: refused in {elapsed_s:.2f} s: {message}")
        assert refused.value.status_code == 400 and refused.value.body["param"] == "messages"
        assert f"The prompt is {expected_tokens:,} tokens, {expected_tokens - limit:,} over the {limit:,}" in message
        assert f"context of {TINY_CONTEXT:,} tokens less 256 kept for the answer" in message
        assert "shorten the question or the earlier turns" in message and "fewer max_tokens" in message
        assert elapsed_s < 10
    answer = client.chat.completions.create(model="deskeye", messages=user_message("hi"), max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("label, text", [
    ("93 KB of text", "".join(f"w{i % 1000}{'x' * (i % 7)} " for i in range(14_000))[:93_000]),
    ("200 KB of combining accents", "a" + "\u0301" * 200_000),
])
def test_the_trials_long_texts_are_refused_before_tokenizing(tiny_worker, label, text):
    """The trial's texts (15.4 s and 79 s of work before) are refused in well under a second of work, naming their
    size in characters and the most this worker reads; the worker then answers a normal request."""
    client = tiny_worker.openai_client(timeout=120)
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="deskeye", messages=user_message(text), max_tokens=8)
    elapsed_s = time.monotonic() - started
    message = refused.value.body["message"]
    print(f"{label}: refused in {elapsed_s:.2f} s: {message}")
    max_chars = (TINY_CONTEXT - 1) * MAX_CHARS_PER_TOKEN
    assert f"The request's text is {len(text):,} characters, {len(text) - max_chars:,} over the {max_chars:,}" \
        in message
    assert "Shorten the question or the earlier turns" in message
    assert elapsed_s < 10
    started = time.monotonic()
    client.chat.completions.create(model="deskeye", messages=user_message("hi"), max_tokens=4)
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_max_prompt_tokens_lowers_the_limit_and_is_named_in_the_refusal(long_context_worker):
    """--max-prompt-tokens 60000 on a 128K model: ~62,000 tokens are refused naming the setting (the text itself
    passes the character check)."""
    text = text_of_words(5_200, salt="a")
    assert len(text) < MAX_PROMPT_TOKENS * MAX_CHARS_PER_TOKEN
    with pytest.raises(openai.BadRequestError) as refused:
        long_context_worker.openai_client(timeout=120).chat.completions.create(
            model="deskeye", messages=user_message(text), max_tokens=8)
    message = refused.value.body["message"]
    num_tokens, over, limit = numbers_in(message)[:3]
    assert limit == MAX_PROMPT_TOKENS and over == num_tokens - limit > 0, message
    assert "(--max-prompt-tokens 60000)" in message and "fewer max_tokens" not in message


def test_max_prompt_tokens_is_validated_where_the_worker_starts():
    with pytest.raises(ConfigError, match=r"--max-prompt-tokens must be 0 \(the model's context\) or an integer "
                                          r"from 16"):
        WorkerConfig(max_prompt_tokens=5)
    assert WorkerConfig(max_prompt_tokens=0).max_prompt_tokens == 0


@pytest.mark.slow
def test_an_answer_stops_at_the_end_of_the_models_context(idefics3):
    """max_tokens 1024 on a 1,024-token context: the prompt (~20 tokens) fits, and the answer stops where the context
    ends (finish_reason "length") instead of decoding past the model's positions."""
    request, images = chat_request("Tell me a long story.", None, max_tokens=1024)
    completion = run_one(idefics3, request)
    assert completion.finish_reason == "length"
    assert completion.prompt_tokens + completion.completion_tokens == TINY_CONTEXT


# ---------------------------------------------------------------- a long prefill goes in pieces

def memory_turns(num_turns: int) -> list[Turn]:
    return [Turn(f"What does line {i} of the log say? " + SENTENCE * 2, f"It says {i}: " + SENTENCE)
            for i in range(num_turns)]


def chunked_and_whole(engine, request, images, chunk_tokens: int, *, frame_cache: bool):
    """The same prepared request decoded with the prefill in pieces of `chunk_tokens` and in one forward (each
    with its own frame cache state: off, or a cold keep and then an exact hit), and the sizes of the prefill
    forwards of the pieced runs."""
    pieces: list[int] = []
    results: dict[int, list] = {}
    for chunk in (chunk_tokens, 10**9):
        engine.decoder.forward.chunk_tokens = chunk
        if engine.frame_cache is not None:
            engine.frame_cache.clear()
        runs = []
        for _ in range(2 if frame_cache else 1):
            item = engine.prepare(request)
            if not frame_cache:
                item.inputs.frame = None
            out: list = []
            record = (lambda kwargs: pieces.append(_forward_length(kwargs))) if chunk == chunk_tokens else \
                (lambda kwargs: None)
            with recording_forwards(engine, record):
                engine.decoder.run([engine.decoder_row(item)], lambda index, result: out.append(result))
            runs.append(out[0])
        results[chunk] = runs
    engine.decoder.forward.chunk_tokens = 512
    return results[chunk_tokens], results[10**9], pieces


def _forward_length(kwargs) -> int:
    tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    return int(tokens.shape[1])


@pytest.fixture(scope="module")
def minicpmo_dir(tmp_path_factory):
    return build_minicpmo_standin(tmp_path_factory.mktemp("minicpmo_standin"))


@pytest.mark.slow
@pytest.mark.parametrize("family, frame_cache", [("idefics3", False), ("idefics3", True), ("llava", True),
                                                 ("minicpmv46", False), ("minicpmv46", True)])
def test_a_prefill_in_pieces_gives_the_logits_of_one_forward(family, frame_cache, request):
    """Earlier turns before the frame and a long question after it, prefilled in pieces of 16 tokens of text (the
    image tokens in one piece, with the images) on the cache the pieces before filled: every step's logits are those
    of the one-forward prefill, cold, keeping the frame's prefix and on an exact frame hit; plain attention
    (Idefics3, LLaVA) and MiniCPM-V 4.6's hybrid linear/full attention."""
    folder = request.getfixturevalue(f"tiny_{family}_dir")
    engine = load_hf_engine(str(folder), EngineOptions(device="cpu", num_threads=1,
                                                       kv_cache_bytes=64 * 2**20 if frame_cache else 0), progress=False)
    engine.decoder.keep_logits = True
    try:
        payload = {"model": "deskeye", "max_tokens": 6, "temperature": 0,
                   "messages": build_messages("Which of these lines matters? " + SENTENCE * 8,
                                              png_bytes((200, 40, 40), (112, 112)), memory_turns(3))}
        chat = parse_chat_request(payload)
        images = [Image.open(io.BytesIO(part.data)).convert("RGB") for part in chat.images]
        pieced, whole, pieces = chunked_and_whole(engine, chat, images, 16, frame_cache=frame_cache)
    finally:
        engine.close()
    for label, got, want in zip(("first", "exact hit"), pieced, whole):
        assert_same_logits(got, want, f"{family} {label}")
    if frame_cache:
        assert [r.kv_cache for r in pieced] == ["miss", "exact"] and [r.kv_cache for r in whole] == ["miss", "exact"]
    prefills = [n for n in pieces if n > 1]
    assert len(prefills) >= 8, f"the prompt was prefilled in {prefills}: not in pieces"
    assert sorted(prefills)[-2] <= 16, prefills          # only the piece with the image tokens is longer


@pytest.mark.slow
def test_minicpmo_prefills_its_embeddings_in_pieces_with_the_same_logits(minicpmo_dir):
    """MiniCPM-o hands the decoder its prompt as embeddings (images merged in): they are prefilled in pieces too."""
    engine = load_hf_engine(str(minicpmo_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    engine.decoder.keep_logits = True
    try:
        request, images = chat_request("Which of these lines matters? " + SENTENCE * 10, png_bytes((200, 40, 40)),
                                       max_tokens=6, temperature=0)
        results = {}
        forwards: list[int] = []
        for chunk in (16, 10**9):
            engine.decoder.forward.chunk_tokens = chunk
            out: list = []
            record = (lambda kwargs: forwards.append(_forward_length(kwargs))) if chunk == 16 else (lambda kw: None)
            language_model = SimpleNamespace(model=engine.model.llm, decoder=engine.decoder)   # its decoder's model
            with recording_forwards(language_model, record):
                engine.run_batch([engine.prepare(request)], lambda index, answer: out.append(answer))
            results[chunk] = out[0]
    finally:
        engine.close()
    assert results[16].text == results[10**9].text and results[16].completion_tokens == 6
    prefills = [n for n in forwards if n > 1]
    assert len(prefills) >= 5 and max(prefills) <= 16, prefills


def test_a_cancelled_row_stops_between_pieces_of_its_prefill(idefics3):
    """The row's client goes away during the second piece of its prefill: it ends RowCancelled before a third
    piece, never having prefilled the rest of its prompt."""
    request, images = chat_request("Summarise this. " + SENTENCE * 60, None, max_tokens=8)
    item = idefics3.prepare(request)
    row = idefics3.decoder_row(item)
    forwards: list[int] = []

    def record(kwargs) -> None:
        forwards.append(_forward_length(kwargs))
        if len(forwards) == 2:
            row.cancelled.set()
    idefics3.decoder.forward.chunk_tokens = 64
    outcomes: list = []
    try:
        with recording_forwards(idefics3, record):
            idefics3.decoder.run([row], lambda index, outcome: outcomes.append(outcome))
    finally:
        idefics3.decoder.forward.chunk_tokens = 512
    assert item.inputs.num_tokens > 4 * 64
    assert len(outcomes) == 1 and isinstance(outcomes[0], RowCancelled)
    assert forwards == [64, 64], f"forwards of {forwards} tokens for a prompt of {item.inputs.num_tokens}"


# ---------------------------------------------------------------- a dropped or timed-out prefill frees the model

@pytest.mark.slow
def test_a_client_that_drops_a_long_prompt_frees_the_model_within_one_piece(long_context_worker):
    """The trial: a client drops its connection while the model prefills a ~48,000-token prompt. The next small
    request is answered in less time than the solo prefill of a prompt a quarter as long (measured here first), where
    before it waited for the whole prefill."""
    worker = long_context_worker
    client = worker.openai_client(timeout=120)
    quarter_s = timed_answer(client, text_of_words(1_000, salt="q"), max_tokens=1)
    before = worker.metrics()
    impatient = worker.openai_client(timeout=2.0)             # the client gives up (and hangs up) after 2 s
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="deskeye", messages=user_message(text_of_words(4_000, salt="l")),
                                          max_tokens=8, temperature=0)
    next_s = timed_answer(client, "What is on this screen?", max_tokens=4)
    print(f"solo prefill of a quarter of the prompt: {quarter_s:.2f} s; the next request after the drop: "
          f"{next_s:.2f} s")
    assert next_s < quarter_s, "the next request waited for the dropped prompt's prefill"
    cancelled = 'deskeye_worker_engine_calls_total{outcome="cancelled"}'
    deadline = time.monotonic() + 30
    while metric(worker, cancelled) == before.get(cancelled, 0.0):
        assert time.monotonic() < deadline, "the dropped request was never cancelled"
        time.sleep(0.05)
    key = 'deskeye_worker_cancelled_total{stage="decoding"}'
    assert metric(worker, key) - before.get(key, 0.0) == 1


@pytest.mark.slow
def test_a_timed_out_long_prompt_gets_504_and_frees_the_model_within_one_piece(long_context_dir):
    """--request-timeout-s passes while the model prefills a ~48,000-token prompt: 504, and the model thread is free
    for the next request in less than a quarter-length prompt's solo prefill."""
    metrics = WorkerMetrics()
    service = ModelService(lambda progress: load_hf_engine(
        str(long_context_dir), EngineOptions(device="cpu", num_threads=1), progress=False), WorkerConfig(),
        metrics=metrics)
    service.start()
    try:
        ready = threading.Event()
        while service.state == "loading" and not ready.wait(0.02):
            pass
        assert service.state == "ready", service.load_error

        def ask(text: str, timeout_s: float, max_tokens: int = 1):
            return service.answer(parse_chat_request({"messages": user_message(text), "max_tokens": max_tokens}),
                                  timeout_s=timeout_s)
        started = time.monotonic()
        ask(text_of_words(1_000, salt="t"), 120)
        quarter_s = time.monotonic() - started
        with pytest.raises(ServiceError) as timed_out:
            ask(text_of_words(4_000, salt="u"), 2.0, max_tokens=8)
        started = time.monotonic()
        ask("What is on this screen?", 120, max_tokens=4)
        next_s = time.monotonic() - started
    finally:
        service.stop()
    print(f"solo prefill of a quarter of the prompt: {quarter_s:.2f} s; the next request after the timeout: "
          f"{next_s:.2f} s")
    assert timed_out.value.status == 504
    assert next_s < quarter_s, "the next request waited for the timed-out prompt's prefill"


# ---------------------------------------------------------------- the app bounds what it sends

def test_the_app_cuts_a_long_question_and_says_so():
    question = "Here is the log:\n" + "error: disk full\n" * 2_000 + "What does this error mean?"
    sent, note = bound_question(question)
    assert len(sent) == MAX_QUESTION_CHARS and sent.startswith("Here is the log:")
    assert sent.endswith("What does this error mean?")          # the ask at its end is kept
    assert note is not None and f"{len(question):,} characters" in note and f"{MAX_QUESTION_CHARS:,}" in note
    assert bound_question("What is on this screen?") == ("What is on this screen?", None)


def test_the_memory_keeps_each_turn_short_and_sends_the_newest_that_fit():
    memory = ConversationMemory(20)
    for i in range(20):
        memory.add(f"question {i} " + "q" * 5_000, f"answer {i} " + "a" * 5_000)
    turns = memory.turns()
    assert all(len(t.question) <= MAX_TURN_CHARS and len(t.answer) <= MAX_TURN_CHARS for t in turns)
    sent, num_left_out = bound_memory(turns)
    assert sum(len(t.question) + len(t.answer) for t in sent) <= MAX_MEMORY_CHARS
    assert sent and sent[-1] == turns[-1] and num_left_out == len(turns) - len(sent) > 0
    assert [t.question[:12] for t in sent] == [t.question[:12] for t in turns[-len(sent):]]   # the newest, in order


@pytest.mark.slow
def test_the_client_sends_a_bounded_prompt_and_tells_the_user_what_was_cut(long_context_worker):
    """WorkerClient.ask with a 50,000-character question and 20 long remembered turns, against a real worker whose
    limit would let all of it through: what arrives (the worker's own prompt-token count) is bounded, and the answer
    carries a note for the user."""
    worker = long_context_worker
    settings = with_overrides(Settings(), worker={"url": worker.url, "api_key": worker.api_key,
                                                  "request_timeout_s": 120.0, "max_tokens": 64})
    client = WorkerClient(WorkerSupervisor(settings), settings)
    question = "Why does this fail? " + text_of_words(1_100, salt="c")
    memory = [Turn(f"earlier question {i} " + SENTENCE * 40, f"earlier answer {i} " + SENTENCE * 40)
              for i in range(20)]
    calls, tokens = 'deskeye_worker_engine_calls_total{outcome="ok"}', "deskeye_worker_prompt_tokens_total"
    before = worker.metrics()
    try:
        answer = client.ask(question, png_bytes((30, 30, 220)), memory)
    finally:
        client.close()
    after = worker.metrics()
    num_calls = after[calls] - before.get(calls, 0.0)             # the client or the worker may ask again
    tokens_per_call = (after[tokens] - before.get(tokens, 0.0)) / num_calls
    print(f"a {len(question):,}-character question and {len(memory)} turns arrived as {tokens_per_call:.0f} tokens "
          f"(in each of {num_calls:.0f} model calls)")
    assert 0 < tokens_per_call <= (MAX_QUESTION_CHARS + MAX_MEMORY_CHARS) / 2, "the whole question and memory were sent"
    print(f"notes: {answer.notes}")
    assert len(answer.notes) == 1 and f"Your question was {len(question):,} characters long" in answer.notes[0]
    assert answer.shown_text() == f"{answer.summary}\n{answer.notes[0]}"
    assert answer.to_dict()["notes"] == list(answer.notes)


@pytest.mark.slow
def test_the_prefill_pieces_benchmark_runs_end_to_end(tmp_path):
    """benchmarks/prefill_pieces.py on a short prompt: every number filled (speed itself is never asserted here)."""
    import json

    from benchmarks import prefill_pieces

    out = tmp_path / "prefill_pieces.json"
    prefill_pieces.main(["--tokens", "1200", "--repeats", "1", "--json-out", str(out)])
    (row,) = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert row["prompt_tokens"] >= 1200 and row["num_pieces"] >= 3
    assert row["one_forward_s"] > 0 and row["pieces_s"] > 0 and row["freed_after_s"] > 0
