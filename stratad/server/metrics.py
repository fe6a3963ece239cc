"""Prometheus metrics through `prometheus_client`, in a `CollectorRegistry` the daemon owns.

Names follow vLLM's where one exists (`vllm:num_requests_running` -> `strata:num_requests_running`,
`vllm:e2e_request_latency_seconds`, `vllm:prompt_tokens_total`, ...), with the served model as
the `model_name` label. Updates come from the event loop and from the engine thread
(`prometheus_client`'s metrics are thread-safe). The process collectors (`process_*`,
`python_*`) come with the registry.

What only Strata has is read at scrape time from the objects that own it, never copied:
the expert store through its torch-free view (`watch_store`: a `StoreView`, as the control
socket reads it) and the engine's own samples (`add_collector`: a callable returning
`(name, help, labels, value)`; a name ending in `_total` is a counter, the rest gauges).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from stratad.protocol import CoverageReply, PlanReply

Sample = tuple[str, str, Mapping[str, str], float]  # name, help, labels, value
Collector = Callable[[], Iterable[Sample]]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODEL = "model_name"

log = logging.getLogger("stratad.server")

# vLLM's buckets for request latencies (seconds) and token counts
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                   160.0, 640.0)  # fmt: skip
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class StoreView(Protocol):
    """The expert store as /metrics reads it (`stratad.control.store_view.ExpertStoreView`)."""

    def plan(self) -> PlanReply: ...

    def coverage(self) -> CoverageReply: ...

    def tier_hits(self) -> dict[str, int]: ...

    def pinned_bytes(self) -> int: ...

    def slot_moves(self) -> int: ...


class _Labelled:
    """A metric whose `model_name` label is the served model's, filled in at each update."""

    def __init__(
        self, metric: Counter | Histogram, model: Callable[[], str] | None, labels: int = 0
    ) -> None:
        self.metric, self.model, self.labels = metric, model, labels

    def start(self) -> None:
        """Expose the model's series at zero before the first update (rate() needs one), for
        a metric with no label besides `model_name`."""
        if self.model is not None and not self.labels:
            self._child({})

    def _child(self, labels: dict[str, str]) -> Any:
        if self.model is not None:
            labels = {MODEL: self.model(), **labels}
        return self.metric.labels(**labels) if labels else self.metric

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)


class ServerMetrics:
    """The daemon's metrics: requests (the scheduler and the handlers update them), live
    gauges, the process, and what the engine and the expert store report."""

    def __init__(self) -> None:
        self.model_name = ""
        self.registry = r = CollectorRegistry()
        for process in (ProcessCollector, PlatformCollector, GCCollector):
            process(registry=r)

        def counter(name: str, help: str, labels: Sequence[str] = ()) -> _Labelled:
            c = Counter(name, help, [MODEL, *labels], registry=r)
            return _Labelled(c, self._model, len(labels))

        def histogram(name: str, help: str, buckets: Sequence[float]) -> _Labelled:
            h = Histogram(name, help, [MODEL], buckets=buckets, registry=r)
            return _Labelled(h, self._model)

        self.prompt_tokens = counter("strata:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter(
            "strata:generation_tokens", "Generation tokens processed."
        )
        self.prefix_queries = counter(
            "strata:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "strata:prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache."
        )
        self.request_success = counter(
            "strata:request_success",
            "Finished requests, by finish reason (stop, length, abort, error).",
            ["finished_reason"],
        )
        self.rejected = counter(
            "strata:request_rejected",
            "Requests refused before they ran (queue_full, unavailable).",
            ["reason"],
        )
        # by route, as HTTP instrumentation labels it (no model: /health has none)
        self.http_requests = _Labelled(
            Counter("strata:http_requests", "HTTP requests answered, by route and status.",
                    ["handler", "status"], registry=r),
            None,
        )  # fmt: skip
        self.e2e = histogram(
            "strata:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "strata:request_queue_time_seconds", "Time spent waiting for the engine.",
            LATENCY_BUCKETS,
        )  # fmt: skip
        self.ttft = histogram(
            "strata:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "strata:inter_token_latency_seconds", "Time between generated tokens.", STEP_BUCKETS
        )
        self.prefill_time = histogram(
            "strata:request_prefill_time_seconds", "Time spent in prefill.", LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "strata:request_decode_time_seconds", "Time spent in decode.", LATENCY_BUCKETS
        )
        self.prompt_hist = histogram(
            "strata:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.generation_hist = histogram(
            "strata:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.cancel_latency = histogram(
            "strata:cancel_latency_seconds",
            "From a client's disconnect to the engine being free again.",
            STEP_BUCKETS,
        )
        self.live = _Live(self._model)
        r.register(self.live)

    def _model(self) -> str:
        return self.model_name

    def serve(self, model_name: str) -> None:
        """The served model's name: the `model_name` label from now on, its series at zero."""
        self.model_name = model_name
        for metric in vars(self).values():
            if isinstance(metric, _Labelled):
                metric.start()

    def bind_scheduler(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self.live.running, self.live.waiting = running, waiting

    def add_collector(self, collector: Collector) -> None:
        """The engine's own samples (decode time by stage, KV cache, prefix cache, ...)."""
        self.live.collectors.append(collector)

    def watch_store(self, view: StoreView) -> None:
        """The expert store's tiers, coverage, plan, moves and pinning, read at each scrape."""
        self.live.store = view

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """A `prometheus_client` collector of what is read at scrape time."""

    def __init__(self, model: Callable[[], str]) -> None:
        self.model = model
        self.running: Callable[[], float] = lambda: 0.0
        self.waiting: Callable[[], float] = lambda: 0.0
        self.collectors: list[Collector] = []
        self.store: StoreView | None = None

    def describe(self) -> list[Metric]:
        return []  # read at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        model = self.model()
        for name, help, read in (
            ("strata:num_requests_running", "Requests the engine is working on.", self.running),
            ("strata:num_requests_waiting", "Requests waiting (queue depth).", self.waiting),
        ):
            g = GaugeMetricFamily(name, help, labels=[MODEL])
            g.add_metric([model], read())
            yield g
        yield from self._samples(model)
        if self.store is not None:
            try:
                yield from _store_families(self.store, model)
            except Exception:  # a scrape must not fail for one source: say it, go on
                log.exception("reading the expert store for /metrics failed")

    def _samples(self, model: str) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for collect in self.collectors:
            for name, help, labels, value in collect():
                keys = sorted(labels)
                family = families.get(name)
                if family is None:
                    kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                    family = families[name] = kind(name, help, labels=[MODEL, *keys])
                family.add_metric([model, *(labels[k] for k in keys)], value)
        yield from families.values()


def _store_families(view: StoreView, model: str) -> Iterator[Metric]:
    """The expert store's families: where lookups were served, coverage, the plan, moves."""
    plan, cov = view.plan(), view.coverage()

    def gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, help, labels=[MODEL])
        g.add_metric([model], value)
        return g

    def counter(name: str, help: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, help, labels=[MODEL])
        c.add_metric([model], value)
        return c

    lookups = CounterMetricFamily(
        "strata:expert_lookups",
        "Routed experts by the tier that held them: vram (a VRAM slot), ram (the resident RAM"
        " copy), file (read from the model file).",
        labels=[MODEL, "tier"],
    )
    for tier, n in view.tier_hits().items():
        lookups.add_metric([model, tier], n)
    yield lookups
    experts = GaugeMetricFamily(
        "strata:expert_coverage_experts",
        "Experts by where the plan keeps them: vram, ram (a resident RAM copy), file_only.",
        labels=[MODEL, "tier"],
    )
    for tier, n in (("vram", cov.in_vram), ("ram", cov.in_ram), ("file_only", cov.in_file_only)):
        experts.add_metric([model, tier], n)
    yield experts
    yield gauge("strata:expert_coverage_routed_mass",
                "Share (0-1) of the profile's routed mass whose experts are in VRAM or RAM.",
                cov.routed_mass)  # fmt: skip
    yield gauge("strata:expert_coverage_complete",
                "1 when no expert is read from the file.", float(cov.complete))  # fmt: skip
    info = InfoMetricFamily("strata:expert_plan", "The residency plan's hash.", labels=[MODEL])
    info.add_metric([model], {"plan_hash": plan.hash})
    yield info
    yield counter("strata:expert_file_reads",
                  "Expert blobs read from the model file (start-up fills and pinning"
                  " included).", cov.file_reads)  # fmt: skip
    yield counter("strata:expert_file_read_bytes",
                  "Bytes of experts read from the model file.", cov.file_read_bytes)  # fmt: skip
    moves = view.slot_moves()
    slot_bytes = plan.vram.bytes // plan.vram.experts if plan.vram.experts else 0
    yield counter("strata:expert_slot_moves",
                  "Experts copied into a VRAM slot (the cache policy's moves).", moves)  # fmt: skip
    yield counter("strata:expert_slot_move_bytes",
                  "Bytes copied over PCIe into VRAM slots by those moves.",
                  moves * slot_bytes)  # fmt: skip
    yield gauge("strata:expert_pinned_bytes",
                "Bytes of resident expert copies page-locked so far.",
                view.pinned_bytes())  # fmt: skip
    yield gauge("strata:expert_pin_target_bytes",
                "Bytes of resident expert copies the plan keeps in RAM (pinning's goal).",
                plan.ram.bytes)  # fmt: skip
