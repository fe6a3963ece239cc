"""Prometheus metrics in the text exposition format, without a client library.

Names follow vLLM's where one exists (`vllm:num_requests_running` -> `strata:num_requests_running`,
`vllm:e2e_request_latency_seconds`, `vllm:prompt_tokens_total`, ...). Updates come from the
event loop and from the engine thread, so every family takes a lock.

Other parts of the daemon (the expert store: tier hits, coverage, plan hash) add their gauges
through `Registry.add_collector`: a callable returning `(name, help, labels, value)` samples,
read at every scrape.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

Sample = tuple[str, str, Mapping[str, str], float]  # name, help, labels, value
Collector = Callable[[], Iterable[Sample]]

# vLLM's buckets for request latencies (seconds) and token counts
LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Family:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labels)
        self.lock = threading.Lock()

    def _key(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Family):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self.lock:
            items = sorted(self.values.items())
        return [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]


class Gauge(_Family):
    """A gauge whose value a callable reads at scrape time."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        super().__init__(name, help)
        self.read = read

    def render(self) -> list[str]:
        return [f"{self.name} {_num(self.read())}"]


class Histogram(_Family):
    kind = "histogram"

    def __init__(
        self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(buckets)
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        if not labels:
            self.series[()] = ([0] * (len(self.buckets) + 1), [0.0])

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self.lock:
            counts, total = self.series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
            i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
            counts[i] += 1
            total[0] += value

    def count(self, **labels: str) -> int:
        series = self.series.get(self._key(labels))
        return sum(series[0]) if series else 0

    def render(self) -> list[str]:
        out = []
        with self.lock:
            items = sorted((k, (list(c), t[0])) for k, (c, t) in self.series.items())
        for key, (counts, total) in items:
            running = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                running += n
                le = f'le="{_num(bound)}"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {running}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_num(total)}")
            out.append(f"{self.name}_count{_labels(self.labelnames, key)} {running}")
        return out


class Registry:
    def __init__(self) -> None:
        self.families: list[_Family] = []
        self.collectors: list[Collector] = []

    def add(self, family: _Family) -> _Family:
        self.families.append(family)
        return family

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        c = Counter(name, help, labels)
        self.add(c)
        return c

    def histogram(
        self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        h = Histogram(name, help, buckets, labels)
        self.add(h)
        return h

    def gauge(self, name: str, help: str, read: Callable[[], float]) -> Gauge:
        g = Gauge(name, help, read)
        self.add(g)
        return g

    def add_collector(self, collector: Collector) -> None:
        """Register extra gauges (e.g. the expert store's tier hits, coverage and plan hash)."""
        self.collectors.append(collector)

    def render(self) -> str:
        lines: list[str] = []
        for f in self.families:
            lines += f.header()
            lines += f.render()
        extra: dict[str, tuple[str, list[str]]] = {}
        for collect in self.collectors:
            for name, help, labels, value in collect():
                entry = extra.setdefault(name, (help, []))
                names = sorted(labels)
                entry[1].append(f"{name}{_labels(names, [labels[n] for n in names])} {_num(value)}")
        for name, (help, samples) in extra.items():
            lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", *samples]
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """The daemon's request metrics; the scheduler and the handlers update them."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.prompt_tokens = r.counter("strata:prompt_tokens_total", "Prefill tokens processed.")
        self.generation_tokens = r.counter(
            "strata:generation_tokens_total", "Generation tokens processed."
        )
        self.prefix_queries = r.counter(
            "strata:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = r.counter(
            "strata:prefix_cache_hits_total", "Prompt tokens whose KV came from the prefix cache."
        )
        self.request_success = r.counter(
            "strata:request_success_total",
            "Finished requests, by finish reason (stop, length, abort, error).",
            ["finished_reason"],
        )
        self.http_requests = r.counter(
            "strata:http_requests_total",
            "HTTP requests answered, by route and status.",
            ["handler", "status"],
        )
        self.rejected = r.counter(
            "strata:request_rejected_total",
            "Requests refused before they ran (queue_full, unavailable).",
            ["reason"],
        )
        self.e2e = r.histogram(
            "strata:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self.queue_time = r.histogram(
            "strata:request_queue_time_seconds",
            "Time spent waiting for the engine.",
            LATENCY_BUCKETS,
        )
        self.ttft = r.histogram(
            "strata:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.itl = r.histogram(
            "strata:inter_token_latency_seconds", "Time between generated tokens.", STEP_BUCKETS
        )
        self.prefill_time = r.histogram(
            "strata:request_prefill_time_seconds", "Time spent in prefill.", LATENCY_BUCKETS
        )
        self.decode_time = r.histogram(
            "strata:request_decode_time_seconds", "Time spent in decode.", LATENCY_BUCKETS
        )
        self.prompt_hist = r.histogram(
            "strata:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.generation_hist = r.histogram(
            "strata:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.cancel_latency = r.histogram(
            "strata:cancel_latency_seconds",
            "From a client's disconnect to the engine being free again.",
            STEP_BUCKETS,
        )

    def bind_scheduler(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self.registry.gauge(
            "strata:num_requests_running", "Requests the engine is working on.", running
        )
        self.registry.gauge(
            "strata:num_requests_waiting", "Requests waiting (queue depth).", waiting
        )

    def render(self) -> str:
        return self.registry.render()
