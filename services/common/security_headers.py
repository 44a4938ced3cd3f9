"""Response headers of the web front end (served by the agent).

The built front end (services/agent/web/dist) loads one module script and one stylesheet
from its own origin and has no inline script, so the policy allows scripts only from
'self': an injected ``<script>`` or ``onclick=`` does not run. The page may not be framed
(clickjacking), types are not sniffed, and no referrer leaves the origin.
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "font-src 'self'",
        "connect-src 'self'",  # fetch and the same-origin websocket
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}


class SecureStaticFiles(StaticFiles):
    """StaticFiles whose every response (index.html, assets, 404s) carries HEADERS."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response
