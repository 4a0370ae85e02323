"""The `hybridserve` command line."""

from hybridserve.cli import (
    cache_commands,
    calibrate_commands,
    fleet_commands,
    generate_commands,
    parallel_commands,
    serve_commands,
    sim_commands,
)
from hybridserve.cli.app import app

__all__ = [
    "app",
    "cache_commands",
    "calibrate_commands",
    "fleet_commands",
    "generate_commands",
    "main",
    "parallel_commands",
    "serve_commands",
    "sim_commands",
]


def main() -> None:
    app()
