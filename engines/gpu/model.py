"""Whisper in PyTorch for the GPU path: the packaged weights as fp16 tensors, the log-mel front
end, the encoder, and one decoder step over preallocated caches.

The step is written for CUDA graphs: every tensor it touches has a fixed shape and address.
Each slot (one utterance being decoded) owns a row of the self-attention cache, 448 positions
long, and a row of the cross-attention keys/values; `pos` says where each slot's next token
goes and masks what it may see. The same arithmetic as engines/graphs.py (the ONNX graphs), so
that transcripts can be compared token for token with the CPU backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.rnn import pad_sequence

from engines.features import HOP_LENGTH, N_FFT, as_float, mel_filterbank
from engines.weights import Weights

# Attention kernels for the eager passes (encoder, prefill, language detection), whose batch
# and length change from call to call: cuDNN's attention builds an execution plan for every new
# shape, which stalls in-flight admission; these kernels need no plan.
EAGER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

STFT_FRAMES_STEP = 500  # 5 s
_LOG_FLOOR = 1e-10
_DYNAMIC_RANGE = 8.0


class GpuLogMel:
    """Whisper's log-mel on the GPU, equal (to float32 rounding) to engines.features.log_mel: at
    2,000 utterances a second the numpy front end alone would need several CPU cores."""

    def __init__(self, device: torch.device, n_mels: int = 80) -> None:
        self.device = device
        self.window = torch.hann_window(N_FFT, periodic=True, device=device)
        self.filters = torch.from_numpy(np.array(mel_filterbank(n_mels=n_mels), np.float32)).to(device)  # [n_mels, 201]
        # Two pinned host buffers used in turn, each guarded by the event of its last copy: the
        # copy then runs without blocking the host, and the host never overwrites samples the
        # GPU has not read yet. A pageable copy would wait for every decode step already queued.
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0

    @torch.inference_mode()
    def __call__(self, audios: list[np.ndarray], n_frames: int, fill: float | None) -> torch.Tensor:
        """float32 [len(audios), 80, n_frames]. Each clip is zero-padded past n_frames + 2 frames, so
        that the frames that still overlap its end count towards its maximum, as on the CPU."""
        computed = n_frames
        if fill is not None:
            # Every frame from ceil(n / 160) + 1 on is `fill` whatever the STFT says (below): the
            # STFT runs up to where the longest clip's frames end, not over the whole window (the
            # rest of 30 s of zeros at a 30 s window). The same values: the frames it skips hold
            # no sample, and the maximum below is the same over the frames that do. Rounded up to
            # STFT_FRAMES_STEP, so that cuFFT plans for few lengths.
            longest = max(-(-a.size // HOP_LENGTH) + 1 for a in audios)
            computed = min(n_frames, -(-longest // STFT_FRAMES_STEP) * STFT_FRAMES_STEP)
        length = (computed + 2) * HOP_LENGTH
        # One transfer of just the samples, then the clips padded into a batch on the device: a
        # zero-padded host batch costs more to build and to send. Queued utterances arrive as
        # PCM16 and travel so (half the bytes of float32), scaled on the device as as_float does.
        # The empty clips that fill a batch bucket (engine.py) have no samples, so no dtype to go by.
        if all(a.dtype == np.int16 for a in audios if a.size):
            flat = self._upload(audios, torch.int16).float() * (1 / 32768)
        else:
            flat = self._upload([as_float(a) for a in audios], torch.float32)
        signal = pad_sequence(flat.split([a.size for a in audios]), batch_first=True)
        signal = F.pad(signal, (0, length - signal.shape[1]))
        spec = torch.stft(signal, N_FFT, HOP_LENGTH, window=self.window, center=True, pad_mode="reflect", return_complex=True)
        power = spec.real.square() + spec.imag.square()  # [B, 201, frames]
        log_spec = torch.clamp(self.filters @ power, min=_LOG_FLOOR).log10()
        top = log_spec.amax(dim=(1, 2), keepdim=True)
        out = (torch.maximum(log_spec[:, :, :computed], top - _DYNAMIC_RANGE) + 4.0) / 4.0
        if fill is not None:
            out = F.pad(out, (0, n_frames - computed), value=fill)
            # Frames from ceil(n / 160) + 1 on hold no audio: faster-whisper's constant there.
            first = to_device([-(-a.size // HOP_LENGTH) + 1 for a in audios], self.device)
            after = torch.arange(n_frames, device=self.device)[None, :] >= first[:, None]
            out = out.masked_fill(after[:, None, :], fill)
        return out


    def _upload(self, audios: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
        """The clips one after the other, of `dtype` (theirs; an empty one may be of any), on the device."""
        clips = [a for a in audios if a.size]
        if self.device.type != "cuda":
            return torch.from_numpy(np.concatenate(clips)) if clips else torch.zeros(0, dtype=dtype)
        nbytes = sum(a.size for a in clips) * dtype.itemsize
        if len(self._staging) < 2:
            self._staging.append((torch.empty(0, dtype=torch.uint8, pin_memory=True), None))
        buffer, copied = self._staging[self._turn]
        if copied is not None:
            copied.synchronize()
        # Bytes, viewed as the batch's dtype: batches of PCM16 and of float32 share the buffer,
        # which grows only when a batch needs more bytes than it holds: allocating pinned memory
        # locks every page of it, and the batch waits for that.
        if buffer.numel() < nbytes:
            buffer = torch.empty(max(nbytes, 2 * buffer.numel()), dtype=torch.uint8, pin_memory=True)
        staged = buffer[:nbytes].view(dtype)
        if clips:
            np.concatenate(clips, out=staged.numpy())
        flat = staged.to(self.device, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # waited on by the host: sleep, do not spin
        event.record()
        self._staging[self._turn] = (buffer, event)
        self._turn = 1 - self._turn
        return flat


def to_device(values: "np.ndarray | list[int]", device: torch.device) -> torch.Tensor:
    """Host values on the device without waiting: torch.tensor(..., device="cuda") synchronises
    the stream, which would make the host wait for every decoder step already queued. Through
    pinned memory the copy is queued like a kernel (PyTorch keeps the pinned block until it ran)."""
    t = torch.from_numpy(np.asarray(values, dtype=np.int64) if isinstance(values, list) else values)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Layer:
    """One transformer layer's weights: fused q/k/v rows, output, MLP, norms."""

    ln1: tuple[torch.Tensor, torch.Tensor]
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln_mlp: tuple[torch.Tensor, torch.Tensor]
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor
    # decoder only: cross-attention query, keys/values projection (applied once per utterance), output
    ln_cross: tuple[torch.Tensor, torch.Tensor] | None = None
    cq_w: torch.Tensor | None = None
    cq_b: torch.Tensor | None = None
    ckv_w: torch.Tensor | None = None
    ckv_b: torch.Tensor | None = None
    co_w: torch.Tensor | None = None
    co_b: torch.Tensor | None = None


class TorchWhisper:
    """The model's math. fp16 weights and activations (layer norm and softmax accumulate in fp32),
    fp32 logits. Few, large kernels: a decoder step at batch 1 is bound by how many kernels it
    launches (~2 us each even inside a CUDA graph), not by arithmetic."""

    def __init__(self, weights: Weights, device: torch.device, dtype: torch.dtype = torch.float16) -> None:
        d = weights.dims
        self.dims, self.device, self.dtype = d, device, dtype
        self.n_heads, self.width = d.n_heads, d.n_audio_state
        self.head_dim = d.n_audio_state // d.n_heads
        t = weights.tensors

        def w(name: str) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(t[name], np.float32)).to(device, dtype)

        def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return (w(prefix + "/gamma"), w(prefix + "/beta"))

        def layer(p: str, decoder: bool) -> Layer:
            extra = {}
            if decoder:
                extra = dict(
                    ln_cross=norm(p + "/attention/layer_norm"),
                    cq_w=w(p + "/attention/linear_0/weight"), cq_b=w(p + "/attention/linear_0/bias"),
                    ckv_w=w(p + "/attention/linear_1/weight"), ckv_b=w(p + "/attention/linear_1/bias"),
                    co_w=w(p + "/attention/linear_2/weight"), co_b=w(p + "/attention/linear_2/bias"),
                )
            return Layer(
                ln1=norm(p + "/self_attention/layer_norm"),
                qkv_w=w(p + "/self_attention/linear_0/weight"), qkv_b=w(p + "/self_attention/linear_0/bias"),
                out_w=w(p + "/self_attention/linear_1/weight"), out_b=w(p + "/self_attention/linear_1/bias"),
                ln_mlp=norm(p + "/ffn/layer_norm"),
                fc1_w=w(p + "/ffn/linear_0/weight"), fc1_b=w(p + "/ffn/linear_0/bias"),
                fc2_w=w(p + "/ffn/linear_1/weight"), fc2_b=w(p + "/ffn/linear_1/bias"),
                **extra,
            )

        self.conv1 = (w("encoder/conv1/weight"), w("encoder/conv1/bias"))
        self.conv2 = (w("encoder/conv2/weight"), w("encoder/conv2/bias"))
        self.audio_pos = w("encoder/position_encodings/encodings")
        self.encoder_layers = [layer(f"encoder/layer_{i}", False) for i in range(d.n_audio_layer)]
        self.encoder_norm = norm("encoder/layer_norm")
        self.embed = w("decoder/embeddings/weight")
        self.text_pos = w("decoder/position_encodings/encodings")
        self.decoder_layers = [layer(f"decoder/layer_{i}", True) for i in range(d.n_text_layer)]
        self.decoder_norm = norm("decoder/layer_norm")

    def _ln(self, x: torch.Tensor, params: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # One kernel; its statistics are accumulated in fp32 even for fp16 input.
        return F.layer_norm(x, (x.shape[-1],), params[0], params[1], 1e-5)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, H, T, hd]"""
        return x.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)

    def _mlp(self, x: torch.Tensor, l: Layer) -> torch.Tensor:
        h = F.gelu(F.linear(self._ln(x, l.ln_mlp), l.fc1_w, l.fc1_b))
        return F.linear(h, l.fc2_w, l.fc2_b)

    @torch.inference_mode()
    @sdpa_kernel(EAGER_ATTENTION)
    def encode(self, mel: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """mel [B, 80, frames] -> per decoder layer the cross-attention (K, V), each [B, H, frames/2, hd]."""
        return self.encode_layers(mel)

    def encode_layers(self, mel: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """encode() without its modes: what torch.compile takes (engine.py), called under them."""
        x = F.gelu(F.conv1d(mel.to(self.dtype), *self.conv1, padding=1))
        x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1)).transpose(1, 2)
        x = x + self.audio_pos[: x.shape[1]]
        for l in self.encoder_layers:
            q, k, v = (self._heads(t) for t in F.linear(self._ln(x, l.ln1), l.qkv_w, l.qkv_b).chunk(3, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v)
            x = x + F.linear(a.transpose(1, 2).flatten(2), l.out_w, l.out_b)
            x = x + self._mlp(x, l)
        x = self._ln(x, self.encoder_norm)
        out = []
        for l in self.decoder_layers:
            k, v = F.linear(x, l.ckv_w, l.ckv_b).chunk(2, dim=-1)
            out.append((self._heads(k), self._heads(v)))
        return out

    def step(
        self,
        tokens: torch.Tensor,  # [S] int64: each slot's input token
        pos: torch.Tensor,  # [S] int64: its position (0..447)
        self_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer the whole cache [>= S, H, 448, hd]
        cross_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [S, H, C, hd]
        cross_len: torch.Tensor | None,  # [S] int64: valid encoder positions of each slot; None: all C
        positions: int | None = None,  # cache positions attention reads (a bucket >= every pos + 1)
    ) -> torch.Tensor:
        """One token for every slot: writes its K/V at `pos`, returns fp32 logits [S, vocab].
        No host synchronisation and no data-dependent shapes, so it can be captured in a CUDA graph."""
        S = tokens.shape[0]
        P = positions or self_kv[0][0].shape[2]
        C = cross_kv[0][0].shape[2]
        self_mask = (torch.arange(P, device=tokens.device)[None, :] <= pos[:, None])[:, None, None, :]  # [S, 1, 1, P]
        # Unmasked where every slot reads the whole window (the default policy's 30 s): the
        # one-query attention kernel runs faster without a mask, and the cross-attention over
        # 1,500 positions is the largest part of a large batch's decoding (benchmarks/README.md,
        # "The cross-attention unmasked").
        cross_mask = None if cross_len is None else (torch.arange(C, device=tokens.device)[None, :] < cross_len[:, None])[:, None, None, :]
        x = (self.embed[tokens] + self.text_pos[pos])[:, None, :]  # [S, 1, d]
        for l, (k_cache, v_cache), (ck, cv) in zip(self.decoder_layers, self_kv, cross_kv):
            q, k, v = (self._heads(t) for t in F.linear(self._ln(x, l.ln1), l.qkv_w, l.qkv_b).chunk(3, dim=-1))
            write_kv(k_cache, v_cache, pos, k, v)
            sk, sv = k_cache[:S, :, :P], v_cache[:S, :, :P]
            x = x + F.linear(_attend(q, sk, sv, self_mask), l.out_w, l.out_b)
            cq = self._heads(F.linear(self._ln(x, l.ln_cross), l.cq_w, l.cq_b))
            x = x + F.linear(_attend(cq, ck, cv, cross_mask), l.co_w, l.co_b)
            x = x + self._mlp(x, l)
        return F.linear(self._ln(x[:, 0], self.decoder_norm), self.embed).float()

    @torch.inference_mode()
    @sdpa_kernel(EAGER_ATTENTION)
    def prefill(
        self, tokens: torch.Tensor, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], at: int | None
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """The forced tokens of utterances sharing a prefix, all positions in one pass (as the CPU
        decoder feeds them): tokens [B, L], cross_kv per layer [B, H, C, hd] (every row C long).
        Returns per layer the self-attention (K, V) [B, H, L, hd] for the slot caches, and the fp32
        logits [B, vocab] at position `at` (where the no-speech probability is read), if asked.
        Three to 20 one-token steps become one pass of ~100 kernels."""
        L = tokens.shape[1]
        x = self.embed[tokens] + self.text_pos[:L]
        kv = []
        for l, (ck, cv) in zip(self.decoder_layers, cross_kv):
            q, k, v = (self._heads(t) for t in F.linear(self._ln(x, l.ln1), l.qkv_w, l.qkv_b).chunk(3, dim=-1))
            kv.append((k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).flatten(2), l.out_w, l.out_b)
            cq = self._heads(F.linear(self._ln(x, l.ln_cross), l.cq_w, l.cq_b))
            c = F.scaled_dot_product_attention(cq, ck, cv)
            x = x + F.linear(c.transpose(1, 2).flatten(2), l.co_w, l.co_b)
            x = x + self._mlp(x, l)
        if at is None:
            return kv, None
        return kv, F.linear(self._ln(x[:, at], self.decoder_norm), self.embed).float()


@torch.library.custom_op("streamserver::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Each slot's new key and value (k, v [S, H, 1, hd]) into its cache row at `pos`. An op of
    its own so that torch.compile writes in place: written as scatter_ on a slice of the cache,
    the compiled step copies the whole slice out and back for every layer."""
    S, H, _, hd = k.shape
    where = pos[:, None, None, None].expand(S, H, 1, hd)
    k_cache[:S].scatter_(2, where, k)
    v_cache[:S].scatter_(2, where, v)


@write_kv.register_fake
def _(k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    return None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One query per slot over its masked keys: q [S, H, 1, hd], k/v [S, H, T, hd], mask [S, 1, 1, T]
    or None (every key) -> [S, 1, d]."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [S, H, 1, hd]
    return out.transpose(1, 2).flatten(2)
