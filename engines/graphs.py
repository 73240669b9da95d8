"""Whisper's encoder and decoder as ONNX graphs, built straight from the numpy weights.

Built here rather than exported from PyTorch so that a fresh install needs neither torch nor CUDA.
The graphs take dynamic shapes, which is what lets one worker batch students together:
  encoder:  mel [batch, 80, frames]      -> per decoder layer i: cross_k_i, cross_v_i [batch, heads, ctx, head_dim]
  decoder:  tokens [batch, n], per layer: self_k_i/self_v_i [batch, heads, past, head_dim], cross_k_i/v_i
            -> logits [batch, vocab] (last position only), per layer: new_self_k_i/v_i (past + n)
One tensor per layer rather than one stacked tensor: slicing a layer out of a stacked input
copies it, and copying every layer's cross K/V on every step costs more than the step's math.
The cross-attention keys and values are projected once per utterance in the encoder graph;
each decoder step only adds its own positions to the self-attention cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # onnx takes most of a second to import: only a build (a cache miss) imports it
    import onnx

from engines.cache import cache_dir
from engines.weights import Weights

# Bump when the graphs change shape or meaning: it is part of the cache key.
GRAPH_VERSION = 8
OPSET = 17
NEG_INF = -1e9  # finite, so that a fully masked row cannot turn into NaN


INT8_BLOCK = 32  # weights share one scale per 32 input channels


def int8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 8-bit blockwise weights for ONNX Runtime's MatMulNBits: w (out, in) ->
    uint8 [out, in/32, 32] offset by 128 (its implied zero point) and float32 scales [out * in/32]."""
    blocks = w.reshape(w.shape[0], -1, INT8_BLOCK)
    scale = np.abs(blocks).max(axis=-1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.round(blocks / scale[..., None]), -127, 127) + 128
    return q.astype(np.uint8), scale.astype(np.float32).reshape(-1)


def int8_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weights with one scale per output channel: w (out, in) -> int8 (in, out), scales (out,)."""
    scale = np.abs(w).max(axis=1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8)
    return q.T.copy(), scale.astype(np.float32)


@dataclass(frozen=True)
class Flavour:
    """What a graph may use. The portable graph is standard ONNX (for TensorRT and as the
    reference); ONNX Runtime's graphs add its fused attention and int8 kernels."""

    name: str
    fused_attention: bool  # com.microsoft MultiHeadAttention, BiasGelu: same math, fewer passes
    int8: bool


FLAVOURS = {
    "portable": Flavour("portable", False, False),
    "fp32": Flavour("fp32", True, False),
    "int8": Flavour("int8", True, True),
}


class _Builder:
    """A thin layer over onnx.helper: one method per op, returning the output name."""

    def __init__(self, tensors: dict[str, np.ndarray], flavour: Flavour, many_rows: bool) -> None:
        self.tensors = tensors
        self.flavour = flavour
        self.many_rows = many_rows  # encoder: thousands of rows a call; decoder: one per utterance
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._count = 0

    def const(self, value: np.ndarray, name: str | None = None) -> str:
        from onnx import numpy_helper

        name = name or f"c{len(self.initializers)}"
        if name not in self._names:
            self._names.add(name)
            self.initializers.append(numpy_helper.from_array(np.array(value, order="C"), name))  # keeps 0-d scalars 0-d)
        return name

    def weight(self, key: str) -> str:
        return self.const(self.tensors[key].astype(np.float32), key)

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs: object) -> str | list[str]:
        from onnx import helper

        self._count += 1
        names = [f"{op_type.lower()}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64), "i64_" + "_".join(str(v).replace("-", "m") for v in values))

    # --- layers ---------------------------------------------------------------------------
    def linear(self, x: str, prefix: str, rows: slice | None = None, scale: float = 1.0) -> str:
        """x @ W.T + b, optionally with a slice of the fused output rows (q, k or v)."""
        w = self.tensors[prefix + "/weight"].astype(np.float32)
        b = self.tensors[prefix + "/bias"].astype(np.float32)
        if rows is not None:
            w, b = w[rows], b[rows]
        tag = "" if rows is None else f"[{rows.start}:{rows.stop}]"
        y = self.project(x, w * scale, f"{prefix}/W{tag}")
        if not np.any(b):
            return y  # Whisper's key projections have no bias; CT2 stores zeros
        return self.op("Add", y, self.const(b * scale, f"{prefix}/b{tag}"))

    def project(self, x: str, w: np.ndarray, name: str) -> str:
        """x @ w.T for a weight w (out, in): fp32 MatMul, or with int8 weights.

        A decoder step (a few rows) is bound by reading weights: MatMulNBits, whose activations
        are quantized per row, so a row's result does not depend on the rest of the batch (a
        per-tensor scale would make one student's transcript depend on who else is speaking).
        The encoder (thousands of rows) is bound by arithmetic: DynamicQuantizeMatMul, which
        reaches the CPU's int8 matrix units.
        """
        from onnx import helper

        if not self.flavour.int8:
            return self.op("MatMul", x, self.const(w.T.copy(), name))
        if self.many_rows:
            return self._project_rows_int8(x, w, name)
        q, scales = int8_blocks(w)
        n, k = w.shape
        inputs = (x, self.const(q, name + ".q8"), self.const(scales, name + ".scales"))
        self._count += 1
        out = f"matmulnbits_{self._count}"
        self.nodes.append(
            helper.make_node(
                "MatMulNBits", list(inputs), [out], domain="com.microsoft",
                K=k, N=n, bits=8, block_size=INT8_BLOCK, accuracy_level=4,
            )
        )
        return out

    def _project_rows_int8(self, x: str, w: np.ndarray, name: str) -> str:
        # Activations are quantized per tensor here, so the ONNX Runtime backend runs this
        # graph one utterance at a time (the encoder is arithmetic-bound on a CPU: batching it
        # bought nothing), which keeps every utterance's result independent of the others.
        q, w_scale = int8_columns(w)
        return self.op(
            "DynamicQuantizeMatMul", x, self.const(q, name + ".i8"), self.const(w_scale, name + ".colscale"),
            domain="com.microsoft",
        )

    def self_attention(self, h: str, prefix: str, n_heads: int, width: int) -> str:
        """Encoder self-attention over all frames (no mask), fused where the flavour allows."""
        hd = width // n_heads
        if self.flavour.fused_attention:
            q, k, v = (self.linear(h, prefix + "/linear_0", slice(i * width, (i + 1) * width)) for i in range(3))
            out = self.op("MultiHeadAttention", q, k, v, domain="com.microsoft", num_heads=n_heads)
            return self.linear(out, prefix + "/linear_1")
        q = self.heads(self.linear(h, prefix + "/linear_0", slice(0, width), hd**-0.5), n_heads, hd)
        k = self.heads(self.linear(h, prefix + "/linear_0", slice(width, 2 * width)), n_heads, hd, (0, 2, 3, 1))
        v = self.heads(self.linear(h, prefix + "/linear_0", slice(2 * width, 3 * width)), n_heads, hd)
        return self.linear(self.merge_heads(self.attend(q, k, v), width), prefix + "/linear_1")

    def layer_norm(self, x: str, prefix: str) -> str:
        gamma, beta = self.weight(prefix + "/gamma"), self.weight(prefix + "/beta")
        return self.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-5)

    def gelu(self, x: str) -> str:
        # Exact (erf) GELU as Whisper uses; ONNX Runtime fuses this pattern into one kernel.
        inner = self.op("Erf", self.op("Mul", x, self.const(np.array(1 / math.sqrt(2), np.float32), "rsqrt2")))
        half = self.op("Mul", x, self.const(np.array(0.5, np.float32), "half"))
        return self.op("Mul", half, self.op("Add", inner, self.const(np.array(1.0, np.float32), "one")))

    def mlp(self, x: str, prefix: str) -> str:
        h = self.layer_norm(x, prefix + "/layer_norm")
        if self.flavour.fused_attention:
            # ONNX Runtime's BiasGelu: bias add and exact GELU in one pass over the 4x-wide
            # activations (it did not fuse the erf pattern by itself).
            w = self.tensors[prefix + "/linear_0/weight"].astype(np.float32)
            b = self.tensors[prefix + "/linear_0/bias"].astype(np.float32)
            hidden = self.op(
                "BiasGelu", self.project(h, w, prefix + "/linear_0/W"), self.const(b, prefix + "/linear_0/b"),
                domain="com.microsoft",
            )
        else:
            hidden = self.gelu(self.linear(h, prefix + "/linear_0"))
        return self.linear(hidden, prefix + "/linear_1")

    def heads(self, x: str, n_heads: int, head_dim: int, perm: tuple[int, ...] = (0, 2, 1, 3)) -> str:
        """[B, T, d] -> [B, H, T, hd] (or [B, H, hd, T] with perm (0, 2, 3, 1), a transposed key)."""
        split = self.op("Reshape", x, self.ints(0, -1, n_heads, head_dim))
        return self.op("Transpose", split, perm=list(perm))

    def merge_heads(self, x: str, width: int) -> str:
        return self.op("Reshape", self.op("Transpose", x, perm=[0, 2, 1, 3]), self.ints(0, -1, width))

    def attend(self, q: str, k_t: str, v: str, mask: str | None = None) -> str:
        """softmax(q k^T + mask) v with q pre-scaled by 1/sqrt(head_dim) in its weights."""
        scores = self.op("MatMul", q, k_t)
        if mask is not None:
            scores = self.op("Add", scores, mask)
        return self.op("MatMul", self.op("Softmax", scores, axis=-1), v)

    def model(self, inputs: list[onnx.ValueInfoProto], outputs: dict[str, str], out_info: list[onnx.ValueInfoProto], name: str) -> onnx.ModelProto:
        from onnx import helper

        for out_name, node_output in outputs.items():
            self.nodes.append(helper.make_node("Identity", [node_output], [out_name]))
        graph = helper.make_graph(self.nodes, name, inputs, out_info, self.initializers)
        contrib = self.flavour.int8 or self.flavour.fused_attention
        opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
        model = helper.make_model(graph, opset_imports=opsets, producer_name="streamserver")
        model.ir_version = 8
        return model


def _f32(name: str, shape: list[str | int]) -> onnx.ValueInfoProto:
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def build_encoder(weights: Weights, flavour: Flavour = FLAVOURS["portable"]) -> onnx.ModelProto:
    d = weights.dims
    hd = d.n_audio_state // d.n_heads
    g = _Builder(weights.tensors, flavour, many_rows=True)
    conv1 = g.op("Conv", "mel", g.weight("encoder/conv1/weight"), g.weight("encoder/conv1/bias"), pads=[1, 1])
    conv2 = g.op("Conv", g.gelu(conv1), g.weight("encoder/conv2/weight"), g.weight("encoder/conv2/bias"), pads=[1, 1], strides=[2])
    x = g.op("Transpose", g.gelu(conv2), perm=[0, 2, 1])
    # Frames shorter than 30 s use the first ctx rows of the positional table (dynamic-length input).
    ctx = g.op("Gather", g.op("Shape", x), g.ints(1))
    positions = g.op("Slice", g.weight("encoder/position_encodings/encodings"), g.ints(0), ctx, g.ints(0))
    x = g.op("Add", x, positions)
    for i in range(d.n_audio_layer):
        p = f"encoder/layer_{i}"
        h = g.layer_norm(x, p + "/self_attention/layer_norm")
        x = g.op("Add", x, g.self_attention(h, p + "/self_attention", d.n_heads, d.n_audio_state))
        x = g.op("Add", x, g.mlp(x, p + "/ffn"))
    x = g.layer_norm(x, "encoder/layer_norm")
    ks, vs = [], []
    w = d.n_audio_state
    for i in range(d.n_text_layer):
        p = f"decoder/layer_{i}/attention/linear_1"
        ks.append(g.heads(g.linear(x, p, slice(0, w)), d.n_heads, hd))
        vs.append(g.heads(g.linear(x, p, slice(w, 2 * w)), d.n_heads, hd))
    outputs = {**{f"cross_k_{i}": k for i, k in enumerate(ks)}, **{f"cross_v_{i}": v for i, v in enumerate(vs)}}
    out_info = [_f32(name, ["batch", d.n_heads, "ctx", hd]) for name in outputs]
    return g.model([_f32("mel", ["batch", d.n_mels, "frames"])], outputs, out_info, "whisper_encoder")


AttentionStep = Callable[["_Builder", str, int, int, int], tuple[str, str, str]]


def _plain_decoder_attention(g: "_Builder", positions: str, total: str) -> AttentionStep:
    """Causal self-attention over the cache in standard ops (the portable graph)."""
    # Position p of the new tokens sees keys at positions <= p.
    steps = g.const(np.array(1, np.int64), "i64_step")
    all_positions = g.op("Range", g.const(np.array(0, np.int64), "i64_zero"), g.op("Squeeze", total, g.ints(0)), steps)
    later = g.op("Greater", g.op("Unsqueeze", all_positions, g.ints(0)), g.op("Unsqueeze", positions, g.ints(1)))
    mask = g.op("Where", later, g.const(np.array(NEG_INF, np.float32), "neg_inf"), g.const(np.array(0.0, np.float32), "zero"))

    def attend(g: _Builder, h: str, i: int, n_heads: int, width: int) -> tuple[str, str, str]:
        hd = width // n_heads
        prefix = f"decoder/layer_{i}/self_attention/linear_0"
        q = g.heads(g.linear(h, prefix, slice(0, width), hd**-0.5), n_heads, hd)
        k = g.heads(g.linear(h, prefix, slice(width, 2 * width)), n_heads, hd)
        v = g.heads(g.linear(h, prefix, slice(2 * width, 3 * width)), n_heads, hd)
        k_all = g.op("Concat", f"self_k_{i}", k, axis=2)
        v_all = g.op("Concat", f"self_v_{i}", v, axis=2)
        out = g.attend(q, g.op("Transpose", k_all, perm=[0, 1, 3, 2]), v_all, mask)
        return g.merge_heads(out, width), k_all, v_all

    return attend


def _fused_decoder_attention(g: "_Builder", h: str, i: int, n_heads: int, width: int) -> tuple[str, str, str]:
    """ONNX Runtime's MultiHeadAttention with the cache as past/present, causal over it."""
    prefix = f"decoder/layer_{i}/self_attention/linear_0"
    q, k, v = (g.linear(h, prefix, slice(j * width, (j + 1) * width)) for j in range(3))
    out, k_all, v_all = g.op(
        "MultiHeadAttention", q, k, v, "", "", "", f"self_k_{i}", f"self_v_{i}",
        outputs=3, domain="com.microsoft", num_heads=n_heads, unidirectional=1,
    )
    return out, k_all, v_all


def _cross_attention(g: "_Builder", h: str, i: int, n_heads: int, width: int) -> str:
    """Attention to the encoder output, whose keys/values were projected once per utterance."""
    hd = width // n_heads
    prefix = f"decoder/layer_{i}/attention/linear_0"
    if g.flavour.fused_attention:
        q = g.linear(h, prefix)
        return g.op("MultiHeadAttention", q, f"cross_k_{i}", f"cross_v_{i}", domain="com.microsoft", num_heads=n_heads)
    q = g.heads(g.linear(h, prefix, scale=hd**-0.5), n_heads, hd)
    k_t = g.op("Transpose", f"cross_k_{i}", perm=[0, 1, 3, 2])
    return g.merge_heads(g.attend(q, k_t, f"cross_v_{i}"), width)


def build_decoder(weights: Weights, flavour: Flavour = FLAVOURS["portable"]) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    d = weights.dims
    w = d.n_audio_state
    hd = w // d.n_heads
    g = _Builder(weights.tensors, flavour, many_rows=False)
    embed = g.weight("decoder/embeddings/weight")
    past = g.op("Gather", g.op("Shape", "self_k_0"), g.ints(2))  # [1]
    n_new = g.op("Gather", g.op("Shape", "tokens"), g.ints(1))
    total = g.op("Add", past, n_new)
    scalar = lambda t: g.op("Squeeze", t, g.ints(0))  # noqa: E731 - Range wants scalars
    positions = g.op("Range", scalar(past), scalar(total), g.const(np.array(1, np.int64), "i64_step"))
    x = g.op("Add", g.op("Gather", embed, "tokens"), g.op("Gather", g.weight("decoder/position_encodings/encodings"), positions))
    attend = _fused_decoder_attention if flavour.fused_attention else _plain_decoder_attention(g, positions, total)
    new_k, new_v = [], []
    for i in range(d.n_text_layer):
        p = f"decoder/layer_{i}"
        h = g.layer_norm(x, p + "/self_attention/layer_norm")
        out, k_all, v_all = attend(g, h, i, d.n_heads, w)
        new_k.append(k_all)
        new_v.append(v_all)
        x = g.op("Add", x, g.linear(out, p + "/self_attention/linear_1"))
        h = g.layer_norm(x, p + "/attention/layer_norm")
        x = g.op("Add", x, g.linear(_cross_attention(g, h, i, d.n_heads, w), p + "/attention/linear_2"))
        x = g.op("Add", x, g.mlp(x, p + "/ffn"))
    last = g.op("Gather", x, g.const(np.array(-1, np.int64), "i64_last"), axis=1)  # only the next token is needed
    # The output projection is tied to the token embedding; at batch 1 reading it is most of a step.
    table = weights.tensors["decoder/embeddings/weight"].astype(np.float32)
    logits = g.project(g.layer_norm(last, "decoder/layer_norm"), table, "decoder/projection")
    H = d.n_heads
    inputs = [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "n"])]
    out_info = [_f32("logits", ["batch", d.n_vocab])]
    outputs = {"logits": logits}
    for i in range(d.n_text_layer):
        inputs += [_f32(f"self_k_{i}", ["batch", H, "past", hd]), _f32(f"self_v_{i}", ["batch", H, "past", hd])]
        inputs += [_f32(f"cross_k_{i}", ["batch", H, "ctx", hd]), _f32(f"cross_v_{i}", ["batch", H, "ctx", hd])]
        out_info += [_f32(f"new_self_k_{i}", ["batch", H, "total", hd]), _f32(f"new_self_v_{i}", ["batch", H, "total", hd])]
        outputs |= {f"new_self_k_{i}": new_k[i], f"new_self_v_{i}": new_v[i]}
    return g.model(inputs, outputs, out_info, "whisper_decoder")


Progress = Callable[[str], None]
# fp32 / int8: the graphs ONNX Runtime runs; portable: standard ONNX only (TensorRT, tests).
# int8 weights (activations quantized per row): a decoder step at batch 1 is bound by reading its
# weights (tiny.en's output projection alone is 80 MB in fp32), the encoder by arithmetic that the
# CPU's int8 units do faster. Accuracy against fp32: benchmarks/README.md, "Encoder length".
PRECISIONS = ("fp32", "int8")
DEFAULT_PRECISION = "int8"


def graph_paths(weights: Weights, flavour: str = "portable", progress: Progress | None = None) -> tuple[Path, Path]:
    """The encoder and decoder .onnx files for these weights, built on first use.

    Keyed by the weights' sha256 and GRAPH_VERSION, so new weights or a changed builder never
    reuse a stale graph. Written to a temporary name first: an interrupted build leaves no
    half-written file behind to be loaded next time.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown graph flavour {flavour!r}; choose one of: {', '.join(FLAVOURS)}")
    folder = cache_dir() / "graphs" / f"{weights.name}-{weights.sha256[:16]}-v{GRAPH_VERSION}"
    folder.mkdir(parents=True, exist_ok=True)
    spec = FLAVOURS[flavour]
    jobs = (
        (folder / f"encoder.{flavour}.onnx", lambda: build_encoder(weights, spec)),
        (folder / f"decoder.{flavour}.onnx", lambda: build_decoder(weights, spec)),
    )
    for step, (path, build) in enumerate(jobs, start=1):
        if path.exists():
            continue
        if progress:
            progress(f"building graph {step}/2 of {weights.name} ({flavour}) -> {path}")
        tmp = path.with_suffix(".tmp")
        import onnx

        onnx.save(build(), tmp)
        tmp.replace(path)
    return jobs[0][0], jobs[1][0]
