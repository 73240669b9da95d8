"""Prometheus metrics in the text exposition format, without a client library: counters, gauges
and histograms with labels, rendered on GET /metrics by gateways and workers."""

from __future__ import annotations

import math
import threading
from typing import Callable, Iterable

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{v}"' for k, v in labels] + ([extra] if extra else [])
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self._lock = threading.Lock()  # the ASR worker thread and the event loop both record

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        yield from self._samples()

    def _samples(self) -> Iterable[str]:
        return ()


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def _samples(self) -> Iterable[str]:
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(key)} {value}"


class Gauge(_Metric):
    """A value set by the code, or read from a callback at each scrape."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], dict[Labels, float]] | None = None) -> None:
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {}
        self.read = read

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self.values[tuple(sorted(labels.items()))] = value

    def _samples(self) -> Iterable[str]:
        values = self.read() if self.read else self.values
        for key, value in sorted(values.items()):
            yield f"{self.name}{_labels(key)} {value}"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self.counts[i] += 1
            self.total += value
            self.n += 1

    def _samples(self) -> Iterable[str]:
        for bound, count in zip(self.buckets, self.counts):
            le = "+Inf" if math.isinf(bound) else repr(bound)
            yield f'{self.name}_bucket{{le="{le}"}} {count}'
        yield f"{self.name}_sum {self.total}"
        yield f"{self.name}_count {self.n}"


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def gpu_memory() -> dict[Labels, float]:
    """Bytes of GPU memory PyTorch holds, per device (empty without torch or a GPU)."""
    try:
        import sys

        torch = sys.modules.get("torch")  # only if the engine already loaded it
        if torch is None or not torch.cuda.is_available():
            return {}
        return {(("device", str(i)),): float(torch.cuda.memory_allocated(i)) for i in range(torch.cuda.device_count())}
    except Exception:  # noqa: BLE001 - a metric must never break a scrape
        return {}
