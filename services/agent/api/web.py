"""The web front end at ``/``: its build folder as static files, or a page saying it is not built.

The build (``services/agent/web/dist``) is made by ``make web`` (npm), not kept in the repository,
so a checkout without Node has none: ``/`` then answers 503 with a page that says how to build it,
and every API route works as before.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from services.common.security_headers import HEADERS, SecureStaticFiles

log = logging.getLogger("tandem.agent.web")

NOT_BUILT = "the web front end is not built: run make web"
NOT_BUILT_PAGE = (
    '<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>Tandem</title></head>\n'
    "<body><h1>The web front end is not built</h1>\n"
    "<p>Run <code>make web</code> in the repository (it runs <code>npm ci</code> and "
    "<code>npm run build</code> in <code>services/agent/web</code>), then reload this page. "
    "The APIs under <code>/v1</code> work without it.</p></body></html>\n"
)


def mount_web(app: FastAPI, folder: Path) -> None:
    """Serves ``folder`` at ``/`` when it holds a build; else ``GET /`` is the not-built page.

    Call it after every router: a mount at ``/`` would otherwise shadow the API routes."""
    if (folder / "index.html").is_file():
        # CSP without inline script, no framing, nosniff, no referrer (services/common/security_headers.py).
        app.mount("/", SecureStaticFiles(directory=folder, html=True), name="web")
        return
    log.warning("%s (no index.html in %s)", NOT_BUILT, folder)

    async def web_not_built() -> HTMLResponse:
        return HTMLResponse(NOT_BUILT_PAGE, status_code=503, headers=HEADERS)

    app.add_api_route("/", web_not_built, methods=["GET"], include_in_schema=False, name="web")
