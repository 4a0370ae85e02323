"""Benchmark-style fixed-length workloads: `fixed:input=I,output=O,concurrency=C[,requests=N]`
(closed loop, as `vllm bench serve --max-concurrency` or trtllm-bench run: C requests in flight,
a new one sent the moment one finishes) and `fixed:input=I,output=O,rate=R[,requests=N]`
(Poisson arrivals at R per second). Prompts share no tokens, so no prefix is reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridserve.core.errors import ConfigError
from hybridserve.engine import Engine, EngineStep
from hybridserve.sim.arrivals import poisson_arrivals
from hybridserve.sim.loop import OpenLoopSimulation, Simulation

_UNIQUE_BASE = 1 << 41  # above the Poisson/trace ranges, so workloads never share a token
_USAGE = "fixed:input=I,output=O,concurrency=C[,requests=N] or fixed:input=I,output=O,rate=R"


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedWorkload:
    """Requests of `input_tokens` prompt and exactly `output_tokens` answer tokens."""

    input_tokens: int
    output_tokens: int
    concurrency: int | None = None  # closed loop: requests in flight
    rate_per_s: float | None = None  # open loop: Poisson arrivals per second
    num_requests: int | None = None  # None: as many as the run's duration allows

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_per_s is None):
            raise ConfigError("workload", self.describe(), f"give concurrency or rate: {_USAGE}")
        for name in ("input_tokens", "output_tokens", "concurrency", "num_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"workload.{name}", value, "use 1 or more")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ConfigError("workload.rate", self.rate_per_s, "use a positive request rate")

    def describe(self) -> str:
        load = f"concurrency={self.concurrency}" if self.concurrency else f"rate={self.rate_per_s}"
        return f"fixed:input={self.input_tokens},output={self.output_tokens},{load}"

    @classmethod
    def parse(cls, text: str) -> FixedWorkload:
        """The workload of `input=I,output=O,concurrency=C,requests=N` (after `fixed:`)."""
        names = {
            "input": "input_tokens",
            "output": "output_tokens",
            "concurrency": "concurrency",
            "rate": "rate_per_s",
            "requests": "num_requests",
        }
        options: dict[str, float | int] = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in names:
                raise ConfigError("workload", item, f"fixed takes {sorted(names)}: {_USAGE}")
            try:
                options[names[key]] = float(value) if key == "rate" else int(value)
            except ValueError:
                raise ConfigError("workload", item, "give numbers, e.g. input=1024") from None
        for required in ("input_tokens", "output_tokens"):
            if required not in options:
                raise ConfigError("workload", f"fixed:{text}", f"give {required[:-7]}=: {_USAGE}")
        return cls(**options)  # type: ignore[arg-type]


def prompt_tokens(index: int, length: int) -> list[int]:
    """The unique prompt of request `index`."""
    base = _UNIQUE_BASE + index * (1 << 22)
    return list(range(base, base + length))


class ClosedLoopSimulation(Simulation):
    """`concurrency` clients, each sending its next request when its last one finishes."""

    def __init__(self, engine: Engine, workload: FixedWorkload, **kwargs: object) -> None:
        super().__init__(engine, **kwargs)  # type: ignore[arg-type]
        if workload.concurrency is None:
            raise ConfigError("workload.concurrency", None, "a closed loop needs concurrency=C")
        self.workload = workload
        self.sent = 0

    def start(self) -> None:
        for _ in range(self.workload.concurrency or 0):
            self._send(0.0)

    def _send(self, time_s: float) -> None:
        limit = self.workload.num_requests
        if limit is not None and self.sent >= limit:
            return
        w = self.workload
        self.schedule_arrival(
            time_s, f"f{self.sent}", prompt_tokens(self.sent, w.input_tokens), w.output_tokens, None
        )
        self.sent += 1

    def finished(self, req_id: str, time_s: float, answer: list[int]) -> None:
        self._send(time_s)


def fixed_simulation(
    text: str,
    engine: Engine,
    *,
    duration_s: float,
    seed: int,
    on_step: Callable[[EngineStep], None] | None = None,
) -> Simulation:
    """The simulation of a `fixed:` workload string (`text` is what follows `fixed:`)."""
    workload = FixedWorkload.parse(text)
    if workload.concurrency is not None:
        return ClosedLoopSimulation(engine, workload, on_step=on_step)
    rate = workload.rate_per_s or 0.0
    count = workload.num_requests or max(1, int(rate * duration_s))
    arrivals = [
        (time_s, f"f{i}", prompt_tokens(i, workload.input_tokens), workload.output_tokens)
        for i, (time_s, *_rest) in enumerate(
            poisson_arrivals(
                rate_per_s=rate, num_requests=count, input_tokens=0, output_tokens=0, seed=seed
            )
        )
    ]
    return OpenLoopSimulation(engine, arrivals, on_step=on_step)
