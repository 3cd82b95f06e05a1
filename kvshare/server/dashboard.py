"""GET /dashboard: the live KV view's page, shipped inside the package (kvshare/server/static).

Plain files, no build step: the page draws with a canvas and reads /kv/snapshot, /kv/events and
/metrics itself. Behind --api-key like /kv/ (GuardMiddleware): a browser gets a Basic challenge
and asks for the key. The files are read once, when the routes are made."""
from __future__ import annotations

from importlib import resources
from types import MappingProxyType

from fastapi import FastAPI
from starlette.responses import RedirectResponse, Response

from kvshare.server.errors import APIError
from kvshare.server.middleware import DASHBOARD_PATH

PAGE = "dashboard.html"
# What the page may load besides itself: its own script and style, nothing from elsewhere.
# Read-only views: module-level tables no route may change.
ASSETS = MappingProxyType({"dashboard.js": "text/javascript; charset=utf-8",
                           "dashboard.css": "text/css; charset=utf-8"})
SECURITY_HEADERS = MappingProxyType({
    # base-uri and form-action do not fall back to default-src: without them an injected <base>
    # or <form> could point the page's relative fetches or a submission elsewhere.
    "Content-Security-Policy": ("default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                                "base-uri 'none'; form-action 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
})


def read_static(name: str) -> bytes:
    return resources.files("kvshare.server").joinpath("static", name).read_bytes()


def add_dashboard_routes(app: FastAPI) -> None:
    page = read_static(PAGE)
    assets = {name: (read_static(name), media) for name, media in ASSETS.items()}

    @app.get(DASHBOARD_PATH)
    async def dashboard():
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    @app.get(DASHBOARD_PATH + "/")
    async def dashboard_slash():
        # The page names its files and data relative to itself ("dashboard/...", "kv/..."),
        # which only resolves from /dashboard (and so also behind a proxy's path prefix).
        return RedirectResponse("../dashboard", status_code=308)

    @app.get(DASHBOARD_PATH + "/{name}")
    async def dashboard_asset(name: str):
        if name not in assets:
            raise APIError(404, f"the dashboard has no file '{name}' (files: {', '.join(assets)})",
                           code="not_found")
        body, media = assets[name]
        return Response(body, media_type=media, headers=SECURITY_HEADERS)
