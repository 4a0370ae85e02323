"""`hybridserve calibrate --url URL`: the black-box calibration of a running server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from hybridserve.cli.agents_commands import need_httpx
from hybridserve.cli.app import err, fail, out_console
from hybridserve.cli.calibrate_commands import print_summary
from hybridserve.core.errors import HybridServeError

if TYPE_CHECKING:
    from hybridserve.loadgen.calibrate import RemoteTarget


def calibrate_url(
    *,
    context_tokens: int | None,
    out: Path | None,
    quick: bool,
    seed: int,
    holdout_fraction: float,
    decode_shared_fraction: float = 0.0,
    **target: Any,
) -> None:
    """Measure the server's step times over HTTP, fit, and write the calibration file;
    `target` holds `_target`'s options."""
    need_httpx()
    from hybridserve.loadgen.calibrate import (
        REMOTE_GRID,
        REMOTE_QUICK_GRID,
        calibrate_remote,
        with_context,
    )
    from hybridserve.sim.calibration_fit import with_sharing

    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.completed:.0f} / {task.total:.0f}"),
        TimeElapsedColumn(),
    )
    try:
        grid = with_context(REMOTE_QUICK_GRID if quick else REMOTE_GRID, context_tokens)
        grid = with_sharing(grid, decode_shared_fraction)
        remote = _target(**target)
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task(f"measuring {remote.url}", total=1)
            result = asyncio.run(
                calibrate_remote(
                    remote,
                    grid=grid,
                    seed=seed,
                    holdout_fraction=holdout_fraction,
                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                )
            )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise fail("interrupted: no calibration was written") from None
    name = remote.gpu.name
    path = out if out is not None else Path("runs") / "calibration" / f"{name}-remote.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    print_summary(result.calibration, path)
    out_console().print(
        f"request overhead (TTFT - step, not in the fit): {result.request_overhead_s * 1e3:.2f} ms"
    )
    warning = result.pool_warning()
    if warning is not None:
        err.print(f"warning: {warning}", highlight=False)


async def _served_name(url: str, api_key: str | None) -> str | None:
    import httpx

    from hybridserve.loadgen.client import served_model

    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=30.0) as client:
        return await served_model(client, url=url, api_key=api_key)


def _target(
    *,
    url: str,
    model: str | None,
    api_key: str | None,
    gpu_name: str,
    model_config: Path | None,
    dtype: str | None,
    peaks_from: Path | None,
    server_speed: float,
    vocab_size: int,
) -> RemoteTarget:
    """The server and how to price its steps. Raises ConfigError."""
    from hybridserve.loadgen.calibrate import RemoteTarget, device_for, model_profile_for
    from hybridserve.sim.calibration import Calibration

    if model is None and model_config is None:
        model = asyncio.run(_served_name(url, api_key))
    gpu, peaks = device_for(gpu_name, peaks_from)
    chosen = dtype or (Calibration.load(peaks_from).dtype if peaks_from else "bf16")
    return RemoteTarget(
        url=url,
        model=model,
        api_key=api_key,
        gpu=gpu,
        peaks=peaks,
        profile=model_profile_for(model_config, model),
        dtype=chosen,
        kv_dtype=chosen if chosen in ("bf16", "fp32") else "bf16",
        vocab_size=vocab_size,
        server_speed=server_speed,
    )
