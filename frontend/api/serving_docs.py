"""The API docs pages, offline: GET /docs (Swagger UI) and GET /redoc.

FastAPI's own pages load Swagger UI and ReDoc from a CDN and start them
with an inline script, so they render blank where there is no internet and
break under a policy that forbids inline script. These pages load the same
bundles from this server (the `fastapi-offline` package ships them, MIT) and
start them from frontend/web/docs.js, which fetches /openapi.json with the
key the web UI stored, if any. The pages and the bundles need no key; the
schema needs one when the API does.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from pagoda.frontend.api.serving_ui import WEB_DIR, static_file

# As the web UI's, but Swagger UI and ReDoc set inline styles and ReDoc searches in a worker.
DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self' data:; worker-src 'self' blob:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'"
)
BUNDLES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def bundle_dir() -> Path:
    """Where the installed fastapi-offline package keeps the bundles (not imported)."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or spec.origin is None:
        raise RuntimeError("the fastapi-offline package is missing: pip install fastapi-offline")
    return Path(spec.origin).parent / "static"


def docs_paths() -> frozenset[str]:
    """The URL paths of the docs pages and their bundles: open without a key."""
    return frozenset({"/docs", "/redoc", *(f"/docs/assets/{name}" for name in BUNDLES)})


def build_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)
    bundles = bundle_dir()

    @router.get("/docs")
    async def swagger_ui() -> FileResponse:
        return static_file(WEB_DIR / "docs.html", DOCS_CSP)

    @router.get("/redoc")
    async def redoc() -> FileResponse:
        return static_file(WEB_DIR / "redoc.html", DOCS_CSP)

    for name in BUNDLES:
        router.add_api_route(f"/docs/assets/{name}", _bundle_route(bundles / name), methods=["GET"])
    return router


def _bundle_route(path: Path) -> Callable[[], Awaitable[FileResponse]]:
    async def bundle() -> FileResponse:
        return static_file(path, DOCS_CSP)

    return bundle
