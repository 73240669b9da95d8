"""The server's Prometheus metrics, one set of names for every mode (prometheus-client).

A process has one Metrics: a gateway records the ingest side (streams, busy answers, queue
depth), a worker the recognition side (batches, latency, outcomes, engine loads), `serve` both;
every name is exposed in every mode, so dashboards and alerts work unchanged across them.
Process metrics (CPU, memory, open files) come from the client's own collectors.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from engines.loading import ENGINE_LOADS

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Read(Collector):
    """Samples read at each scrape (per-room stream counts, engine loads, GPU memory)."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self._read())
        except Exception:  # noqa: BLE001 - a metric must never break a scrape
            return []


class Metrics:
    def __init__(self, streams_per_room: Callable[[], dict[str, int]] = dict) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.queue_depth = Gauge("streamserver_queue_depth", "utterances waiting for or in recognition", registry=r)
        self.busy_rejections = Counter("streamserver_busy_rejections", "joins turned away as busy", registry=r)
        self.paced_refusals = Counter("streamserver_paced_refusals", "streams closed for sending audio faster than real time",
                                      registry=r)
        self.batch_size = Histogram("streamserver_batch_size", "utterances per engine batch", buckets=BATCH_BUCKETS, registry=r)
        self.recognition_seconds = Counter("streamserver_recognition_seconds", "time a worker's batches spent, by part "
                                           "(engine: Whisper; intent: the labels)", ["part"], registry=r)
        self.eos_to_published = Histogram("streamserver_eos_to_published_seconds", "end of speech to published",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.utterances = Counter("streamserver_utterances", "utterances finished, by outcome", ["outcome"], registry=r)
        self.hints = Counter("streamserver_hints", "partial and speculative utterances, by outcome (offered for "
                             "recognition; not_wanted: no worker takes them now; unreachable)", ["kind", "outcome"], registry=r)
        self.partials = Counter("streamserver_partials", "partial transcripts, by outcome (published; late: the final came "
                                "first)", ["outcome"], registry=r)
        self.speculations = Counter("streamserver_speculations", "speculative finals, by outcome (recognised; used_at_end: "
                                    "the final took it without recognition; used_by_worker; waited_for_in_vain: a final waited for a "
                                    "speculation that did not come, and was recognised)", ["outcome"], registry=r)
        self.worker_seconds = Counter("streamserver_worker_seconds", "where a worker's loop spends its time, by step "
                                      "(read: waiting for jobs; speculations: looking up finals' speculations; riders: "
                                      "taking hints for a finals' batch; recognition: engine and labels of finals' batches; "
                                      "publication_wait: for the batch before's publication; hints: passes of hints alone, "
                                      "their publication included; deferred: finals waiting for a speculation) and "
                                      "publication (finals' batches published, beside the loop)", ["step"], registry=r)
        self.engine_busy = Gauge("streamserver_engine_busy_ratio", "share of the last seconds the engine was recognising",
                                 registry=r)
        self.loop_lag = Histogram("streamserver_event_loop_lag_seconds", "how late the event loop wakes from a 0.1 s sleep",
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=r)
        self.streams_per_room = streams_per_room
        r.register(_Read(self._streams))
        r.register(_Read(_engine_loads))
        r.register(_Read(_gpu_memory))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _streams(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("streamserver_active_streams", "student audio streams per room", labels=["room"])
        for room_id, n in sorted(self.streams_per_room().items()):
            family.add_metric([room_id], float(n))
        yield family


def _engine_loads() -> Iterable[Metric]:
    family = CounterMetricFamily("streamserver_engine_loads", "engine loads by backend and outcome", labels=["backend", "outcome"])
    for (backend, outcome), n in sorted(ENGINE_LOADS.items()):
        family.add_metric([backend, outcome], float(n))
    yield family


def _gpu_memory() -> Iterable[Metric]:
    """Bytes of GPU memory PyTorch holds, per device (none without torch or a GPU)."""
    family = GaugeMetricFamily("streamserver_gpu_memory_bytes", "GPU memory held by the engine", labels=["device"])
    torch = sys.modules.get("torch")  # only if the engine already loaded it
    if torch is not None and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            family.add_metric([str(i)], float(torch.cuda.memory_allocated(i)))
    yield family
