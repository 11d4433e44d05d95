"""Keys of content: a digest of tensors, bytes, text, numbers and nested lists, tuples and dicts, for the frame
cache's `exact_key`s and `group_key`s (frame_cache.py). A tensor of a megabyte or more is hashed once while it lives
unchanged: the pixel values of a frame that the image processor's cache (image_features.py) serves again are the
same tensor objects, and hashing them again cost 16 ms a request at real size."""

from __future__ import annotations

import hashlib
import weakref
from typing import Any


def content_key(*parts: Any) -> bytes:
    """A 32-byte digest of tensors (shape, dtype and values), bytes, strings, numbers and nested lists/tuples/dicts:
    the way to build `exact_key`s and `group_key`s."""
    digest = hashlib.sha256()                  # hardware-accelerated on most CPUs: ~1.1 GB/s measured here
    _feed(digest, parts)
    return digest.digest()


def _feed(digest, part: Any) -> None:
    if isinstance(part, (list, tuple)):
        digest.update(b"[%d" % len(part))
        for item in part:
            _feed(digest, item)
    elif isinstance(part, dict):
        _feed(digest, sorted(part.items(), key=lambda kv: str(kv[0])))
    elif isinstance(part, (bytes, bytearray)):
        digest.update(b"b%d:" % len(part) + bytes(part))
    elif isinstance(part, (str, int, float, bool)) or part is None:
        digest.update(f"{type(part).__name__}:{part!r};".encode())
    else:
        _feed_tensor(digest, part)


#: a tensor of at least this many bytes is hashed once while it lives unchanged (its digest kept by identity and
#: in-place version): the pixel values of a frame the image processor cache (image_features.py) serves again are
#: the same tensors, ~15 MB for 800x600 on the real-size stand-in, 16 ms to hash
MEMO_MIN_BYTES = 1 << 20
_tensor_digests: dict[int, tuple[Any, int, bytes]] = {}      # id(tensor) -> (weak reference, version, digest)


def _feed_tensor(digest, tensor: Any) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"content_key cannot hash a {type(tensor).__name__}")
    digest.update(f"t{tuple(tensor.shape)}{tensor.dtype}:".encode())
    if tensor.numel() * tensor.element_size() < MEMO_MIN_BYTES:
        digest.update(_tensor_bytes(tensor))                       # hashed in place, no copy
    else:
        digest.update(b"sha256:" + _tensor_digest(tensor))


def _tensor_bytes(tensor: Any) -> Any:
    import torch

    return tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy()


def _tensor_digest(tensor: Any) -> bytes:
    """sha256 of the tensor's bytes, kept while the tensor lives and is not changed in place."""
    try:
        key, version = id(tensor), tensor._version
    except RuntimeError:                          # an inference-mode tensor counts no versions: hashed each time
        return hashlib.sha256(_tensor_bytes(tensor)).digest()
    kept = _tensor_digests.get(key)
    if kept is not None and kept[0]() is tensor and kept[1] == version:
        return kept[2]
    value = hashlib.sha256(_tensor_bytes(tensor)).digest()

    def forget(ref: Any, key: int = key) -> None:
        if _tensor_digests.get(key, (None,))[0] is ref:
            _tensor_digests.pop(key, None)
    _tensor_digests[key] = (weakref.ref(tensor, forget), version, value)
    return value
