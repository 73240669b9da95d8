"""A slow, plain-numpy Whisper forward pass: the oracle the ONNX graphs are checked against.

Written from the architecture description, not from any other implementation, and kept
deliberately simple: float64 throughout (weights are upcast from float16), no caches except
that `greedy` projects the cross-attention keys/values once per utterance, and no decoding
heuristics. It reads CTranslate2-named tensors (see ``engines.weights``):

    encoder/conv1, encoder/conv2 (stride 2), encoder/position_encodings/encodings,
    encoder/layer_N/{self_attention,ffn}/..., encoder/layer_norm,
    decoder/embeddings/weight (also the output projection), decoder/position_encodings/encodings,
    decoder/layer_N/{self_attention,attention,ffn}/..., decoder/layer_norm

Linear weights are stored (out, in), so a linear layer is ``x @ W.T + b``.

API
    encode(tensors, dims, mel[B, n_mels, T])          -> audio features [B, T // 2, d]
    cross_kv(tensors, dims, audio_features)           -> per decoder layer (k, v), each [B, H, T', hd]
    decoder_logits(tensors, dims, tokens[B, N], audio_features, offset=0) -> logits [B, N, V]
    greedy(tensors, dims, mel[n_mels, T], prefix, eot, max_tokens)        -> generated token ids
    as_float64(tensors)  -> the tensors upcast once, for callers making many calls
"""

from __future__ import annotations

import math

import numpy as np

DTYPE = np.float64
LN_EPS = 1e-5

_erf = np.frompyfunc(math.erf, 1, 1)  # numpy has no erf: use the C library one (to ~1 ulp), element by element


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact (erf) GELU: x * P(X <= x) for a standard normal X."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))


def as_float64(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All floating-point tensors upcast once; pass the result to avoid per-call conversions."""
    return {k: np.asarray(v, dtype=DTYPE) if v.dtype.kind == "f" else v for k, v in tensors.items()}


def _w(tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(tensors[name], dtype=DTYPE)  # a no-op on as_float64's output


def linear(tensors: dict, prefix: str, x: np.ndarray, rows: slice = slice(None)) -> np.ndarray:
    """x @ W.T + b, using only output rows `rows` of W and b (to split fused projections)."""
    return x @ _w(tensors, prefix + "/weight")[rows].T + _w(tensors, prefix + "/bias")[rows]


def layer_norm(tensors: dict, prefix: str, x: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased variance, as in LayerNorm
    return (x - mean) / np.sqrt(var + LN_EPS) * _w(tensors, prefix + "/gamma") + _w(tensors, prefix + "/beta")


def conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """1-d convolution, kernel size K, zero padding (K - 1) // 2 on each side: [B, C, T] -> [B, D, T_out]."""
    d, c, k = weight.shape
    pad = (k - 1) // 2
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad)))
    t_out = (xp.shape[-1] - k) // stride + 1
    out = np.zeros((x.shape[0], d, t_out), dtype=x.dtype)
    for j in range(k):  # tap j of output position t reads input position stride * t + j
        taps = xp[:, :, j : j + stride * (t_out - 1) + 1 : stride]  # [B, C, T_out]
        out += weight[:, :, j] @ taps  # [D, C] @ [B, C, T_out] -> [B, D, T_out]
    return out + bias[None, :, None]


def _split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    b, t, d = x.shape
    return x.reshape(b, t, n_heads, d // n_heads).transpose(0, 2, 1, 3)  # [B, H, T, hd]


def _merge_heads(x: np.ndarray) -> np.ndarray:
    b, h, t, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * hd)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal_offset: int | None = None) -> np.ndarray:
    """softmax(q k^T / sqrt(hd)) v per head; q [B, H, Nq, hd], k and v [B, H, Nk, hd].

    With `causal_offset` set, query i sits at absolute position causal_offset + i and the keys
    at positions 0..Nk-1; a query may only see keys at or before its own position.
    """
    scores = (q / math.sqrt(q.shape[-1])) @ k.transpose(0, 1, 3, 2)  # [B, H, Nq, Nk]
    if causal_offset is not None:
        q_pos = causal_offset + np.arange(q.shape[2])[:, None]
        k_pos = np.arange(k.shape[2])[None, :]
        scores = np.where(k_pos <= q_pos, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)  # in place: these arrays are large in the encoder
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores @ v


def self_attention(tensors: dict, prefix: str, x: np.ndarray, n_heads: int, causal: bool) -> np.ndarray:
    """Fused q,k,v projection (linear_0, 3d rows), attention, output projection (linear_1)."""
    d = x.shape[-1]
    q, k, v = (_split_heads(linear(tensors, prefix + "/linear_0", x, slice(i * d, (i + 1) * d)), n_heads) for i in range(3))
    out = attention(q, k, v, causal_offset=0 if causal else None)
    return linear(tensors, prefix + "/linear_1", _merge_heads(out))


def mlp(tensors: dict, prefix: str, x: np.ndarray) -> np.ndarray:
    return linear(tensors, prefix + "/linear_1", gelu(linear(tensors, prefix + "/linear_0", x)))


# --- encoder -------------------------------------------------------------------------------


def encode(tensors: dict, dims, mel: np.ndarray) -> np.ndarray:
    """Log-mel [B, n_mels, T] (T even, T <= 2 * n_audio_ctx) -> audio features [B, T // 2, d]."""
    mel = np.asarray(mel, dtype=DTYPE)
    if mel.ndim != 3 or mel.shape[1] != dims.n_mels:
        raise ValueError(f"mel must be [batch, {dims.n_mels}, frames], got {mel.shape}")
    frames = mel.shape[2]
    if frames % 2 or frames > 2 * dims.n_audio_ctx:
        raise ValueError(f"frames must be even and at most {2 * dims.n_audio_ctx}, got {frames}")
    x = gelu(conv1d(mel, _w(tensors, "encoder/conv1/weight"), _w(tensors, "encoder/conv1/bias"), stride=1))
    x = gelu(conv1d(x, _w(tensors, "encoder/conv2/weight"), _w(tensors, "encoder/conv2/bias"), stride=2))
    x = x.transpose(0, 2, 1)  # [B, T // 2, d]
    x = x + _w(tensors, "encoder/position_encodings/encodings")[: x.shape[1]]
    for layer in range(dims.n_audio_layer):
        p = f"encoder/layer_{layer}"
        x = x + self_attention(tensors, p + "/self_attention", layer_norm(tensors, p + "/self_attention/layer_norm", x),
                               dims.n_heads, causal=False)
        x = x + mlp(tensors, p + "/ffn", layer_norm(tensors, p + "/ffn/layer_norm", x))
    return layer_norm(tensors, "encoder/layer_norm", x)


# --- decoder -------------------------------------------------------------------------------


def cross_kv(tensors: dict, dims, audio_features: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cross-attention keys and values of every decoder layer, each [B, H, T', hd].

    They depend only on the audio, so a decode computes them once (linear_1 is the fused k,v).
    """
    a = np.asarray(audio_features, dtype=DTYPE)
    d = a.shape[-1]
    out = []
    for layer in range(dims.n_text_layer):
        p = f"decoder/layer_{layer}/attention/linear_1"
        k = _split_heads(linear(tensors, p, a, slice(0, d)), dims.n_heads)
        v = _split_heads(linear(tensors, p, a, slice(d, 2 * d)), dims.n_heads)
        out.append((k, v))
    return out


def _decoder_hidden(tensors: dict, dims, tokens: np.ndarray, kv: list, offset: int) -> np.ndarray:
    """Tokens [B, N] -> final-layer-normed hidden states [B, N, d]."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, n], got {tokens.shape}")
    n = tokens.shape[1]
    if offset + n > dims.n_text_ctx:
        raise ValueError(f"positions {offset}..{offset + n - 1} exceed n_text_ctx={dims.n_text_ctx}")
    x = _w(tensors, "decoder/embeddings/weight")[tokens] + _w(tensors, "decoder/position_encodings/encodings")[offset : offset + n]
    for layer in range(dims.n_text_layer):
        p = f"decoder/layer_{layer}"
        x = x + self_attention(tensors, p + "/self_attention", layer_norm(tensors, p + "/self_attention/layer_norm", x),
                               dims.n_heads, causal=True)
        h = layer_norm(tensors, p + "/attention/layer_norm", x)
        q = _split_heads(linear(tensors, p + "/attention/linear_0", h), dims.n_heads)
        k, v = kv[layer]
        x = x + linear(tensors, p + "/attention/linear_2", _merge_heads(attention(q, k, v)))
        x = x + mlp(tensors, p + "/ffn", layer_norm(tensors, p + "/ffn/layer_norm", x))
    return layer_norm(tensors, "decoder/layer_norm", x)


def _logits(tensors: dict, hidden: np.ndarray) -> np.ndarray:
    return hidden @ _w(tensors, "decoder/embeddings/weight").T  # the output projection is tied to the embedding


def decoder_logits(tensors: dict, dims, tokens: np.ndarray, audio_features: np.ndarray, offset: int = 0) -> np.ndarray:
    """Full causal pass over tokens [B, N] -> logits [B, N, V] (no cache).

    `offset` shifts the positional encodings (tokens sit at positions offset..offset+N-1); the
    causal mask is then only among these N tokens, so offset != 0 is for probing the embedding
    path, not for reproducing a cached step (feed the whole prefix for that).
    """
    return _logits(tensors, _decoder_hidden(tensors, dims, tokens, cross_kv(tensors, dims, audio_features), offset))


def greedy(tensors: dict, dims, mel: np.ndarray, prefix: list[int], eot: int, max_tokens: int) -> list[int]:
    """Argmax decoding of one utterance (mel [n_mels, T] or [1, n_mels, T]), no suppression rules.

    Returns the generated ids after `prefix`, stopping before `eot` or after `max_tokens` tokens.
    """
    mel = np.asarray(mel)
    if mel.ndim == 2:
        mel = mel[None]
    if mel.shape[0] != 1:
        raise ValueError("greedy decodes one utterance at a time")
    tensors = as_float64(tensors)
    kv = cross_kv(tensors, dims, encode(tensors, dims, mel))
    tokens = list(prefix)
    generated: list[int] = []
    while len(generated) < max_tokens and len(tokens) < dims.n_text_ctx:
        hidden = _decoder_hidden(tensors, dims, np.array([tokens]), kv, offset=0)
        logits = _logits(tensors, hidden[0, -1])  # only the last position predicts the next token
        token = int(np.argmax(logits))
        if token == eot:
            break
        generated.append(token)
        tokens.append(token)
    return generated
