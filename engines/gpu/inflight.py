"""In-flight batching on the GPU: utterances join the decode loop between steps and leave it as
soon as they end, so one long utterance never holds the others back.

Every utterance being decoded owns a slot: a row of each preallocated cache and of the small
per-slot state (next input token, position, forced prefix, token budget, output so far). One
step advances every active slot by one token; Whisper's greedy rules (suppressed tokens, no
blank or end-of-text first, the no-speech probability read at <|startoftranscript|>, the budget)
run on the GPU inside that step, so the host reads back only which slots finished. Active slots
are kept at the front (a finished slot is refilled by moving the last one into it), and the step
for n active slots runs as a CUDA graph captured for the smallest bucket >= n: replaying a graph
costs a few microseconds where launching its ~150 kernels one by one costs milliseconds. One
graph holds STEPS_PER_LAUNCH steps, so the host's work per launch is shared by several steps.

The prompt and task tokens are fed in one multi-token pass when an utterance takes its slot
(as decoding.py does on the CPU), all but the last: the first step feeds that one and yields the
first free token. One pass instead of 3-20 steps of ~200 kernels each.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.decoding import MAX_PROMPT_TOKENS, Decoded
from engines.engine import MAX_SAMPLE_LEN
from engines.gpu.model import TorchWhisper, to_device
from engines.tokenizer import WhisperTokenizer

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
POSITION_BUCKETS = (128, 448)  # self-attention cache length a step reads
CONTEXT_BUCKETS = (500, 1000, 1500)  # encoder positions a step reads (10, 20, 30 s windows)
# Steps per launch (one graph replay, one read of the finished flags): the host's Python and
# copies per launch are paid once for several steps, at the price of the steps a slot that ends
# early in a launch runs masked (figures in benchmarks/README.md).
STEPS_PER_LAUNCH = 3
SINGLE_STEP_UP_TO = 4  # ... except at batch buckets up to this


@dataclass
class Job:
    """One utterance waiting for or holding a slot (its encoder output travels beside it)."""

    prefix: list[int]  # forced tokens: [<|startofprev|>, prompt...] <|startoftranscript|> task...
    sot_index: int  # where <|startoftranscript|> is in prefix (the no-speech probability is read there)
    budget: int
    language: str
    tag: Any = None  # the caller's handle, returned with the result
    result: Decoded | None = field(default=None)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} is over the largest bucket {buckets[-1]}")


class InflightDecoder:
    def __init__(
        self, model: TorchWhisper, tok: WhisperTokenizer, slots: int = 256, graphs: bool = True, compile: bool = False,
        steps_per_launch: int = STEPS_PER_LAUNCH,
    ) -> None:
        if slots not in BATCH_BUCKETS:
            raise ValueError(f"slots must be one of {BATCH_BUCKETS}")
        if steps_per_launch < 1:
            raise ValueError("steps_per_launch must be at least 1")
        self.model, self.tok, self.slots = model, tok, slots
        self.steps_per_launch = steps_per_launch
        self.graphs = graphs and model.device.type == "cuda"
        dev, d = model.device, model.dims
        H, hd = model.n_heads, model.head_dim
        cache = lambda length: (  # noqa: E731
            torch.zeros(slots, H, length, hd, device=dev, dtype=model.dtype),
            torch.zeros(slots, H, length, hd, device=dev, dtype=model.dtype),
        )
        self.self_kv = [cache(d.n_text_ctx) for _ in range(d.n_text_layer)]
        self.cross_kv = [cache(d.n_audio_ctx) for _ in range(d.n_text_layer)]
        z = lambda dtype=torch.long: torch.zeros(slots, device=dev, dtype=dtype)  # noqa: E731
        self.cross_len, self.token, self.pos = z(), z(), z()
        self.prefix = torch.zeros(slots, d.n_text_ctx, device=dev, dtype=torch.long)
        self.prefix_len, self.sot_pos, self.budget, self.n_out = z(), z(), z(), z()
        self.out = torch.zeros(slots, MAX_SAMPLE_LEN + 1, device=dev, dtype=torch.long)
        self.logprob, self.no_speech = z(torch.float32), z(torch.float32)
        self.done, self.hit_budget = z(torch.bool), z(torch.bool)
        self.rows = torch.arange(slots, device=dev)
        # Suppression as on the CPU (decoding._suppression): specials and non-speech symbols always,
        # and a bare space or end-of-text as the first token.
        always = torch.zeros(d.n_vocab, dtype=torch.bool)
        always[list(tok.suppress_ids)] = True
        always[tok.eot + 1 :] = True
        first = always.clone()
        first[list(tok.suppress_ids_begin)] = True
        self.always, self.first = always.to(dev), first.to(dev)
        self.jobs: list[Job | None] = [None] * slots  # the job in each slot
        self.active = 0  # slots [0, active) are stepped: running ones and finished ones not yet compacted
        self.live = 0  # how many of them are still running
        self._flags: list[_Flags] = []  # finished flags of launched steps, not yet read
        self._slot_of: dict[int, int] = {}  # id(job) -> the slot it holds now
        self.pending: deque[tuple[list[tuple[torch.Tensor, torch.Tensor]], list[Job], Any, Prefilled | None]] = deque()
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        # torch.compile fuses the step's ~200 small kernels (layer norms, masks, the greedy rules)
        # into few: inside a CUDA graph each kernel still costs its launch, and at small batches
        # the launches, not the arithmetic, set a step's time. One compile with dynamic shapes
        # serves every bucket.
        self.compiled = compile
        self._step_fn = torch.compile(self._step, dynamic=True) if compile else self._step
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    # ---- the step (graph-capturable: fixed shapes, no host synchronisation) ----

    def _step(self, n: int, positions: int, context: int, whole: bool = False) -> None:
        """`whole`: every active slot's encoder output is `context` long (no mask needed)."""
        m, tok = self.model, self.tok
        rows = self.rows[:n]
        token, pos, done = self.token[:n], self.pos[:n], self.done[:n]
        cross_kv = [(k[:n, :, :context], v[:n, :, :context]) for k, v in self.cross_kv]
        logits = m.step(token, pos, self.self_kv, cross_kv, None if whole else self.cross_len[:n], positions)
        # The no-speech probability: softmax of the raw logits after <|startoftranscript|>.
        at_sot = pos == self.sot_pos[:n]
        p_none = torch.softmax(logits, dim=-1)[:, tok.no_speech]
        self.no_speech[:n] = torch.where(at_sot, p_none, self.no_speech[:n])
        next_pos = pos + 1
        forced = next_pos < self.prefix_len[:n]
        is_first = next_pos == self.prefix_len[:n]
        mask = torch.where(is_first[:, None], self.first[None, :], self.always[None, :])
        masked = logits.masked_fill(mask, float("-inf"))
        chosen = masked.argmax(dim=-1)
        chosen_lp = masked.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(masked, dim=-1)
        free = ~forced & ~done
        self.logprob[:n] += torch.where(free, chosen_lp, torch.zeros_like(chosen_lp))
        is_eot = chosen == tok.eot
        emit = free & ~is_eot
        n_out = self.n_out[:n]
        slot = n_out.clamp(max=MAX_SAMPLE_LEN)
        self.out[rows, slot] = torch.where(emit, chosen, self.out[rows, slot])
        n_out = n_out + emit.long()
        self.n_out[:n] = n_out
        full = emit & (n_out >= self.budget[:n])
        self.hit_budget[:n] |= full
        self.done[:n] = done | (free & is_eot) | full
        prefix_next = self.prefix[rows, next_pos.clamp(max=self.prefix.shape[1] - 1)]
        self.token[:n] = torch.where(forced, prefix_next, chosen)
        self.pos[:n] = torch.where(self.done[:n], pos, next_pos.clamp(max=positions - 1))

    def _run_step(self, n: int) -> None:
        positions = _bucket(self._max_pos, POSITION_BUCKETS)
        context = _bucket(self._max_ctx, CONTEXT_BUCKETS)
        whole = self._min_ctx == context
        if not self.graphs:
            for _ in range(self._steps(n)):
                self._step_fn(n, positions, context, whole)
            return
        size = _bucket(n, BATCH_BUCKETS)
        graph = self._graphs.get((size, positions, context, whole))
        if graph is None:
            graph = self._capture(size, positions, context, whole)
        graph.replay()

    def _steps(self, size: int) -> int:
        """Steps per launch for this many slots: one for the few slots of a lone utterance (the
        steps a launch runs past its end are latency there), several for a busy decoder."""
        return 1 if size <= SINGLE_STEP_UP_TO else self.steps_per_launch

    def _capture(self, size: int, positions: int, context: int, whole: bool) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (lazy initialisation must not happen inside the capture). The
        # step writes only to slots whose state says so, but rows [active, size) may hold stale
        # state: save and restore everything a step writes.
        saved = self._snapshot()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # the first call may compile
                self._step_fn(size, positions, context, whole)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            for _ in range(self._steps(size)):
                self._step_fn(size, positions, context, whole)
        self._restore(saved)
        self._graphs[(size, positions, context, whole)] = graph
        return graph

    def capture(self, context: int, positions: tuple[int, ...] = POSITION_BUCKETS, masked_too: bool = False) -> None:
        """Capture ahead of time the graphs of every batch bucket for this encoder length: those
        of slots all at this length and, `masked_too` (an engine whose window follows the
        utterance's length), those of slots of shorter ones as well. The two are compiled apart:
        the first of each kind costs seconds, never to be paid in a class."""
        if not self.graphs:
            return
        ctx = _bucket(context, CONTEXT_BUCKETS)
        kinds = {ctx == context, False} if masked_too else {ctx == context}
        for size in BATCH_BUCKETS:
            for p in positions:
                for whole in kinds:
                    if size <= self.slots and (size, p, ctx, whole) not in self._graphs:
                        self._capture(size, p, ctx, whole)

    def _snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._state_tensors()]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._state_tensors(), saved):
            t.copy_(s)

    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.token, self.pos, self.n_out, self.out, self.logprob, self.no_speech, self.done, self.hit_budget]

    # ---- slots: admit, finish, compact (host side, between steps) ----

    def submit(
        self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], jobs: list[Job], ready: Any = None,
        prefilled: "Prefilled | None" = None,
    ) -> None:
        """Queue encoded utterances: cross_kv per decoder layer [len(jobs), H, ctx, hd], one row per job.
        `ready`: a CUDA event the encoder recorded on its own stream; decoding waits for it on the
        GPU, not the host, so the encoder of new arrivals overlaps with the steps of running ones.
        `prefilled`: their forced tokens' pass, if the encoder ran it (else it runs at admission)."""
        if cross_kv[0][0].shape[0] != len(jobs):
            raise ValueError(f"{cross_kv[0][0].shape[0]} encoder rows for {len(jobs)} jobs")
        for job in jobs:
            if len(job.prefix) + job.budget > self.prefix.shape[1]:
                raise ValueError(f"prefix of {len(job.prefix)} + budget {job.budget} is over {self.prefix.shape[1]} positions")
        self.pending.append((cross_kv, list(jobs), ready, prefilled))

    @property
    def busy(self) -> bool:
        return bool(self.live or self.pending)

    def _admit(self) -> None:
        """Move waiting utterances into free slots: one copy per layer for a whole encoded batch."""
        if self.pending and self.active > self.live:
            self._compact()  # new utterances go after the running ones
        while self.pending and self.active < self.slots:
            cross_kv, jobs, ready, prefilled = self.pending[0]
            if ready is not None:
                if self.live and not ready.query():
                    break  # still encoding: the running slots step on meanwhile, not wait for it
                torch.cuda.current_stream().wait_event(ready)
            take = min(len(jobs), self.slots - self.active)
            if take < len(jobs):  # the rest waits for the next free slots
                rest = prefilled.rows(slice(take, None)) if prefilled else None
                self.pending[0] = ([(k[take:], v[take:]) for k, v in cross_kv], jobs[take:], None, rest)
                cross_kv, jobs = [(k[:take], v[:take]) for k, v in cross_kv], jobs[:take]
                prefilled = prefilled.rows(slice(None, take)) if prefilled else None
            else:
                self.pending.popleft()
            self._place(cross_kv, jobs, prefilled)

    def _place(self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], jobs: list[Job], prefilled: "Prefilled | None" = None) -> None:
        start, take, dev = self.active, len(jobs), self.model.device
        ctx = cross_kv[0][0].shape[2]
        for (k, v), (jk, jv) in zip(self.cross_kv, cross_kv):
            k[start : start + take, :, :ctx] = jk
            v[start : start + take, :, :ctx] = jv
        prefix = np.zeros((take, self.prefix.shape[1]), np.int64)
        for j, job in enumerate(jobs):
            prefix[j, : len(job.prefix)] = job.prefix
        block = slice(start, start + take)
        self.prefix[block] = to_device(prefix, dev)
        self.token[block] = self.prefix[block, 0]
        self.cross_len[block] = ctx
        for name, values in (("prefix_len", [len(j.prefix) for j in jobs]), ("sot_pos", [j.sot_index for j in jobs]),
                             ("budget", [j.budget for j in jobs])):
            getattr(self, name)[block] = to_device(values, dev)
        for t in (self.pos, self.n_out, self.logprob, self.no_speech, self.done, self.hit_budget):
            t[block] = 0
        self._prefill(start, cross_kv, jobs, prefilled)
        self.jobs[block] = jobs
        self._slot_of.update((id(job), start + j) for j, job in enumerate(jobs))
        self.active += take
        self.live += take
        # Bounds over the active slots, for the buckets a step reads (reset when all leave).
        self._max_ctx = max(self._max_ctx, ctx)
        self._min_ctx = min(self._min_ctx, ctx)
        self._max_pos = max(self._max_pos, max(len(j.prefix) + j.budget for j in jobs))

    def _prefill(
        self, start: int, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], jobs: list[Job], prefilled: "Prefilled | None"
    ) -> None:
        """Run all forced tokens but the last in one pass per distinct prefix, and leave each slot
        at its last forced token: the next step feeds it and yields the first free token. The
        no-speech probability is read from this pass when <|startoftranscript|> is in it."""
        if prefilled is not None and all(tuple(j.prefix) == prefilled.prefix for j in jobs):
            self._write_prefix(slice(start, start + len(jobs)), prefilled)
            return
        groups: dict[tuple[int, ...], list[int]] = {}
        for j, job in enumerate(jobs):
            groups.setdefault(tuple(job.prefix), []).append(j)
        for prefix, members in groups.items():
            if len(prefix) < 2:
                continue  # a one-token prefix: the step feeds it from position 0
            whole = len(members) == len(jobs)
            index = to_device(members, self.model.device)
            rows = slice(start, start + len(jobs)) if whole else index + start
            group_kv = cross_kv if whole else [(k[index], v[index]) for k, v in cross_kv]
            self._write_prefix(rows, prefix_pass(self.model, self.tok, prefix, jobs[members[0]].sot_index, group_kv))

    def _write_prefix(self, rows: "slice | torch.Tensor", prefilled: "Prefilled") -> None:
        L = len(prefilled.prefix) - 1
        for (k, v), (nk, nv) in zip(self.self_kv, prefilled.kv):
            k[rows, :, :L] = nk
            v[rows, :, :L] = nv
        self.pos[rows] = L
        self.token[rows] = prefilled.prefix[L]
        if prefilled.no_speech is not None:
            self.no_speech[rows] = prefilled.no_speech
            self.sot_pos[rows] = -1  # read here, not by a step

    _max_ctx = 0
    _min_ctx = CONTEXT_BUCKETS[-1]  # a lower bound: the cross-attention needs no mask while it is the context's bucket
    _max_pos = 0  # ... and of the positions any of them can reach

    def _compact(self) -> None:
        """Move the running slots above `live` into the finished ones below it. Done lazily, when
        the smaller batch bucket would do or new utterances need the room: each move copies the
        slot's caches, and a finished slot costs nothing while it waits (it is masked as done)."""
        holes = [s for s in range(self.live) if self.jobs[s] is None]
        movers = [s for s in range(self.live, self.active) if self.jobs[s] is not None]
        if holes:
            dev = self.model.device
            src, dst = to_device(movers, dev), to_device(holes, dev)
            ctx, positions = self._max_ctx, self._max_pos
            for k, v in self.cross_kv:
                k[dst, :, :ctx] = k[src, :, :ctx]
                v[dst, :, :ctx] = v[src, :, :ctx]
            for k, v in self.self_kv:
                k[dst, :, :positions] = k[src, :, :positions]
                v[dst, :, :positions] = v[src, :, :positions]
            for t in (self.cross_len, self.token, self.pos, self.prefix, self.prefix_len, self.sot_pos, self.budget,
                      self.n_out, self.out, self.logprob, self.no_speech, self.done, self.hit_budget):
                t[dst] = t[src]
            for h, m in zip(holes, movers):
                self.jobs[h], self.jobs[m] = self.jobs[m], None
                self._slot_of[id(self.jobs[h])] = h
        self.active = self.live

    def run_once(self) -> list[Job]:
        """Admit what waits (as slots allow), advance every active slot steps_per_launch tokens, return the jobs
        found finished.

        On a GPU the host does not wait for the step it launched: it reads the finished flags of
        the step before (copied to pinned memory behind it), so launching step k+1 overlaps with
        the GPU running step k. A slot that finished keeps being stepped, masked as done, until
        its flags are read. Compaction and admission act on what the host knows and are queued
        behind the running step: they never wait for it. Each flag record keeps the jobs its
        step saw, so a record read after slots moved still names the right jobs."""
        finished: list[Job] = []
        shrink = self.active > self.live and _bucket(self.live or 1, BATCH_BUCKETS) < _bucket(self.active, BATCH_BUCKETS)
        full = bool(self.pending) and self.active >= self.slots
        if (shrink or full) and self.active > self.live:
            self._compact()
        if self.pending:
            self._admit()
        if not self.live:
            return finished + self._drain()
        n = self.active
        self._run_step(n)
        self._flags.append(self._copy_flags(n))
        while len(self._flags) > (1 if self.graphs else 0):
            finished += self._read_flags(self._flags.pop(0))
        return finished

    def _copy_flags(self, n: int) -> "_Flags":
        """This step's finished flags and every result a finished slot needs (tokens, counts,
        log-probabilities, no-speech probabilities), copied behind the step: reading them later
        never waits for a step still running. ~0.5 MB at 256 slots."""
        sources = {
            "done": self.done[:n], "out": self.out[:n], "n_out": self.n_out[:n], "logprob": self.logprob[:n],
            "no_speech": self.no_speech[:n], "hit": self.hit_budget[:n],
        }
        if not self.graphs:
            return _Flags(None, {k: v.cpu() for k, v in sources.items()}, self.jobs[:n])
        host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sources.items()}
        for k, v in sources.items():
            host[k].copy_(v, non_blocking=True)
        # A blocking event: the thread that waits on it sleeps until the GPU gets there, where a
        # default one spins a core for the whole decode step (most of a GPU worker's CPU).
        event = torch.cuda.Event(blocking=True)
        event.record()
        return _Flags(event, host, self.jobs[:n])

    def _read_flags(self, flags: "_Flags") -> list[Job]:
        if flags.event is not None:
            flags.event.synchronize()
        host = flags.host
        done = host["done"].numpy()
        out, n_out = host["out"].numpy(), host["n_out"].numpy()
        logprob, no_speech, hit = host["logprob"].numpy(), host["no_speech"].numpy(), host["hit"].numpy()
        jobs = []
        for s in np.flatnonzero(done):
            job = flags.jobs[s]
            if job is None or job.result is not None:  # an empty slot, or reported by an earlier record
                continue
            tokens = out[s, : int(n_out[s])].tolist()
            job.result = Decoded(tokens, job.language, float(no_speech[s]), float(logprob[s] / (len(tokens) + 1)), bool(hit[s]))
            self.jobs[self._slot_of.pop(id(job))] = None
            jobs.append(job)
        self.live -= len(jobs)
        if not self.live:
            self.active = 0
            self._max_ctx = self._max_pos = 0
            self._min_ctx = CONTEXT_BUCKETS[-1]
        return jobs

    def _drain(self) -> list[Job]:
        finished: list[Job] = []
        while self._flags:
            finished += self._read_flags(self._flags.pop(0))
        return finished

    def run(
        self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], jobs: list[Job], ready: Any = None,
        prefilled: "Prefilled | None" = None,
    ) -> list[Job]:
        """Decode these jobs to the end (with whatever else is in flight); returned in input order."""
        self.submit(cross_kv, jobs, ready, prefilled)
        waiting = {id(j) for j in jobs}
        while waiting:
            for job in self.run_once():
                waiting.discard(id(job))
        return jobs


@dataclass
class Prefilled:
    """The forced tokens' pass for utterances sharing one prefix, run by the engine right after
    their encoder (in the same CUDA graph): self-attention (K, V) per layer [B, H, len(prefix) - 1,
    hd] and the no-speech probability [B] (None when <|startoftranscript|> is the last forced token)."""

    prefix: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    no_speech: torch.Tensor | None

    def rows(self, part: slice) -> "Prefilled":
        return Prefilled(self.prefix, [(k[part], v[part]) for k, v in self.kv], None if self.no_speech is None else self.no_speech[part])


def prefix_pass(
    model: TorchWhisper, tok: WhisperTokenizer, prefix: tuple[int, ...], sot_index: int,
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor | None = None,
) -> Prefilled:
    """All forced tokens of `prefix` but the last, for every row of cross_kv, in one pass.
    `ids`: those tokens already on the device, for a pass captured in a CUDA graph (a capture
    must not copy from host memory that is reused once it ends)."""
    L = len(prefix) - 1
    if ids is None:
        ids = to_device(list(prefix[:L]), model.device)
    kv, logits = model.prefill(ids[None, :].expand(cross_kv[0][0].shape[0], L), cross_kv, sot_index if sot_index < L else None)
    no_speech = None if logits is None else torch.softmax(logits, dim=-1)[:, tok.no_speech]
    return Prefilled(prefix, kv, no_speech)


@dataclass
class _Flags:
    """What one step left for the host: an event that says its copies are done, the copies, and
    the job in each slot when the step was launched."""

    event: Any
    host: dict[str, torch.Tensor]
    jobs: list[Job | None]


def make_prefix(tok: WhisperTokenizer, language: str, prompt: list[int] | None) -> tuple[list[int], int]:
    """The forced tokens of an utterance and the index of <|startoftranscript|> in them, as
    decoding.greedy_decode builds them."""
    head = ([tok.sot_prev, *prompt[-MAX_PROMPT_TOKENS:]] if prompt else []) + [tok.sot]
    return head + list(tok.task_prefix(language)), len(head) - 1
