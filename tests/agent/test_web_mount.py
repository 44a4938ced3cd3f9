"""The web front end at ``/``: served from its build folder, or a 503 page naming ``make web``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.agent.api.web import NOT_BUILT, mount_web
from services.common.security_headers import HEADERS
from tests.agent.stack import agent_stack


def _app(folder: Path) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/ping")
    def ping() -> dict[str, bool]:
        return {"ok": True}

    mount_web(app, folder)
    return app


def test_a_built_folder_is_served_with_the_security_headers(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<title>Tandem</title>")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "app.js").write_text("export {};")
    client = TestClient(_app(tmp_path))
    index = client.get("/")
    assert index.status_code == 200 and "<title>Tandem</title>" in index.text
    assert index.headers["content-security-policy"] == HEADERS["Content-Security-Policy"]
    assert client.get("/assets/app.js").text == "export {};"
    assert client.get("/v1/ping").json() == {"ok": True}


def test_without_a_build_the_page_says_how_to_make_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A folder without index.html (an interrupted build) counts as not built, like a missing one.
    (tmp_path / "assets").mkdir()
    for folder in (tmp_path, tmp_path / "missing"):
        with caplog.at_level("WARNING", logger="tandem.agent.web"):
            app = _app(folder)
        assert any(NOT_BUILT in r.getMessage() and str(folder) in r.getMessage() for r in caplog.records)
        client = TestClient(app)
        page = client.get("/")
        assert page.status_code == 503
        assert page.headers["content-type"].startswith("text/html")
        assert "make web" in page.text and "not built" in page.text
        assert page.headers["x-frame-options"] == "DENY"
        assert client.get("/v1/ping").json() == {"ok": True}
        assert client.get("/assets/app.js").status_code == 404
        assert "/" not in app.openapi()["paths"]


def test_the_agent_says_the_front_end_is_not_built(redis_url: str, tmp_path: Path) -> None:
    empty = tmp_path / "dist"
    empty.mkdir()
    with agent_stack(redis_url, tmp_path / "home", web_dist=str(empty)) as s:
        page = httpx.get(f"{s.url}/")
        assert page.status_code == 503 and "make web" in page.text
        assert httpx.get(f"{s.url}/healthz").status_code == 200
