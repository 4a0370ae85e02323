"""`hybridserve dcp-demo` reports the sharded tokens against the unsharded run."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hybridserve.cli import app


def test_dcp_demo_on_one_rank_reports_tokens_identical_to_the_unsharded_run():
    result = CliRunner().invoke(app, ["dcp-demo", "--dcp", "1", "--model", "gqa"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["identical"] and report["ranks_agree"]
    assert report["tokens"] == report["unsharded_tokens"]
    assert len(report["tokens"]["a"]) == 6


def test_dcp_demo_rejects_a_width_that_does_not_divide_the_mla_heads():
    result = CliRunner().invoke(app, ["dcp-demo", "--dcp", "3", "--model", "sparse-mla"])
    assert result.exit_code == 2
    assert "divisor of the head count" in result.output
