"""The PyTorch CUDA engine: log-mel, encoder and in-flight decoding on the GPU.

An Engine (engines/engine.py) whose batches run through the in-flight decoder (inflight.py)
over the PyTorch model (model.py) instead of a step-by-step Backend: the greedy rules run on
the GPU and only token ids come back, so a batch of 64 costs little more than a batch of one.
Everything around the decoding (the voicing and no-speech gates, the repetition re-run,
simplified Chinese) is the Engine's own, which is what makes its transcripts comparable with
the CPU backend's.

torch is an optional extra (`pip install 'streamserver[gpu]'`); importing this module without
it raises BackendUnavailable with that advice.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from engines.backends import BackendUnavailable

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the install
    raise BackendUnavailable("the torch-cuda backend needs PyTorch: pip install 'streamserver[gpu]'") from error

from torch.nn.attention import sdpa_kernel

from engines.engine import Engine, Transcript, token_budget
from engines.features import N_SAMPLES, SAMPLE_RATE
from engines.gpu.inflight import InflightDecoder, Job, Prefilled, make_prefix, prefix_pass
from engines.gpu.model import EAGER_ATTENTION, GpuLogMel, TorchWhisper, to_device
from engines.policy import POLICIES, EncoderPolicy, default_policy
from engines.tokenizer import WhisperTokenizer
from engines.weights import Weights, load_weights


log = logging.getLogger(__name__)
ENCODER_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_NO_AUDIO = np.zeros(0, np.float32)


def cuda_device() -> "torch.device":
    if not torch.cuda.is_available():
        raise BackendUnavailable("the torch-cuda backend needs a CUDA GPU; torch.cuda.is_available() is False here")
    return torch.device("cuda")


class TorchCudaEngine(Engine):
    def __init__(
        self,
        model: str,
        weights: Weights,
        tokenizer: WhisperTokenizer,
        policy: EncoderPolicy,
        device: "torch.device | None" = None,
        slots: int = 256,
    ) -> None:
        device = device or cuda_device()
        torch.backends.cudnn.benchmark = True  # the encoder's convolutions see few distinct shapes
        super().__init__(model, tokenizer, policy)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.batch_rows_cheap = device.type == "cuda"  # engines/engine.py
        self.whisper = TorchWhisper(weights, device, dtype)
        self.mel = GpuLogMel(device, weights.dims.n_mels)
        compile_step = device.type == "cuda" and os.environ.get("STREAMSERVER_TORCH_COMPILE", "1") != "0"
        self.decoder = InflightDecoder(self.whisper, tokenizer, slots=slots, compile=compile_step)
        # The encoder compiled as well: run eager, its layer norms, residual adds, biases, GELUs and
        # head copies are one pass each over [rows, frames / 2, width] activations, which at large
        # batches cost more GPU time than its matrix products and attention (benchmarks/README.md,
        # "GPU engine"). One compile with dynamic shapes serves every batch and window.
        self._encode_fn = torch.compile(self.whisper.encode_layers, dynamic=True) if compile_step else self.whisper.encode_layers
        self._encoders: dict[tuple[int, int, tuple[int, ...] | None], tuple] = {}  # graph, input, outputs, token ids
        self._prefixes: dict[tuple[str, str | None], tuple[list[int], int]] = {}
        self._prefetched: dict[int, tuple[list[int], tuple]] = {}  # frames -> (ids of its audios, encode())
        # The encoder runs on a stream of its own, so that encoding new arrivals fills the SMs the
        # decoder's small step kernels leave idle; its graphs get their own memory pool, since
        # graphs that share a pool must never run at the same time.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._encoder_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    @classmethod
    def of_model(cls, model: str, policy: str | None = None, device: "torch.device | str | None" = None,
                 slots: int = 256) -> "TorchCudaEngine":
        """The engine of a packaged model as engines.loading builds it for a worker, on a chosen
        device ("cpu" checks a script or a test on a machine without a GPU) and with the model's
        measured window unless `policy` names one."""
        weights = load_weights(model)
        tokenizer = WhisperTokenizer.load(weights.folder, weights.config, weights.dims.n_vocab)
        return cls(model, weights, tokenizer, POLICIES[policy or default_policy(weights.twin or model)],
                   None if device is None else torch.device(device), slots)

    @property
    def backend_name(self) -> str:
        return "torch-cuda"

    def encode(
        self, audios: Sequence[np.ndarray], n_frames: int, prefix: tuple[list[int], int] | None = None
    ) -> tuple[list[tuple["torch.Tensor", "torch.Tensor"]], object, Prefilled | None]:
        """Log-mel and encoder for utterances sharing an encoder length: per layer (K, V) [B, H, ctx, hd],
        the CUDA event that says they are ready (None on the CPU), and, given the forced tokens they
        share (prefix_for()), the pass over those tokens, run in the encoder's own graph. Pass all
        three to the decoder's submit(): the host never waits for the encoder."""
        tokens = tuple(prefix[0]) if prefix and len(prefix[0]) > 1 else None
        sot_index = prefix[1] if prefix else 0
        if self._stream is None:
            cross_kv = self.whisper.encode(self.mel(list(audios), n_frames, self.policy.pad_value))
            return cross_kv, None, prefix_pass(self.whisper, self.tokenizer, tokens, sot_index, cross_kv) if tokens else None
        main = torch.cuda.current_stream()
        with torch.cuda.stream(self._stream):
            # Log-mel over the whole batch bucket (empty rows fill it): cuFFT then plans once per
            # bucket, not once per batch size.
            size = next((b for b in ENCODER_BUCKETS if b >= len(audios)), len(audios))
            padding = [_NO_AUDIO] * (size - len(audios))
            mel = self.mel(list(audios) + padding, n_frames, self.policy.pad_value)[: len(audios)]
            if len(audios) <= ENCODER_BUCKETS[-1]:
                cross_kv, prefilled = self._encode_graph(mel, tokens, sot_index)
            else:
                cross_kv = self._encoder(mel)
                prefilled = prefix_pass(self.whisper, self.tokenizer, tokens, sot_index, cross_kv) if tokens else None
            ready = torch.cuda.Event()
            ready.record()
        outputs = [t for kv in cross_kv for t in kv] + ([t for kv in prefilled.kv for t in kv] if prefilled else [])
        if prefilled and prefilled.no_speech is not None:
            outputs.append(prefilled.no_speech)
        for t in outputs:  # used on the main stream: not to be reused before it has read them
            t.record_stream(main)
        return cross_kv, ready, prefilled

    def _encode_graph(
        self, mel: "torch.Tensor", tokens: tuple[int, ...] | None, sot_index: int
    ) -> tuple[list[tuple["torch.Tensor", "torch.Tensor"]], Prefilled | None]:
        """The encoder, and the forced tokens' pass if given, as a CUDA graph per (batch bucket,
        frames, forced tokens): eager, their ~200 kernel launches cost more than their arithmetic
        at the small batches that in-flight arrivals bring."""
        n, frames = mel.shape[0], mel.shape[2]
        size = next(b for b in ENCODER_BUCKETS if b >= n)
        entry = self._encoders.get((size, frames, tokens))
        if entry is None:
            started = time.perf_counter()
            static_in = torch.zeros(size, mel.shape[1], frames, device=mel.device)
            # The forced tokens live on the device before the capture, and as long as the graph.
            ids = torch.tensor(tokens[:-1], device=mel.device) if tokens else None

            def body() -> tuple[list, Prefilled | None]:
                cross = self._encoder(static_in)
                return cross, (prefix_pass(self.whisper, self.tokenizer, tokens, sot_index, cross, ids) if tokens else None)

            body()  # warm-up outside the capture (on the encoder's stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._encoder_pool, stream=self._stream):
                static_out = body()
            entry = self._encoders[(size, frames, tokens)] = (graph, static_in, static_out, ids)
            # warmup() captures the usual ones; one captured later held a batch up this long
            log.info("encoder graph captured for %d rows, %d frames, %d forced tokens in %.2f s",
                     size, frames, len(tokens or ()), time.perf_counter() - started)
        graph, static_in, (static_kv, static_prefilled), _ids = entry
        static_in[:n].copy_(mel)
        graph.replay()
        # Copies: the next replay overwrites the graph's outputs, and these may still wait for slots.
        cross_kv = [(k[:n].clone(), v[:n].clone()) for k, v in static_kv]
        if static_prefilled is None:
            return cross_kv, None
        part = static_prefilled.rows(slice(None, n))
        no_speech = None if part.no_speech is None else part.no_speech.clone()
        return cross_kv, Prefilled(part.prefix, [(k.clone(), v.clone()) for k, v in part.kv], no_speech)

    def _encoder(self, mel: "torch.Tensor") -> list[tuple["torch.Tensor", "torch.Tensor"]]:
        """TorchWhisper.encode, compiled where the decoder's step is."""
        with torch.inference_mode(), sdpa_kernel(EAGER_ATTENTION):
            return self._encode_fn(mel)

    def prefix_for(self, language: str, prompt: str | None) -> tuple[list[int], int]:
        """The forced tokens of an utterance in this language (with the given or default prompt)
        and where <|startoftranscript|> is among them; cached, the same for every utterance."""
        key = (language, prompt)
        if key not in self._prefixes:
            self._prefixes[key] = make_prefix(self.tokenizer, language, self._prompt_ids(language, prompt))
        return self._prefixes[key]

    def jobs(self, audios: Sequence[np.ndarray], languages: Sequence[str], prompt: str | None, tags: Sequence[object] = ()) -> list[Job]:
        out = []
        for i, (audio, lang) in enumerate(zip(audios, languages)):
            prefix, sot_index = self.prefix_for(lang, prompt)
            out.append(Job(prefix, sot_index, token_budget(audio.size), lang, tags[i] if tags else None))
        return out

    def detect_languages(self, cross_kv: list[tuple["torch.Tensor", "torch.Tensor"]]) -> list[str]:
        """One decoder step on <|startoftranscript|> with a one-position cache; the likeliest language token."""
        w, tok = self.whisper, self.tokenizer
        n = cross_kv[0][0].shape[0]
        dev = w.device
        with torch.inference_mode(), sdpa_kernel(EAGER_ATTENTION):
            self_kv = [tuple(torch.zeros(n, w.n_heads, 1, w.head_dim, device=dev, dtype=w.dtype) for _ in "kv") for _ in cross_kv]
            logits = w.step(
                torch.full((n,), tok.sot, device=dev, dtype=torch.long), torch.zeros(n, device=dev, dtype=torch.long),
                self_kv, cross_kv, torch.full((n,), cross_kv[0][0].shape[2], device=dev, dtype=torch.long),
            )
        codes = list(tok.languages)
        ids = to_device([tok.languages[c] for c in codes], dev)
        return [codes[i] for i in logits[:, ids].argmax(dim=1).tolist()]

    def transcribe_batch(self, audios: Sequence[np.ndarray], language: str | None = None, prompt: str | None = None,
                         fallback: bool = True, window: EncoderPolicy | None = None) -> list[Transcript]:
        if window is not None and window.frames(16000) != self.policy.frames(16000):
            raise ValueError("the GPU engine encodes at its own window only (its rows are cheap: no caption window)")
        try:
            return super().transcribe_batch(audios, language, prompt, fallback)
        finally:
            self._prefetched.clear()

    def _voiced(self, audios: Sequence[np.ndarray], language: str | None, prompt: str | None) -> list[int]:
        """Start log-mel, encoder and forced tokens of every utterance on the GPU, then run the
        voicing gate on the host while they compute, so that the gate's CPU time hides behind
        the GPU's. _run takes these encodings; an utterance the gate drops only costs its share
        of the encoder."""
        if self._stream is not None:
            prefix = self._known_prefix(language, prompt)
            groups: dict[int, list[np.ndarray]] = defaultdict(list)
            for audio in audios:
                groups[self.policy.frames(audio.size)].append(audio)
            self._prefetched = {
                n_frames: ([id(a) for a in group], self.encode(group, n_frames, prefix)) for n_frames, group in groups.items()
            }
        return super()._voiced(audios, language, prompt)

    def _known_prefix(self, language: str | None, prompt: str | None) -> tuple[list[int], int] | None:
        known = "en" if not self.multilingual else language
        return self.prefix_for(known, prompt) if known else None

    def _run(self, audios: Sequence[np.ndarray], frames: list[int], language: str | None, prompt: str | None) -> list[Transcript]:
        results: list[Transcript | None] = [None] * len(audios)
        by_frames: dict[int, list[int]] = defaultdict(list)
        for i, f in enumerate(frames):
            by_frames[f].append(i)
        submitted: list[tuple[Job, int]] = []
        for n_frames, rows in by_frames.items():
            group = [audios[i] for i in rows]
            prefix = self._known_prefix(language, prompt)  # None: detected per utterance below
            ids, encoded = self._prefetched.pop(n_frames, ([], None))
            if encoded is None or ids != [id(a) for a in group]:
                encoded = self.encode(group, n_frames, prefix)
            cross_kv, ready, prefilled = encoded
            if prefix:
                languages = [language or "en"] * len(rows)
            else:
                if ready is not None:
                    torch.cuda.current_stream().wait_event(ready)
                languages = self.detect_languages(cross_kv)
            jobs = self.jobs(group, languages, prompt, tags=[n_frames] * len(rows))
            self.decoder.submit(cross_kv, jobs, ready, prefilled)
            submitted += list(zip(jobs, rows))
        waiting = {id(job) for job, _ in submitted}
        while waiting:  # the decoder may also carry other callers' utterances
            for job in self.decoder.run_once():
                waiting.discard(id(job))
        for job, row in submitted:
            assert job.result is not None
            results[row] = self._finish(job.result, int(job.tag))
        return [r for r in results if r is not None]

    def warmup(self) -> None:
        """The Engine's warm-up run, the step graphs of every batch size for the default window,
        one batch of every encoder bucket and one past them, so that no request pays for a
        compile, a capture or a plan. If torch.compile fails on this machine, the encoder and the
        decoder run uncompiled (slower, same tokens) with a warning."""
        try:
            self._warm()
        except Exception as error:  # noqa: BLE001 - any compiler failure
            if not self.decoder.compiled:
                raise
            log.warning("torch.compile failed (%s); the encoder and the decoder run uncompiled", error)
            self.decoder = InflightDecoder(self.whisper, self.tokenizer, slots=self.decoder.slots)
            self._encode_fn = self.whisper.encode_layers
            self._encoders.clear()
            self._warm()

    def _warm(self) -> None:
        super().warmup()
        shortest, longest = self.policy.frames(1), self.policy.frames(N_SAMPLES)
        self.decoder.capture(context=shortest // 2, masked_too=shortest < longest)
        # The first batch of each size captures its encoder graph and builds cuFFT/cuBLAS plans,
        # and the first past the graphs' buckets compiles the encoder for them: done here, so
        # that no student's transcript waits for them.
        noise = np.random.default_rng(1).normal(0, 0.1, 3 * SAMPLE_RATE).astype(np.float32)
        past = (2 * ENCODER_BUCKETS[-1],) if self._stream is not None else ()
        for size in ENCODER_BUCKETS[1:] + past:
            self.transcribe_batch([noise] * size, "en")
