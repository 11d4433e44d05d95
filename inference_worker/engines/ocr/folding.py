"""The OCR models' graphs with their per-pixel passes folded away: the same function, ~25% less CPU.

PP-OCRv4's detector and recogniser share a backbone (PPLCNetV3) that wraps each convolution in "learnable
affine blocks": a scalar Mul and Add after the convolution and again after its hard-swish, which Paddle's
exporter writes as four more ops (Add 3, Clip 0..6, Mul, Div 6). Each is a pass over the whole feature map:
in the wheel's recogniser they took 28% of the time. Three exact rewrites remove them:

1. conv -> Mul(a) -> Add(b)              == conv with weights * a and bias * a + b
2. x * Clip(x + 3, 0, 6) / 6             == x * HardSigmoid(x; 1/6, 1/2)  (onnxruntime fuses it into the conv)
3. Mul(c) -> Add(d) -> conv              == conv with weights * c and bias + d * sum(weights) when the conv
                                            has no padding; with padding, the Add (d / c) stays before it
                                            (a padded border is zero, not d)

They change the result only by float rounding (tests/test_ocr_models.py compares both models on rendered text:
the same texts, scores within 1e-4, the same boxes). The models are rewritten in memory when the reader loads
(~0.1 s each; nothing is written to disk: the engine keeps nothing under HOME); without the `onnx` package the
wheel's models run as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("inference_worker")


@dataclass
class Simplified:
    model_bytes: bytes
    num_conv_affines: int = 0        # rewrite 1
    num_hard_swishes: int = 0        # rewrite 2
    num_input_affines: int = 0       # rewrite 3

    @property
    def num_rewrites(self) -> int:
        return self.num_conv_affines + self.num_hard_swishes + self.num_input_affines


def simplified_model(model_path: Path) -> Simplified | None:
    """The model at `model_path` with the rewrites above, serialised; None when onnx is not installed."""
    try:
        import onnx
    except ImportError:
        log.warning("the onnx package is not installed: the OCR models run as shipped (~25%% slower)")
        return None
    try:
        model = onnx.load(str(model_path))
        graph = _Graph(model.graph)
        counts = (graph.fold_conv_affines(), graph.shorten_hard_swishes(), graph.fold_input_affines())
        graph.commit()
        return Simplified(model.SerializeToString(), *counts)
    except Exception as exc:  # noqa: BLE001 - an optimisation: a graph it cannot rewrite runs as shipped
        log.warning("cannot simplify the OCR model %s (%s: %s); it runs as shipped", model_path.name,
                    type(exc).__name__, exc)
        return None


@dataclass
class _Graph:
    """A mutable view of an ONNX graph: its nodes (one list of the same Python objects throughout, so that they can
    be told apart by id()), constants by name, consumers of each tensor, and the edits to commit."""
    proto: Any
    nodes: list = field(default_factory=list)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    consumers: dict[str, list] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)          # id() of nodes to drop
    replaced: dict[int, list] = field(default_factory=dict)  # id() of a node -> the nodes that take its place
    renamed: dict[str, str] = field(default_factory=dict)   # tensor -> the tensor that now carries its value

    def __post_init__(self):
        from onnx import numpy_helper

        self.nodes = list(self.proto.node)
        for node in self.nodes:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self.consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        for tensor in self.proto.initializer:
            self.consts[tensor.name] = numpy_helper.to_array(tensor)

    # ------------------------------------------------------------ the three rewrites

    def fold_conv_affines(self) -> int:
        """conv -> Mul(a) -> Add(b): the scale and shift go into the conv's weights and bias."""
        done = 0
        for conv in self._live("Conv"):
            affine = self._affine_after(conv.output[0])
            weights, bias = self._weights(conv)
            if affine is None or weights is None:
                continue
            mul, add, scale, shift = affine
            self._set_weights(conv, weights * scale, bias * scale + shift)
            self.renamed[add.output[0]] = conv.output[0]
            self.removed.update((id(mul), id(add)))
            done += 1
        return done

    def shorten_hard_swishes(self) -> int:
        """x * Clip(x + 3, 0, 6) / 6 -> x * HardSigmoid(x, alpha=1/6, beta=1/2)."""
        from onnx import helper

        done = 0
        for plus in self._live("Add"):
            found = self._hard_swish_from(plus)
            if found is None:
                continue
            x, chain = found
            out = chain[-1].output[0]
            gate = helper.make_node("HardSigmoid", [x], [out + "/gate"], alpha=1 / 6, beta=0.5)
            self.replaced[id(chain[-1])] = [gate, helper.make_node("Mul", [x, out + "/gate"], [out])]
            self.removed.update(id(node) for node in [plus, *chain[:-1]])
            done += 1
        return done

    def fold_input_affines(self) -> int:
        """Mul(c) -> Add(d) -> conv: the scale goes into the conv's weights; the shift into its bias when the
        conv has no padding, else it stays before the conv as Add(d / c)."""
        done = 0
        for mul in self._live("Mul"):
            found = self._input_affine_from(mul)
            if found is None:
                continue
            x, add, conv, scale, shift = found
            weights, bias = self._weights(conv)
            if _is_padded(conv):
                self._set_weights(conv, weights * scale, bias)
                add.input[:] = [x, self._tensor(np.array(shift / scale, np.float32), add.output[0] + "/shift")]
                self.removed.add(id(mul))
            else:
                self._set_weights(conv, weights * scale, bias + shift * weights.sum(axis=(1, 2, 3)))
                self.renamed[add.output[0]] = x
                self.removed.update((id(mul), id(add)))
            done += 1
        return done

    # ------------------------------------------------------------ patterns

    def _affine_after(self, tensor: str):
        """(Mul, Add, a, b) when `tensor` feeds only Mul(scalar a), which feeds only Add(scalar b)."""
        mul = self._only_consumer(tensor, "Mul")
        add = self._only_consumer(mul.output[0], "Add") if mul is not None else None
        if add is None or self._is_output(add.output[0]):
            return None
        scale, shift = self._scalar_operand(mul, tensor), self._scalar_operand(add, mul.output[0])
        if scale is None or shift is None:
            return None
        return mul, add, scale, shift

    def _hard_swish_from(self, plus):
        """(x, [Clip, Mul, Div]) when `plus` is Add(x, 3) -> Clip(0, 6) -> Mul(x, .) -> Div(6)."""
        operands = [name for name in plus.input if self._scalar(name) != 3.0]
        if len(plus.input) != 2 or len(operands) != 1:
            return None
        x = operands[0]
        clip = self._only_consumer(plus.output[0], "Clip")
        if clip is None or len(clip.input) != 3 or (self._scalar(clip.input[1]), self._scalar(clip.input[2])) != (0, 6):
            return None
        mul = self._only_consumer(clip.output[0], "Mul")
        if mul is None or sorted(mul.input) != sorted([x, clip.output[0]]):
            return None
        div = self._only_consumer(mul.output[0], "Div")
        if div is None or div.input[0] != mul.output[0] or self._scalar(div.input[1]) != 6.0:
            return None
        return x, [clip, mul, div]

    def _input_affine_from(self, mul):
        """(x, Add, Conv, c, d) when `mul` is Mul(x, scalar c != 0) -> Add(scalar d) -> the data input of a conv."""
        tensors = [name for name in mul.input if self._scalar(name) is None]
        if len(mul.input) != 2 or len(tensors) != 1:
            return None
        add = self._only_consumer(mul.output[0], "Add")
        conv = self._only_consumer(add.output[0], "Conv") if add is not None else None
        if conv is None or conv.input[0] != add.output[0] or self._weights(conv)[0] is None:
            return None
        scale, shift = self._scalar_operand(mul, tensors[0]), self._scalar_operand(add, mul.output[0])
        if not scale or shift is None:
            return None
        return tensors[0], add, conv, scale, shift

    # ------------------------------------------------------------ helpers

    def _live(self, op_type: str) -> list:
        return [node for node in self.nodes if node.op_type == op_type and id(node) not in self.removed]

    def _only_consumer(self, tensor: str, op_type: str):
        users = [node for node in self.consumers.get(tensor, []) if id(node) not in self.removed]
        if len(users) != 1 or users[0].op_type != op_type or self._is_output(tensor):
            return None
        return users[0]

    def _is_output(self, tensor: str) -> bool:
        return any(out.name == tensor for out in self.proto.output)

    def _scalar(self, name: str) -> float | None:
        value = self.consts.get(name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    def _scalar_operand(self, node, tensor: str) -> float | None:
        """The scalar constant that binary `node` combines with `tensor`, None when it is not one."""
        others = [name for name in node.input if name != tensor]
        return self._scalar(others[0]) if len(node.input) == 2 and len(others) == 1 else None

    def _weights(self, conv) -> tuple[np.ndarray | None, np.ndarray | None]:
        weights = self.consts.get(conv.input[1]) if len(conv.input) > 1 else None
        if weights is None or weights.dtype != np.float32 or weights.ndim != 4:
            return None, None
        bias = self.consts.get(conv.input[2]) if len(conv.input) > 2 else np.zeros(weights.shape[0], np.float32)
        return (weights, bias) if bias is not None else (None, None)

    def _set_weights(self, conv, weights: np.ndarray, bias: np.ndarray) -> None:
        conv.input[1] = self._tensor(weights, conv.output[0] + "/weights")
        name = self._tensor(bias, conv.output[0] + "/bias")
        if len(conv.input) > 2:
            conv.input[2] = name
        else:
            conv.input.append(name)

    def _tensor(self, value: np.ndarray, base: str) -> str:
        name = base
        while name in self.consts:
            name += "'"
        self.consts[name] = np.asarray(value, np.float32)
        return name

    def commit(self) -> None:
        """Apply the edits: nodes dropped or replaced, inputs renamed, constants as initialisers (unused ones gone)."""
        from onnx import numpy_helper

        nodes = []
        for node in self.nodes:
            if id(node) in self.replaced:
                nodes.extend(self.replaced[id(node)])
            elif id(node) not in self.removed and not (node.op_type == "Constant" and node.output[0] in self.consts):
                nodes.append(node)              # constants held as arrays become initialisers below
        for node in nodes:
            for i, name in enumerate(node.input):
                node.input[i] = self._resolved(name)
        used = {name for node in nodes for name in node.input}
        initialisers = [numpy_helper.from_array(value, name) for name, value in self.consts.items() if name in used]
        del self.proto.node[:]
        self.proto.node.extend(nodes)
        del self.proto.initializer[:]
        self.proto.initializer.extend(initialisers)

    def _resolved(self, name: str) -> str:
        while name in self.renamed:
            name = self.renamed[name]
        return name


def _is_padded(conv) -> bool:
    from onnx import helper

    for attribute in conv.attribute:
        if attribute.name == "pads" and any(helper.get_attribute_value(attribute)):
            return True
        if attribute.name == "auto_pad" and helper.get_attribute_value(attribute) not in (b"NOTSET", b"VALID"):
            return True
    return False
