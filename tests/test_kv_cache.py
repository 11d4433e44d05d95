"""The frame cache (inference_worker/engines/hf/frame_cache.py): LRU under a byte bound, freeing on eviction, the exact and
similar levels on real rendered desktop frames, and sizes of a real transformers DynamicCache."""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import weakref

import pytest
from PIL import Image, ImageDraw, ImageFont

from inference_worker.config import DEFAULT_KV_SIMILAR_THRESHOLD
from inference_worker.engines.hf.content_key import content_key
from inference_worker.engines.hf.frame_cache import FrameCache, frame_distance, frame_signature, tensor_nbytes
from tests.fixtures.text_image import font_path

pytestmark = [pytest.mark.model, pytest.mark.subprocess]

GROUP = b"model+prefix+layout"
LIGHT = {"desktop": (236, 239, 244), "paper": (255, 255, 255), "ink": (30, 30, 30), "title": (52, 101, 164)}
MAIL = ["Inbox (3 unread)", "From: Anna Berg   Subject: Quarterly report draft",
        "From: IT Desk   Subject: Password expires in 5 days", "From: Tom   Subject: Lunch on Friday?",
        "Meeting at 10:30 with the design team", "Invoice 4471 is due next week"]
WINDOW = (60, 50, 740, 520)


def screen(lines=MAIL, *, title="Mail", theme=LIGHT, window=WINDOW) -> Image.Image:
    """An 800x600 desktop: a window with a title bar and lines of 15 px text, a taskbar with a clock."""
    image = Image.new("RGB", (800, 600), theme["desktop"])
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype(font_path(), 15)
    x0, y0, x1, _ = window
    draw.rectangle(window, fill=theme["paper"], outline=(180, 180, 180))
    draw.rectangle((x0, y0, x1, y0 + 28), fill=theme["title"])
    draw.text((x0 + 10, y0 + 6), title, fill=(255, 255, 255), font=font)
    for i, line in enumerate(lines):
        draw.text((x0 + 16, y0 + 44 + i * 24), line, fill=theme["ink"], font=font)
    draw.rectangle((0, 570, 800, 600), fill=(40, 40, 48))
    draw.text((720, 577), "10:41", fill=(255, 255, 255), font=font)
    return image


def with_cursor(image: Image.Image, points: list[tuple[int, int]]) -> Image.Image:
    """The frame with a black cursor drawn: a rectangle from two corners, else a polygon."""
    copy = image.copy()
    draw = ImageDraw.Draw(copy)
    if len(points) == 2:
        draw.rectangle(points, fill=(0, 0, 0))
    else:
        draw.polygon(points, fill=(0, 0, 0))
    return copy


CURSORS = {
    "2x2 dot (4 px)": [(400, 300), (401, 301)],
    "I-beam 2x10 (20 px)": [(300, 210), (301, 219)],
    "small arrow (~15 px)": [(500, 400), (500, 406), (502, 404), (505, 406)],
}
DIFFERENT_SCREENS = {
    "other text lines": lambda: screen(["$ make test", "ok: 12 passed", "$ git status", "nothing to commit"]),
    "one line changed": lambda: screen(MAIL[:4] + ["Meeting moved to 14:00 in room B"] + MAIL[5:]),
    "dark theme": lambda: screen(theme={"desktop": (20, 20, 24), "paper": (36, 36, 40), "ink": (220, 220, 220),
                                        "title": (52, 101, 164)}),
    "title bar of another colour, same brightness": lambda: screen(theme={**LIGHT, "title": (180, 60, 60)}),
    "another app's window, same layout": lambda: screen(["def main():", "    return run(sys.argv)"], title="Editor"),
    "window moved": lambda: screen(window=(80, 60, 760, 530)),
}


@pytest.fixture(scope="module")
def mail() -> Image.Image:
    return screen()


def signature_bytes() -> int:
    return frame_signature([screen()]).nbytes                      # one 800x600 frame's thumbnails


def similar_cache() -> FrameCache:
    return FrameCache(max_bytes=10 * signature_bytes(), similar_threshold=DEFAULT_KV_SIMILAR_THRESHOLD)


def lru_cache(max_bytes: int, **options) -> FrameCache:
    """The LRU mechanics alone: no per-entry overhead, so the counted bytes are exactly the declared ones."""
    return FrameCache(max_bytes=max_bytes, entry_overhead_bytes=0, **options)


# --- LRU and the byte bound -------------------------------------------------------------------------------------

def test_least_recently_used_entries_go_first_and_the_bound_always_holds():
    evicted = []
    cache = lru_cache(100, on_evict=evicted.append)
    assert cache.put(b"a", GROUP, None, "A", 40) and cache.put(b"b", GROUP, None, "B", 40)
    assert cache.lookup(b"a", GROUP, None).level == "exact"            # a is now the most recent
    assert cache.put(b"c", GROUP, None, "C", 40)

    assert evicted == ["B"] and cache.num_evictions == 1
    assert cache.num_bytes == 80 <= cache.max_bytes and cache.num_entries == 2
    assert cache.lookup(b"b", GROUP, None).level == "miss"
    assert [cache.lookup(k, GROUP, None).value for k in (b"a", b"c")] == ["A", "C"]
    assert cache.put(b"d", GROUP, None, "D", 100)                      # fits only alone: evicts both
    assert evicted == ["B", "A", "C"]
    assert cache.num_bytes == 100 and cache.num_entries == 1 and cache.num_evictions == 3
    assert (cache.num_exact_hits, cache.num_misses) == (3, 1)


def test_an_entry_over_the_budget_is_not_stored_and_the_cache_is_unchanged():
    cache = lru_cache(100)
    cache.put(b"a", GROUP, None, "small", 60)
    assert not cache.put(b"big", GROUP, None, "big", 101)
    assert cache.num_entries == 1 and cache.num_bytes == 60 and cache.num_evictions == 0
    assert cache.lookup(b"big", GROUP, None).level == "miss"


def test_a_zero_budget_turns_the_cache_off():
    cache = lru_cache(0, similar_threshold=DEFAULT_KV_SIMILAR_THRESHOLD)
    assert not cache.is_enabled and not cache.put(b"a", GROUP, None, "value", 0)
    assert cache.lookup(b"a", GROUP, None).level == "miss" and cache.num_entries == 0


def test_replacing_an_entry_keeps_one_copy_and_counts_its_new_size():
    cache = lru_cache(100)
    cache.put(b"a", GROUP, None, "old", 30)
    cache.put(b"a", GROUP, None, "new", 50)
    assert cache.num_entries == 1 and cache.num_bytes == 50 and cache.lookup(b"a", GROUP, None).value == "new"


@pytest.mark.slow
def test_evicted_and_cleared_values_are_freed():
    import torch

    cache = lru_cache(2 * 4096)
    first, second = torch.zeros(1024), torch.ones(1024)                    # 4096 bytes each
    first_ref, second_ref = weakref.ref(first), weakref.ref(second)
    cache.put(b"first", GROUP, None, {"keys": (first,)}, tensor_nbytes(first))
    cache.put(b"second", GROUP, None, {"keys": (second,)}, tensor_nbytes(second))
    del first, second
    gc.collect()
    assert first_ref() is not None                                         # the cache holds it

    cache.put(b"third", GROUP, None, {"keys": (torch.zeros(1024),)}, 4096)
    gc.collect()
    assert first_ref() is None and second_ref() is not None and cache.num_evictions == 1
    cache.clear()
    gc.collect()
    assert second_ref() is None and cache.num_bytes == 0 and cache.num_entries == 0


# --- levels -------------------------------------------------------------------------------------------------------

def test_exact_similar_and_miss(mail):
    cache = similar_cache()
    cache.put(b"mail", GROUP, frame_signature([mail]), "mail KV", 100)

    exact = cache.lookup(b"mail", GROUP, frame_signature([mail]))
    similar = cache.lookup(b"mail+cursor", GROUP, frame_signature([with_cursor(mail, CURSORS["I-beam 2x10 (20 px)"])]))
    miss = cache.lookup(b"editor", GROUP, frame_signature([DIFFERENT_SCREENS["other text lines"]()]))

    assert (exact.level, exact.value, exact.distance) == ("exact", "mail KV", 0.0)
    assert similar.level == "similar" and similar.value == "mail KV" and 0 < similar.distance
    assert (miss.level, miss.value) == ("miss", None)
    assert (cache.num_exact_hits, cache.num_similar_hits, cache.num_misses) == (1, 1, 1)


def test_nearest_found_while_preparing_is_used_by_the_lookup_if_still_kept(mail):
    """The similar search runs off the model thread (`nearest`); the lookup then only checks the entry is kept."""
    cache = lru_cache(250 + signature_bytes(), similar_threshold=DEFAULT_KV_SIMILAR_THRESHOLD)
    cache.put(b"mail", GROUP, frame_signature([mail]), "mail KV", 100)
    nudged = frame_signature([with_cursor(mail, CURSORS["I-beam 2x10 (20 px)"])])
    nearest = cache.nearest(GROUP, nudged)
    assert nearest is not None and nearest[0] == b"mail" and 0 < nearest[1] <= DEFAULT_KV_SIMILAR_THRESHOLD
    assert cache.nearest(GROUP, frame_signature([DIFFERENT_SCREENS["other text lines"]()])) is None

    found = cache.lookup(b"mail+cursor", GROUP, None, nearest)          # no signature: no search here
    assert (found.level, found.value, found.distance) == ("similar", "mail KV", nearest[1])
    cache.put(b"a", GROUP, None, "a", 100)
    cache.put(b"b", GROUP, None, "b", 100)                              # evicts "mail"
    assert cache.lookup(b"mail+cursor", GROUP, None, nearest).level == "miss"


def test_the_similar_search_looks_at_the_most_recent_frames_only(mail):
    from inference_worker.engines.hf.frame_cache import MAX_SIMILAR_CANDIDATES
    cache = FrameCache(max_bytes=10**8, similar_threshold=DEFAULT_KV_SIMILAR_THRESHOLD)
    cache.put(b"mail", GROUP, frame_signature([mail]), "mail KV", 1)
    other = frame_signature([DIFFERENT_SCREENS["other text lines"]()])
    for i in range(MAX_SIMILAR_CANDIDATES - 1):
        cache.put(b"other%d" % i, GROUP, other, "other KV", 1)
    assert cache.nearest(GROUP, frame_signature([mail]))[0] == b"mail"
    cache.put(b"one more", GROUP, other, "other KV", 1)                  # mail is now the 33rd most recent
    assert cache.nearest(GROUP, frame_signature([mail])) is None


def test_with_the_similar_level_off_a_near_identical_frame_misses(mail):
    cache = FrameCache(max_bytes=10 * signature_bytes(), similar_threshold=None)
    cache.put(b"mail", GROUP, frame_signature([mail]), "mail KV", 100)
    lookup = cache.lookup(b"mail+cursor", GROUP, frame_signature([with_cursor(mail, CURSORS["2x2 dot (4 px)"])]))
    assert lookup.level == "miss" and cache.num_similar_hits == 0


@pytest.mark.parametrize("cursor", CURSORS)
def test_the_default_threshold_reuses_a_frame_differing_by_a_few_pixels(mail, cursor):
    changed = with_cursor(mail, CURSORS[cursor])
    distance = frame_distance(frame_signature([mail]), frame_signature([changed]))
    assert 0 < distance <= DEFAULT_KV_SIMILAR_THRESHOLD                   # seen, and within the threshold
    cache = similar_cache()
    cache.put(b"mail", GROUP, frame_signature([mail]), "mail KV", 100)
    assert cache.lookup(b"changed", GROUP, frame_signature([changed])).level == "similar"


@pytest.mark.parametrize("other", DIFFERENT_SCREENS)
def test_the_default_threshold_never_reuses_a_different_screen(mail, other):
    other_screen = DIFFERENT_SCREENS[other]()
    assert frame_distance(frame_signature([mail]), frame_signature([other_screen])) > DEFAULT_KV_SIMILAR_THRESHOLD
    cache = similar_cache()
    cache.put(b"mail", GROUP, frame_signature([mail]), "mail KV", 100)
    assert cache.lookup(b"other", GROUP, frame_signature([other_screen])).level == "miss"


def test_frames_of_another_size_or_count_are_never_similar(mail):
    signature = frame_signature([mail])
    assert frame_distance(signature, frame_signature([mail.resize((1024, 768))])) == math.inf
    assert frame_distance(signature, frame_signature([mail, mail])) == math.inf
    assert frame_distance(frame_signature([mail, mail]), frame_signature([mail, mail])) == 0.0


def test_another_group_never_stands_in(mail):
    cache = similar_cache()
    cache.put(b"mail", b"other prompt prefix", frame_signature([mail]), "mail KV", 100)
    assert cache.lookup(b"mail+cursor", GROUP, frame_signature([mail])).level == "miss"


def test_the_closest_similar_frame_is_chosen(mail):
    two_cursors = with_cursor(with_cursor(mail, CURSORS["small arrow (~15 px)"]), CURSORS["2x2 dot (4 px)"])
    three_cursors = with_cursor(two_cursors, CURSORS["I-beam 2x10 (20 px)"])
    cache = similar_cache()
    cache.put(b"two cursors", GROUP, frame_signature([two_cursors]), "two-cursor KV", 100)
    cache.put(b"mail", GROUP, frame_signature([mail]), "mail KV", 100)            # the most recent, but farther
    lookup = cache.lookup(b"three cursors", GROUP, frame_signature([three_cursors]))
    assert lookup.level == "similar" and lookup.value == "two-cursor KV"
    assert 0 < lookup.distance < frame_distance(frame_signature([mail]), frame_signature([three_cursors]))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        FrameCache(max_bytes=-1)
    with pytest.raises(ValueError, match="similar_threshold"):
        FrameCache(max_bytes=1, similar_threshold=1.5)


# --- sizes and keys ----------------------------------------------------------------------------------------------

def test_tensor_nbytes_of_a_real_dynamic_cache(tiny_idefics3_dir):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(tiny_idefics3_dir).eval()
    processor = AutoProcessor.from_pretrained(tiny_idefics3_dir)
    inputs = processor(text=["<image>What is on this screen?"], images=[[screen()]], return_tensors="pt")
    with torch.inference_mode():
        cache = model(**inputs, use_cache=True).cache

    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == inputs["input_ids"].shape[1]
    expected = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert expected > 0 and tensor_nbytes(cache) == expected
    assert tensor_nbytes({"prefix": cache, "ids": [inputs["input_ids"]]}) == expected + inputs["input_ids"].nbytes


def test_tensor_nbytes_counts_each_storage_once_and_in_full():
    import torch

    base = torch.zeros(100, 10)                                            # 4000 bytes
    assert tensor_nbytes([base, (base,), {"again": base}]) == 4000
    assert tensor_nbytes(base[:1]) == 4000                                 # a view keeps its whole base alive
    assert tensor_nbytes(["text", 3, None]) == 0


def test_content_key_tells_tensor_contents_shapes_and_types_apart():
    import torch

    pixels = torch.rand(3, 8, 8)
    changed = pixels.clone()
    changed[0, 0, 0] += 0.5
    assert content_key(pixels, "model") == content_key(pixels.clone(), "model")
    assert len({content_key(pixels, "model"), content_key(changed, "model"), content_key(pixels, "other"),
                content_key(pixels.reshape(3, 64), "model"), content_key(pixels.double(), "model"),
                content_key("1"), content_key(1), content_key(b"1")}) == 8


def test_importing_the_cache_does_not_import_torch():
    code = "import sys, inference_worker.engines.hf.frame_cache; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- what an entry really costs ------------------------------------------------------------------------------------

def test_an_entry_counts_its_thumbnails_and_bookkeeping_beside_its_tensors(mail):
    from inference_worker.engines.hf.frame_cache import ENTRY_OVERHEAD_BYTES

    cache = FrameCache(max_bytes=10**8, similar_threshold=DEFAULT_KV_SIMILAR_THRESHOLD)
    signature = frame_signature([mail])
    assert signature.nbytes == 256 * 192 * 3 + 64 * 48 * 3 * 2  # the RGB thumbnail and its int16 cell sums
    cache.put(b"mail", GROUP, signature, "mail KV", 27_648)     # a tiny model's 16 image tokens of KV
    assert cache.num_bytes == 27_648 + signature.nbytes + ENTRY_OVERHEAD_BYTES
    cache.put(b"no signature", GROUP, None, "KV", 1000)
    assert cache.num_bytes == 27_648 + signature.nbytes + 1000 + 2 * ENTRY_OVERHEAD_BYTES
    assert not FrameCache(max_bytes=signature.nbytes).put(b"x", GROUP, signature, "KV", 1)   # does not fit


CHURN = """
import gc, json, sys
import numpy as np, psutil, torch
from PIL import Image
from transformers import DynamicCache
from inference_worker.engines.hf.frame_cache import FrameCache, frame_signature, tensor_nbytes

budget, num_entries, num_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
cache = FrameCache(budget, similar_threshold=0.002)
process = psutil.Process()

def frame(index):
    cells = np.random.default_rng(index).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(cells).resize((320, 240), Image.NEAREST)

def entry(index):
    # as batch_decode keeps a prefix: a whole prompt's cache, its first num_tokens copied out, the rest freed
    full = [(torch.randn(1, 2, num_tokens + 40, 32), torch.randn(1, 2, num_tokens + 40, 32)) for _ in range(4)]
    prefix = DynamicCache(ddp_cache_data=[(k[:, :, :num_tokens], v[:, :, :num_tokens]) for k, v in full])
    return prefix, frame_signature([frame(index)])

for index in range(20):                                  # warm up the allocator and torch
    entry(index)
gc.collect()
before = process.memory_info().rss
for index in range(num_entries):
    value, signature = entry(index)
    cache.put(index.to_bytes(8, "big"), b"group", signature, value, tensor_nbytes(value))
gc.collect()
print(json.dumps({"grown": process.memory_info().rss - before, "entries": cache.num_entries,
                  "counted": cache.num_bytes, "releases": cache.num_memory_releases,
                  "tensor_bytes": tensor_nbytes(value)}))
"""


@pytest.mark.slow
def test_rss_stays_within_the_budget_while_entries_churn():
    """A fresh process fills a 48 MB cache 5 times over with prefix caches shaped like batch_decode's: its RSS
    grows by the budget, not by the budget plus uncounted thumbnails and heap holes (before: ~2.5x)."""
    import json as json_module

    budget = 48 * 2**20
    done = subprocess.run([sys.executable, "-c", CHURN, str(budget), "1200", "64"], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json_module.loads(done.stdout.strip().splitlines()[-1])
    assert report["counted"] <= budget and report["releases"] >= 1
    grown_mb = report["grown"] / 2**20
    print(f"RSS grew {grown_mb:.1f} MB for a {budget / 2**20:.0f} MB cache: {report}")
    assert grown_mb <= budget / 2**20 * 1.10 + 8, f"RSS grew {grown_mb:.0f} MB for a 48 MB cache: {report}"


def test_the_cell_sum_bounds_never_exceed_the_full_distance_so_the_search_finds_what_a_full_scan_finds(mail):
    """The similar search compares cell sums first and skips frames they rule out; that is only right if the sums'
    share is a lower bound of frame_distance. Checked over frames from identical to unrelated, then the search
    against a full scan of every candidate."""
    import random

    import numpy as np
    from PIL import ImageDraw

    from inference_worker.engines.hf.frame_cache import frame_distance, lower_bounds

    rng = random.Random(7)
    frames = []
    for num_edits in (0, 1, 2, 4, 8, 16, 64, 256):
        frame = mail.copy()
        draw = ImageDraw.Draw(frame)
        for _ in range(num_edits):
            x, y = rng.randrange(mail.width - 40), rng.randrange(mail.height - 12)
            draw.rectangle((x, y, x + rng.randrange(2, 40), y + rng.randrange(2, 12)),
                           fill=tuple(rng.randrange(256) for _ in range(3)))
        frames.append(frame_signature([frame]))
    frames.append(frame_signature([DIFFERENT_SCREENS["other text lines"]()]))
    frames.append(frame_signature([mail.resize((1024, 768))]))              # other size: never a stand-in
    query = frame_signature([with_cursor(mail, CURSORS["I-beam 2x10 (20 px)"])])
    distances = np.array([frame_distance(query, other) for other in frames])
    bounds = lower_bounds(query, frames)
    assert np.all(bounds <= distances)
    assert np.isinf(bounds[-1])
    assert 0 < np.count_nonzero(bounds > DEFAULT_KV_SIMILAR_THRESHOLD) < len(frames)     # they rule some out, not all
    for threshold in (0.0, 0.002, 0.01, 0.05, 0.2, 1.0):
        cache = FrameCache(max_bytes=10**9, similar_threshold=threshold)
        for i, signature in enumerate(frames):
            cache.put(b"frame %d" % i, GROUP, signature, "KV", 1)
        within = [(d, -i) for i, d in enumerate(distances) if d <= threshold]   # most recent first among ties
        expected = None if not within else (b"frame %d" % -min(within)[1], min(within)[0])
        assert cache.nearest(GROUP, query) == expected, threshold


def test_cell_sums_are_each_cells_sub_cell_values_summed_per_channel():
    import numpy as np

    from inference_worker.engines.hf.frame_cache import GRID, SUBCELLS, _cell_sums

    rng = np.random.default_rng(3)
    thumbnail = rng.integers(0, 256, (GRID[1] * SUBCELLS, GRID[0] * SUBCELLS, 3), dtype=np.uint8)
    thumbnail[:SUBCELLS, :SUBCELLS] = 255                                # the largest sum a cell can have
    expected = thumbnail.astype(np.int64).reshape(GRID[1], SUBCELLS, GRID[0], SUBCELLS, 3).sum(axis=(1, 3))
    sums = _cell_sums(thumbnail)
    assert sums.dtype == np.int16 and sums.shape == (GRID[1], GRID[0], 3)
    assert np.array_equal(sums, expected) and sums[0, 0].tolist() == [16 * 255] * 3
