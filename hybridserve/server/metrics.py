"""Prometheus metrics of one server, in its own CollectorRegistry.

Names mirror vLLM's `vllm:` metrics under `hybridserve:`; with `namespace="vllm"` (`serve
--metrics-names vllm`) they are exported under vLLM's own names, so dashboards, autoscalers and
routers built for vLLM read them unchanged. Labels are bounded: the model name, a
finish reason, a cache group's index and kind. Never a request id or any content.
Request latencies are observed where the client sees them (the event loop); engine counters
in the engine thread; scheduler and cache state is read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NS = "hybridserve"
NAMESPACES = ("hybridserve", "vllm")
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets for TTFT, ITL and request latencies.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# (name, labels, value, kind) with kind "counter" or "gauge"; counters named without `_total`.
Sample = tuple[str, dict[str, str], float, str]


class EngineStateCollector(Collector):
    """Scheduler gauges, cache and control counters, read from the engine at scrape time."""

    def __init__(
        self, read: Callable[[], list[Sample]], model_name: str, namespace: str = NS
    ) -> None:
        self._read = read
        self._model_name = model_name
        self._namespace = namespace

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for engine_name, labels, value, kind in self._read():
            name = engine_name
            if self._namespace != NS and engine_name.startswith(f"{NS}:"):
                name = f"{self._namespace}:{engine_name.removeprefix(f'{NS}:')}"
            keys = ["model_name", *labels]
            family = families.get(name)
            if family is None:
                doc = f"{name} (hybridserve engine state)"
                family = (
                    CounterMetricFamily(name, doc, labels=keys)
                    if kind == "counter"
                    else GaugeMetricFamily(name, doc, labels=keys)
                )
                families[name] = family
            family.add_metric([self._model_name, *labels.values()], value)
        yield from families.values()


class ServerMetrics:
    def __init__(self, model_name: str, namespace: str = NS) -> None:
        if namespace not in NAMESPACES:
            raise ValueError(f"--metrics-names {namespace!r}: use one of {', '.join(NAMESPACES)}")
        self.model_name = model_name
        self.namespace = namespace
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]
        reg = self.registry
        self.request_success = Counter(
            f"{namespace}:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            f"{namespace}:prompt_tokens", "Prefilled prompt tokens.", labels, registry=reg
        )
        self.generation_tokens = Counter(
            f"{namespace}:generation_tokens", "Generated tokens.", labels, registry=reg
        )
        self.num_preemptions = Counter(
            f"{namespace}:num_preemptions", "Preemptions by the scheduler.", labels, registry=reg
        )
        self.engine_steps = Counter(
            f"{namespace}:engine_steps", "Engine steps.", labels, registry=reg
        )
        self.engine_failed_steps = Counter(
            f"{namespace}:engine_failed_steps",
            "Engine steps the executor failed (their requests were aborted).",
            labels,
            registry=reg,
        )
        self.engine_step_seconds = Counter(
            f"{namespace}:engine_step_seconds",
            "Wall seconds spent in Engine.step.",
            labels,
            registry=reg,
        )
        self.engine_step_cpu_seconds = Counter(
            f"{namespace}:engine_step_cpu_seconds",
            "Engine-thread CPU seconds spent in Engine.step.",
            labels,
            registry=reg,
        )
        self.executor_step_seconds = Counter(
            f"{namespace}:executor_step_duration_seconds",
            "Step durations the executor reported (modelled time for the simulator).",
            labels,
            registry=reg,
        )
        self.ttft = Histogram(
            f"{namespace}:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            f"{namespace}:inter_token_latency_seconds",
            "Gap between consecutive output deliveries of a request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            f"{namespace}:e2e_request_latency_seconds",
            "Arrival to the last token.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            f"{namespace}:request_queue_time_seconds",
            "Arrival to first admission.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=reg,
        )
        # Exported at zero from the start, so a scrape before any traffic shows every series.
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.num_preemptions,
            self.engine_steps,
            self.engine_failed_steps,
            self.engine_step_seconds,
            self.engine_step_cpu_seconds,
            self.executor_step_seconds,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
        ):
            metric.labels(model_name)

    def attach(self, read: Callable[[], list[Sample]]) -> None:
        """Export the engine's state through `read`, called at every scrape."""
        self.registry.register(EngineStateCollector(read, self.model_name, self.namespace))

    def on_step(
        self,
        *,
        now: float,
        step_s: float,
        step_cpu_s: float,
        executor_s: float,
        admitted_arrivals: Sequence[float],
        num_prompt_tokens: int,
        num_generation_tokens: int,
        num_preemptions: int,
    ) -> None:
        """Engine-thread counters of one step."""
        m = self.model_name
        self.engine_steps.labels(m).inc()
        self.engine_step_seconds.labels(m).inc(step_s)
        self.engine_step_cpu_seconds.labels(m).inc(step_cpu_s)
        self.executor_step_seconds.labels(m).inc(executor_s)
        if num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.labels(m).inc(num_generation_tokens)
        if num_preemptions:
            self.num_preemptions.labels(m).inc(num_preemptions)
        queue_time = self.queue_time.labels(m)
        for arrival in admitted_arrivals:
            queue_time.observe(max(now - arrival, 0.0))

    def on_failed_step(self) -> None:
        self.engine_failed_steps.labels(self.model_name).inc()

    def on_finished(self, *, reason: str, latency_s: float) -> None:
        """A request ended, for any reason, `latency_s` after it arrived."""
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(max(latency_s, 0.0))

    def on_first_token(self, latency_s: float) -> None:
        self.ttft.labels(self.model_name).observe(latency_s)

    def on_gap(self, gap_s: float) -> None:
        self.itl.labels(self.model_name).observe(gap_s)
