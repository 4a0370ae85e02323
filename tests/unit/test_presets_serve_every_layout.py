"""Every preset serves every cache layout the project names: a control that does not apply to a
layout's groups turns itself off and says so once, and the engine runs session turns through
it without a leaked block."""

from __future__ import annotations

import pytest

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine
from hybridserve.engine.settings import PRESETS, preset
from hybridserve.kvcache import CacheLayout, KVCacheManager
from hybridserve.kvcache.spec import MambaSpec
from hybridserve.layouts import LAYOUTS
from hybridserve.scheduler import Scheduler
from tests.conftest import fake_executor


def _turns() -> list[Request]:
    """Two sessions of three growing turns each, beside two standalone prompts."""
    out = []
    for s in range(2):
        history = tuple(range(1000 * s, 1000 * s + 300))
        for t in range(3):
            prompt = history + tuple(range(50_000 + 100 * t, 50_000 + 100 * t + 40 * (t + 1)))
            out.append(
                Request(
                    req_id=f"s{s}t{t}",
                    prompt_token_ids=prompt,
                    sampling=SamplingParams(max_tokens=6, ignore_eos=True),
                    arrival_time=0.01 * len(out),
                    session_id=f"session-{s}",
                )
            )
    out += [
        Request(
            req_id=f"solo{i}",
            prompt_token_ids=tuple(range(90_000 + 5000 * i, 90_000 + 5000 * i + 900)),
            sampling=SamplingParams(max_tokens=4, ignore_eos=True),
        )
        for i in range(2)
    ]
    return out


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_runs_on_every_named_layout(name: str, layout_name: str) -> None:
    groups = LAYOUTS[layout_name].groups
    quantum = max((g.block_size for g in groups if isinstance(g, MambaSpec)), default=1)
    settings = preset(name, quantum=quantum, max_model_len=32_768)
    layout = CacheLayout(groups=groups, num_blocks=2048)
    scheduler = Scheduler(settings.scheduler, KVCacheManager(layout))
    assert len(scheduler.notices) == len(set(scheduler.notices))  # each said once
    engine = Engine(scheduler, fake_executor())
    for request in _turns():
        engine.add_request(request)
    for step in range(2_000):
        if not engine.has_requests():
            break
        engine.step(0.05 * step)
        scheduler.cache.check_invariants()
    assert not engine.has_requests(), f"{name} on {layout_name} left requests unfinished"
