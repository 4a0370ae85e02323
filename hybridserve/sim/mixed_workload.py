"""Two workloads a deployment meets beside steady agents:

- `bursty:rate=R,on=S,off=S,input=I,output=O[,requests=N]`: Poisson arrivals at R per second
  while a burst is on (S seconds), none while it is off, in turn from time 0. Fixed-length
  prompts that share nothing.
- `agents+rag:rate=R,input=I,output=O`: the E1 agents (the run's agent parameters) with a second
  tenant beside them: long single-shot prompts (a retrieval-augmented tenant) arriving as a
  Poisson process at R per second, sharing no tokens with the agents or with one another.

Both draw from the run's seed, so two configurations on one seed see the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridserve.core.errors import ConfigError
from hybridserve.engine import Engine, EngineStep
from hybridserve.sim.fixed_workload import prompt_tokens
from hybridserve.sim.loop import AgentSimulation, OpenLoopSimulation
from hybridserve.sim.workload import AgentWorkload

_BURSTY_USAGE = "bursty:rate=R,on=S,off=S,input=I,output=O[,requests=N]"
_RAG_USAGE = "agents+rag:rate=R,input=I,output=O"
_RAG_PREFIX = "rag"


def _options(
    text: str, names: dict[str, str], floats: set[str], usage: str
) -> dict[str, float | int]:
    options: dict[str, float | int] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in names:
            raise ConfigError("workload", item, f"use the keys {sorted(names)}: {usage}")
        try:
            options[names[key]] = float(value) if key in floats else int(value)
        except ValueError:
            raise ConfigError("workload", item, f"give a number, e.g. {key}=4: {usage}") from None
    return options


def _check_positive(name: str, value: float | None, usage: str) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"workload.{name}", value, f"use a positive number: {usage}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BurstyWorkload:
    """Poisson arrivals at `rate_per_s` during `on_s`-second bursts, `off_s` seconds apart."""

    rate_per_s: float
    on_s: float
    off_s: float
    input_tokens: int
    output_tokens: int
    num_requests: int | None = None  # None: as many as the run's duration allows

    def __post_init__(self) -> None:
        for name in ("rate_per_s", "on_s", "input_tokens", "output_tokens", "num_requests"):
            _check_positive(name, getattr(self, name), _BURSTY_USAGE)
        if not self.off_s >= 0:
            raise ConfigError("workload.off", self.off_s, f"use 0 or more seconds: {_BURSTY_USAGE}")

    @classmethod
    def parse(cls, text: str) -> BurstyWorkload:
        """The workload of `rate=R,on=S,off=S,input=I,output=O[,requests=N]` (after `bursty:`)."""
        names = {
            "rate": "rate_per_s",
            "on": "on_s",
            "off": "off_s",
            "input": "input_tokens",
            "output": "output_tokens",
            "requests": "num_requests",
        }
        options = _options(text, names, {"rate", "on", "off"}, _BURSTY_USAGE)
        missing = [k for k, v in names.items() if k != "requests" and v not in options]
        if missing:
            raise ConfigError("workload", f"bursty:{text}", f"give {missing}: {_BURSTY_USAGE}")
        return cls(**options)  # type: ignore[arg-type]

    def arrival_times(self, *, seed: int, until_s: float) -> Iterator[float]:
        """Arrival times up to `until_s` (or `num_requests` of them): a Poisson process on the
        burst clock (time with the gaps cut out), laid back onto the wall clock."""
        rng = random.Random(seed)
        on_clock = 0.0
        count = 0
        while self.num_requests is None or count < self.num_requests:
            on_clock += rng.expovariate(self.rate_per_s)
            bursts, into = divmod(on_clock, self.on_s)
            time_s = bursts * (self.on_s + self.off_s) + into
            if time_s > until_s:
                return
            yield time_s
            count += 1


def bursty_simulation(
    text: str,
    engine: Engine,
    *,
    duration_s: float,
    seed: int,
    on_step: Callable[[EngineStep], None] | None = None,
) -> OpenLoopSimulation:
    """The simulation of a `bursty:` workload string (`text` is what follows `bursty:`)."""
    workload = BurstyWorkload.parse(text)
    arrivals = [
        (time_s, f"b{i}", prompt_tokens(i, workload.input_tokens), workload.output_tokens)
        for i, time_s in enumerate(workload.arrival_times(seed=seed, until_s=duration_s))
    ]
    return OpenLoopSimulation(engine, arrivals, on_step=on_step)


@dataclass(frozen=True, kw_only=True, slots=True)
class RagTenant:
    """Long single-shot prompts at `rate_per_s` (Poisson) beside the agents."""

    rate_per_s: float
    input_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        for name in ("rate_per_s", "input_tokens", "output_tokens"):
            _check_positive(name, getattr(self, name), _RAG_USAGE)

    @classmethod
    def parse(cls, text: str) -> RagTenant:
        """The tenant of `rate=R,input=I,output=O` (after `agents+rag:`)."""
        names = {"rate": "rate_per_s", "input": "input_tokens", "output": "output_tokens"}
        options = _options(text, names, {"rate"}, _RAG_USAGE)
        missing = [k for k, v in names.items() if v not in options]
        if missing:
            raise ConfigError("workload", f"agents+rag:{text}", f"give {missing}: {_RAG_USAGE}")
        return cls(**options)  # type: ignore[arg-type]


class AgentsWithRagSimulation(AgentSimulation):
    """E1's agents and a RAG tenant's one-shot prompts on one engine."""

    def __init__(
        self,
        engine: Engine,
        workload: AgentWorkload,
        tenant: RagTenant,
        *,
        duration_s: float,
        seed: int,
        **kwargs: object,
    ) -> None:
        super().__init__(engine, workload, **kwargs)  # type: ignore[arg-type]
        self.tenant = tenant
        self._duration_s = duration_s
        # Its own stream: the agents draw what they drew without the tenant.
        self._rng = random.Random(f"rag-{seed}")

    def start(self) -> None:
        super().start()
        time_s, index = 0.0, 0
        while True:
            time_s += self._rng.expovariate(self.tenant.rate_per_s)
            if time_s > self._duration_s:
                return
            prompt = prompt_tokens(index, self.tenant.input_tokens)
            req_id = f"{_RAG_PREFIX}{index}"
            self.schedule_arrival(time_s, req_id, prompt, self.tenant.output_tokens, None)
            index += 1

    def finished(self, req_id: str, time_s: float, answer: list[int]) -> None:
        if req_id.startswith(_RAG_PREFIX):
            return  # one shot: nothing follows it
        super().finished(req_id, time_s, answer)
