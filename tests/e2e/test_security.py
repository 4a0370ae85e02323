"""Key handling, browser cross-origin requests, the OpenAPI schema and per-request seeds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app as cli_app
from hybridserve.cli.serve_commands import API_KEY_ENV, resolve_api_key
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.executor.api import Executor
from hybridserve.server.app import ServerSettings
from tests.e2e.conftest import MODEL, LiveServer, start_server
from tests.e2e.faulty_backend import FaultyBackend

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[LiveServer]:
    server = start_server(
        settings=ServerSettings(api_key="s3cret", allow_origins=("https://app.example",))
    )
    yield server
    server.stop()


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(keyed_server: LiveServer, scheme: str) -> None:
    response = keyed_server.client.post(
        keyed_server.base_url + "/v1/completions",
        json=BODY,
        headers={"Authorization": f"{scheme} s3cret"},
    )
    assert response.status_code == 200, response.text


def test_the_openapi_schema_is_served_with_the_key(keyed_server: LiveServer) -> None:
    response = keyed_server.client.get(
        keyed_server.base_url + "/openapi.json", headers={"Authorization": "Bearer s3cret"}
    )
    assert response.status_code == 200
    assert "/v1/completions" in response.json()["paths"]
    docs = keyed_server.client.get(
        keyed_server.base_url + "/docs", headers={"Authorization": "Bearer s3cret"}
    )
    assert docs.status_code == 404  # no interactive docs page is served at all


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_post_bodies_that_are_not_json_are_refused_with_415(
    live_server: LiveServer, content_type: str | None
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = live_server.client.post(
            live_server.base_url + path, content=b'{"model": "x"}', headers=headers
        )
        assert response.status_code == 415
        assert response.json()["error"]["code"] == "unsupported_media_type"
    live_server.wait_idle()


def test_json_with_a_charset_is_accepted(live_server: LiveServer) -> None:
    response = live_server.client.post(
        live_server.base_url + "/v1/completions",
        content=b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % MODEL.encode(),
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert response.status_code == 200, response.text


def test_an_allowed_origin_passes_cors_and_others_do_not(keyed_server: LiveServer) -> None:
    url = keyed_server.base_url + "/v1/completions"
    preflight = keyed_server.client.options(
        url,
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    key = {"Authorization": "Bearer s3cret"}
    allowed = keyed_server.client.post(
        url,
        content=b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % MODEL.encode(),
        headers={**key, "Origin": "https://app.example", "Content-Type": "text/plain"},
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = keyed_server.client.post(
        url,
        content=b"{}",
        headers={**key, "Origin": "https://evil.example", "Content-Type": "text/plain"},
    )
    assert other.status_code == 415
    assert "access-control-allow-origin" not in other.headers


def test_unseeded_requests_each_draw_a_fresh_seed_and_seeded_ones_keep_theirs() -> None:
    seeds: list[int | None] = []

    def record(plan: StepPlan, inner: Executor) -> StepResult:
        seeds.extend(c.sampling.seed for c in plan.chunks if c.sampling is not None)
        return inner.execute(plan)

    server = start_server(backend=FaultyBackend(record))
    try:
        for body in (BODY, BODY, BODY, {**BODY, "seed": 7}, {**BODY, "seed": 7}):
            assert (
                server.client.post(server.base_url + "/v1/completions", json=body).status_code
                == 200
            )
    finally:
        server.stop()
    drawn, given = seeds[:3], seeds[3:]
    assert None not in drawn and len(set(drawn)) == 3
    assert given == [7, 7]


def test_the_api_key_comes_from_the_flag_the_file_or_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key("flag", None, "env") == "flag"
    assert resolve_api_key(None, key_file, "env") == "from-file"
    assert resolve_api_key(None, None, "env") == "env"
    assert resolve_api_key(None, None, None) is None


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--api-key", "a", "--api-key-file", "KEYFILE"], {}, "give one of them"),
        (["--api-key-file", "MISSING"], {}, "cannot read it"),
        (["--api-key-file", "EMPTY"], {}, "is empty"),
        ([], {API_KEY_ENV: "  "}, "is empty"),
    ],
)
def test_bad_api_key_sources_stop_serve_with_a_message(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    (tmp_path / "KEYFILE").write_text("k")
    (tmp_path / "EMPTY").write_text("\n")
    args = [str(tmp_path / a) if a in ("KEYFILE", "MISSING", "EMPTY") else a for a in args]
    result = CliRunner().invoke(cli_app, ["serve", *args], env=env)
    assert result.exit_code == 2
    assert message in result.output
