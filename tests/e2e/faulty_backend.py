"""A sim backend with a fault-injecting executor, and (`python -m tests.e2e.faulty_backend`) a
real serve process whose executor fails every step: it prints its port, then serves until
the engine dies and exits with the server's status."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

from hybridserve.cli.serve_commands import build_app
from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.executor.api import Executor
from hybridserve.kvcache import CacheLayout
from hybridserve.server.app import ServerSettings
from hybridserve.server.runner import serve

Fault = Callable[[StepPlan, Executor], StepResult]


class FaultyBackend(SimServingBackend):
    """The sim backend whose executor runs `fault(plan, inner)` instead of `inner(plan)`."""

    def __init__(self, fault: Fault, **options: Any) -> None:
        super().__init__(sim_speed=options.pop("sim_speed", 1000.0), **options)
        self.fault = fault
        self.failed_plans: list[StepPlan] = []

    def make_executor(self, layout: CacheLayout) -> Executor:
        inner = super().make_executor(layout)
        backend = self

        class Faulty:
            def execute(self, plan: StepPlan) -> StepResult:
                return backend.fault(plan, inner)

        return Faulty()


def always_fail(plan: StepPlan, inner: Executor) -> StepResult:
    raise RuntimeError("device lost")


def main() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print(port, flush=True)
    app = build_app(FaultyBackend(always_fail), ServerSettings())
    return serve(app, host="127.0.0.1", port=port)


if __name__ == "__main__":
    sys.exit(main())
