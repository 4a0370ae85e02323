"""The `hybridserve` command line."""

from hybridserve.cli import (
    agents_commands,
    cache_commands,
    calibrate_commands,
    fleet_commands,
    generate_commands,
    parallel_commands,
    serve_commands,
    sim_commands,
    suite_commands,
)
from hybridserve.cli.app import app

__all__ = [
    "agents_commands",
    "app",
    "cache_commands",
    "calibrate_commands",
    "fleet_commands",
    "generate_commands",
    "main",
    "parallel_commands",
    "serve_commands",
    "sim_commands",
    "suite_commands",
]


def main() -> None:
    app()
