"""The stateless half of `prepare`: chat template, processor, prefix split and frame keys for one request,
on the calling (preprocessing) thread, or in child processes that also decode the request's images.

Why processes: the processor is mostly Python, so on a preprocessing thread it holds the GIL the model thread
needs between every torch op. On the 2-core test machine a preprocessing thread running alongside slowed each
8-row decode step of the Idefics3 fixture from ~1.0 to ~1.6-1.9 ms; a preprocessing process, at the same rate,
left it at ~0.9 ms. `PrepareProcesses` runs the same `Preprocessor` (pickled once into each child) and gives the
same PromptInputs back (tests/test_prepare_processes.py); a thread that finds no child idle encodes itself. What
depends on the engine's state (the grammar matcher, the similar-frame search) stays with the engine.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from inference_worker.engines.hf.rows import FrameKey, PromptInputs
from inference_worker.engines.options import ImageLimits
from inference_worker.protocol import ChatRequest, ImagePart, Message, SamplingParams

if TYPE_CHECKING:
    from PIL.Image import Image

#: one child's answer may take this long before the request fails (a hung child, not a slow processor)
ENCODE_TIMEOUT_S = 120.0


@dataclass
class Preprocessor:
    """Everything `encode` needs, picklable: the processor, the token each image's features replace, the model
    name (part of the frame keys) and whether frame keys are wanted (the engine keeps frame KV)."""
    processor: Any
    image_token_id: int | None
    model_name: str
    with_frame_keys: bool
    escape_text: Callable[[str], str] = field(default=str)   # special_tokens.escaper_for (str: as it is)

    def encode(self, messages: tuple[Message, ...], images: list["Image"]) -> PromptInputs:
        """One request's PromptInputs (frame key without its nearest match: the engine searches)."""
        prompt = self.processor.apply_chat_template(template_messages(messages, self.escape_text),
                                                    add_generation_prompt=True, tokenize=False)
        rgb = [img if img.mode == "RGB" else img.convert("RGB") for img in images]
        batch = dict(self.processor(text=[prompt], images=[rgb] if rgb else None, return_tensors="pt"))
        ids = batch.pop("input_ids")
        batch.pop("attention_mask", None)
        split = prefix_length(ids[0].tolist(), self.image_token_id)
        inputs = PromptInputs(ids[:, :split], ids[:, split:], batch, num_images=len(rgb))
        if rgb and self.with_frame_keys:
            inputs.frame = frame_key(self.model_name, inputs, rgb)
        return inputs


class PrepareProcesses:
    """`num_processes` spawned children, each with its own copy of the Preprocessor, that decode a request's
    images and run `encode` for the preprocessing threads: a thread takes an idle child, sends it the request
    over the child's pipe and waits (without the GIL) for the PromptInputs; with no child idle, `try_encode`
    says so and the thread encodes itself. Started and warmed up (one encode each) before the engine reports
    ready. If a child dies, `try_encode` raises PrepareProcessDied (the engine then encodes on its threads)."""

    def __init__(self, preprocessor: Preprocessor, num_processes: int, *, image_limits: ImageLimits,
                 warm_up: ChatRequest):
        if num_processes < 1:
            raise ValueError(f"num_processes must be at least 1; got {num_processes}.")
        context = multiprocessing.get_context("spawn")
        self.image_limits = image_limits
        self.num_encoded = 0              # requests the children encoded (the rest were encoded on the threads)
        self._children: list[_Child] = []
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        try:
            for _ in range(num_processes):
                self._children.append(_Child.start(context, preprocessor))
            for child in self._children:
                child.call(warm_up, image_limits)
                self._idle.put(child)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [child.process.pid for child in self._children]

    def try_encode(self, request: ChatRequest) -> PromptInputs | None:
        """The request's PromptInputs from an idle child, or None when every child is busy (the caller then
        encodes on its own thread: the children add preprocessing capacity, they never queue it); ProtocolError
        for an image images.py refuses (as the service's own decoding would say it)."""
        try:
            child = self._idle.get_nowait()
        except queue.Empty:
            return None
        try:
            inputs = child.call(request, self.image_limits)
            self.num_encoded += 1
            return inputs
        finally:
            self._idle.put(child)

    def close(self, timeout_s: float = 5.0) -> None:
        for child in self._children:
            child.stop(timeout_s)


class PrepareProcessDied(RuntimeError):
    """A preprocessing child exited (killed, out of memory) or stopped answering."""


@dataclass
class _Child:
    process: Any                 # multiprocessing.Process
    connection: Any              # our end of its pipe

    @classmethod
    def start(cls, context: Any, preprocessor: Preprocessor) -> "_Child":
        ours, theirs = context.Pipe()
        process = context.Process(target=_child_main, args=(theirs, preprocessor), name="deskeye-prepare",
                                  daemon=True)
        try:
            process.start()           # pickles the Preprocessor into the child
        finally:
            theirs.close()
        return cls(process, ours)

    def call(self, request: ChatRequest, image_limits: ImageLimits) -> PromptInputs:
        try:
            self.connection.send((request, image_limits))
            if not self.connection.poll(ENCODE_TIMEOUT_S):
                self.process.kill()
                raise PrepareProcessDied(f"no answer in {ENCODE_TIMEOUT_S:.0f} s (the child was stopped)")
            is_ok, value = self.connection.recv()
        except (EOFError, OSError) as exc:
            raise PrepareProcessDied(f"exit code {self.process.exitcode}") from exc
        if not is_ok:
            raise value
        return _from_wire(value)

    def stop(self, timeout_s: float) -> None:
        try:
            self.connection.send(None)
        except OSError:
            pass                  # gone already
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
        self.connection.close()


# ------------------------------------------------------------ in the child

def _child_main(connection: Any, preprocessor: Preprocessor) -> None:
    """A child's loop: (request, image limits) in, (True, PromptInputs) or (False, exception) out; None ends
    it, and so does the parent's end of the pipe closing."""
    from inference_worker.images import TRIM_AFTER_PIXELS, release_freed_memory

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl+C in the worker's terminal: the parent stops us
    torch.set_num_threads(1)              # a request's images are small work; the cores belong to the model
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        request, image_limits = message
        images = []
        try:
            images = image_limits.decode(request)
            answer = (True, _to_wire(preprocessor.encode(request.messages, images)))
        except Exception as exc:  # noqa: BLE001 - that request's answer, raised again in the parent
            answer = (False, _picklable(exc))
        connection.send(answer)
        num_pixels = sum(image.width * image.height for image in images)
        images = answer = message = request = None      # freed now, not when the next request arrives
        if num_pixels >= TRIM_AFTER_PIXELS:
            release_freed_memory()        # and their pages handed back to the OS


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception that cannot travel is told as text
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _to_wire(inputs: PromptInputs) -> PromptInputs:
    """Tensors as numpy arrays, so they travel by value in the pickle (a torch tensor would go through shared
    memory and a file-descriptor handshake per tensor, slower for a request's few small tensors)."""
    inputs.prefix_ids, inputs.suffix_ids = inputs.prefix_ids.numpy(), inputs.suffix_ids.numpy()
    inputs.vision = {name: _array(value) for name, value in inputs.vision.items()}
    return inputs


def _from_wire(inputs: PromptInputs) -> PromptInputs:
    inputs.prefix_ids, inputs.suffix_ids = torch.from_numpy(inputs.prefix_ids), torch.from_numpy(inputs.suffix_ids)
    inputs.vision = {name: _tensor(value) for name, value in inputs.vision.items()}
    return inputs


def _array(value: Any) -> Any:
    try:
        return _NumpyTensor(value.numpy()) if torch.is_tensor(value) else value
    except TypeError:                     # a dtype numpy lacks (bfloat16): the tensor itself
        return value


def _tensor(value: Any) -> Any:
    return torch.from_numpy(value.array) if isinstance(value, _NumpyTensor) else value


@dataclass
class _NumpyTensor:
    """A tensor on the wire (marks it apart from a numpy array the processor itself returned)."""
    array: Any


# ------------------------------------------------------------ the pieces

def warm_up_request() -> ChatRequest:
    """An 800x600 white frame and a question: what each child encodes before the engine reports ready."""
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (800, 600), "white").save(png, format="PNG")
    message = Message("user", (ImagePart(png.getvalue(), "image/png"), "What is on this screen?"))
    return ChatRequest(model="warm-up", messages=(message,), sampling=SamplingParams(max_tokens=1))


def template_messages(messages: tuple[Message, ...],
                      escape_text: Callable[[str], str] = lambda text: text) -> list[dict[str, Any]]:
    """Protocol messages -> chat-template messages; each image becomes the template's image placeholder and
    each text part goes through `escape_text` (so it cannot spell the model's special tokens)."""
    return [{"role": m.role,
             "content": [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": escape_text(p)}
                         for p in m.parts]}
            for m in messages]


def image_token_id(config: Any, tokenizer: Any, processor: Any) -> int | None:
    """The id of the token each image's features replace (config, else the processor's image token)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    token = getattr(processor, "image_token", None)
    return tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None


def prefix_length(ids: list[int], image_token: int | None) -> int:
    """Where a prompt splits into the frame prefix (through its last image token) and the suffix; 0 without
    images. The suffix keeps at least one token (the first token's logits come from its last position)."""
    last = max((i for i, t in enumerate(ids) if t == image_token), default=-1) if image_token is not None else -1
    return min(last + 1, len(ids) - 1)


def frame_key(model_name: str, inputs: PromptInputs, images: list["Image"]) -> FrameKey:
    """Keys of a prompt's prefix in the FrameCache: the exact key hashes the preprocessed pixels, the prefix
    token ids and the model; the group key (who may stand in for whom) the same without the pixel values."""
    from inference_worker.engines.hf.content_key import content_key
    from inference_worker.engines.hf.frame_cache import frame_signature

    tensors = {name: value for name, value in inputs.vision.items() if torch.is_tensor(value)}
    layout = {name: f"{tuple(value.shape)}{value.dtype}" for name, value in tensors.items()}
    return FrameKey(exact_key=content_key(model_name, inputs.prefix_ids, tensors),
                    group_key=content_key(model_name, inputs.prefix_ids, layout),
                    signature=frame_signature(images))
