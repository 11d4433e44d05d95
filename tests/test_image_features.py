"""A frame seen again skips the image processor: the processor's output for the same pixels and arguments is served
from a small LRU (inference_worker/engines/hf/image_features.py), and the frame key's hash of big pixel tensors is
kept while they live (content_key.py). Checked on the real processors of the tiny Idefics3 and MiniCPM-V 4.6
fixtures against a processor that never caches: the same ids and pixel values, never another frame's."""

from __future__ import annotations

import gc
import io
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from inference_worker.engines import EngineOptions, load_hf_engine
from inference_worker.engines.hf import content_key as frame_keys
from inference_worker.engines.hf.content_key import content_key
from inference_worker.engines.hf.image_features import CachedImageProcessor, cache_image_features
from inference_worker.engines.hf.preprocess import template_messages
from tests.fixtures.chat_requests import chat_request, png_of
from tests.fixtures.text_image import render_text_png

pytestmark = [pytest.mark.model]

KV_BYTES = 64 * 1024 * 1024


class CountingImageProcessor:
    """An image processor's calls counted (the processor under test, unchanged otherwise)."""

    def __init__(self, inner):
        self.__dict__.update(inner=inner, num_calls=0)

    def __call__(self, *args, **kwargs):
        self.__dict__["num_calls"] += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        if "inner" not in self.__dict__:            # being unpickled
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)


@pytest.fixture(params=["idefics3", "minicpmv46"])
def model_dir(request, tiny_idefics3_dir, tiny_minicpmv46_dir):
    return {"idefics3": tiny_idefics3_dir, "minicpmv46": tiny_minicpmv46_dir}[request.param]


def load_processor(model_dir):
    """The processor as the worker loads it (MiniCPM-V 4.6: the image-only one of inference_worker's minicpmv.py)."""
    if "minicpmv46" in Path(model_dir).name:
        from inference_worker.engines.hf.minicpmv import MiniCPMVImageProcessor
        return MiniCPMVImageProcessor.from_pretrained(model_dir)
    return AutoProcessor.from_pretrained(model_dir)


def screen(size=(320, 200)) -> Image.Image:
    image = Image.new("RGB", size, (245, 245, 245))
    image.paste((30, 90, 200), (10, 10, size[0] // 2, 40))
    image.paste((200, 60, 30), (size[0] // 2, size[1] // 2, size[0] - 10, size[1] - 10))
    return image


def with_one_pixel_changed(image: Image.Image) -> Image.Image:
    changed = image.copy()
    changed.putpixel((image.width - 20, image.height - 20), (0, 255, 0))
    return changed


def prompt_for(processor, question: str) -> str:
    from inference_worker.protocol import parse_chat_request
    from deskeye.prompt import build_messages

    request = parse_chat_request({"model": "m", "messages": build_messages(question, png_of(screen()))})
    return processor.apply_chat_template(template_messages(request.messages), add_generation_prompt=True,
                                         tokenize=False)


def processed(processor, image: Image.Image, question: str = "What is on this screen?") -> dict:
    return dict(processor(text=[prompt_for(processor, question)], images=[[image]], return_tensors="pt"))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), name
        else:
            np.testing.assert_equal(a[name], b[name])


def cached_processor(model_dir, max_bytes=None):
    """The model's real processor with a counted image processor inside the cache (and the cache)."""
    processor = load_processor(model_dir)
    counting = CountingImageProcessor(processor.image_processor)
    processor.image_processor = counting
    cached = cache_image_features(processor, **({} if max_bytes is None else {"max_bytes": max_bytes}))
    return processor, cached, counting


def test_the_same_pixels_again_are_not_processed_again_and_give_the_same_inputs(model_dir):
    processor, cached, counting = cached_processor(model_dir)
    plain = load_processor(model_dir)
    image = screen()
    first = processed(processor, image)
    again = processed(processor, image.copy(), "Which window has focus?")       # same pixels, another object
    assert counting.num_calls == 1 and (cached.num_hits, cached.num_misses) == (1, 1)
    assert_same(first, processed(plain, image))
    assert_same(again, processed(plain, image, "Which window has focus?"))
    assert not torch.equal(first["input_ids"], again["input_ids"])                # the text is still its own


def test_a_changed_pixel_size_or_argument_is_processed_anew(model_dir):
    processor, cached, counting = cached_processor(model_dir)
    plain = load_processor(model_dir)
    image = screen()
    processed(processor, image)
    for other in (with_one_pixel_changed(image), image.resize((330, 200)), image.convert("L").convert("RGB")):
        assert_same(processed(processor, other), processed(plain, other))
    assert counting.num_calls == 4 and cached.num_hits == 0
    direct = processor.image_processor([[image]], return_tensors="np")                   # other arguments
    assert counting.num_calls == 5 and isinstance(next(iter(direct.values())), np.ndarray)


def test_kept_outputs_stay_within_their_byte_budget_oldest_dropped_first(tiny_idefics3_dir):
    probe, probe_cache, _ = cached_processor(tiny_idefics3_dir)
    processed(probe, screen())
    one = probe_cache.num_bytes
    processor, cached, counting = cached_processor(tiny_idefics3_dir, max_bytes=2 * one)
    images = [screen(), with_one_pixel_changed(screen()), screen(size=(321, 200))]
    for image in images:
        processed(processor, image)
    assert cached.num_bytes <= 2 * one and counting.num_calls == 3
    processed(processor, images[2])
    assert counting.num_calls == 3                                                       # the newest: kept
    processed(processor, images[0])
    assert counting.num_calls == 4                                                       # the oldest: dropped
    keeps_nothing = CachedImageProcessor(processor.image_processor.inner, max_bytes=0)
    for _ in range(2):
        keeps_nothing([[images[0]]], return_tensors="pt")
    assert keeps_nothing.num_bytes == 0 and not keeps_nothing._entries and counting.num_calls == 6


def test_an_output_changed_in_place_is_never_served_again(tiny_idefics3_dir):
    processor, cached, counting = cached_processor(tiny_idefics3_dir)
    plain = load_processor(tiny_idefics3_dir)
    image = screen()
    processed(processor, image)["pixel_values"].mul_(0)           # someone wrote into the shared tensor
    assert_same(processed(processor, image), processed(plain, image))
    assert counting.num_calls == 2


def test_what_a_caller_pops_or_edits_does_not_reach_the_kept_output(model_dir):
    processor, cached, counting = cached_processor(model_dir)
    image = screen()
    first = processor.image_processor([[image]], return_tensors="pt")
    expected = {name: (value.clone() if isinstance(value, torch.Tensor) else pickle.loads(pickle.dumps(value)))
                for name, value in first.items()}
    for name in list(first.keys()):
        value = first.pop(name)
        if isinstance(value, list):
            value.clear()
    again = processor.image_processor([[image]], return_tensors="pt")
    assert counting.num_calls == 1
    assert_same(dict(again), expected)


def test_small_frames_are_kept_by_count_too_not_by_thousands(tiny_idefics3_dir):
    processor, cached, counting = cached_processor(tiny_idefics3_dir)
    images = [screen(size=(300 + i, 200)) for i in range(10)]
    for image in images:
        processed(processor, image)
    assert len(cached._entries) == cached.max_entries == 4 and cached.num_bytes < cached.max_bytes / 100
    processed(processor, images[-1])
    processed(processor, images[0])
    assert counting.num_calls == 11                                      # the newest kept, the oldest processed anew


def test_it_travels_to_preprocessing_processes_without_its_entries(tiny_idefics3_dir):
    processor, cached, _ = cached_processor(tiny_idefics3_dir)
    processed(processor, screen())
    copy = pickle.loads(pickle.dumps(processor))
    assert isinstance(copy.image_processor, CachedImageProcessor)
    assert copy.image_processor.num_bytes == 0 and cached.num_bytes > 0
    assert_same(processed(copy, screen()), processed(processor, screen()))


def test_inputs_other_than_pil_images_go_to_the_processor_as_they_are(tiny_idefics3_dir):
    processor, cached, counting = cached_processor(tiny_idefics3_dir)
    array = np.asarray(screen())
    for _ in range(2):
        processor.image_processor([[array]], return_tensors="pt")
    assert counting.num_calls == 2 and cached.num_misses == 0 and cached.num_bytes == 0


def test_a_frame_asked_about_again_skips_the_processor_and_keeps_its_exact_key(tiny_idefics3_dir):
    engine = load_hf_engine(str(tiny_idefics3_dir), EngineOptions(device="cpu", num_threads=1,
                                                                   kv_cache_bytes=KV_BYTES), progress=False)
    try:
        png = render_text_png(["Build 4471 finished", "3 warnings, 0 errors"])
        first = engine.prepare(chat_request("What is on this screen?", png)[0]).inputs
        again = engine.prepare(chat_request("Which file has the warnings?", png)[0]).inputs
        changed = Image.open(io.BytesIO(png)).convert("RGB")
        changed.paste((200, 30, 30), (0, 0, changed.width // 2, changed.height // 2))       # a window came up
        moved = engine.prepare(chat_request("What is on this screen?", png_of(changed))[0]).inputs
        assert engine.image_features.num_hits == 1 and engine.image_features.num_misses == 2
        assert again.frame.exact_key == first.frame.exact_key
        assert torch.equal(again.prefix_ids, first.prefix_ids)
        assert moved.frame.exact_key != first.frame.exact_key                  # never another frame's KV
        assert not torch.equal(moved.vision["pixel_values"], first.vision["pixel_values"])
    finally:
        engine.close()


def test_a_big_tensors_digest_is_kept_while_it_lives_unchanged():
    big = torch.rand(frame_keys.MEMO_MIN_BYTES // 4 + 1000)
    key = content_key("m", big)
    assert id(big) in frame_keys._tensor_digests
    assert content_key("m", big) == key == content_key("m", big.clone())             # same values, same key
    big.add_(1.0)                                                                    # changed in place
    assert content_key("m", big) != key and content_key("m", big) == content_key("m", big.clone())
    assert content_key("m", big[:-1]) != content_key("m", big)
    big_id = id(big)
    del big
    gc.collect()
    assert big_id not in frame_keys._tensor_digests                                 # forgotten with the tensor
    small = torch.rand(16)
    assert content_key(small) == content_key(small.clone()) and id(small) not in frame_keys._tensor_digests
