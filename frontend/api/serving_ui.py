"""The built-in web UI: GET / (the chat page), its assets under /ui/, and
GET /ui/features (which tasks the engine serves, so that the page hides the
views of the others).

Plain HTML, CSS and JavaScript from frontend/web/, served as they are: no
build step, nothing fetched from elsewhere. Every response carries a
Content-Security-Policy that admits scripts from this server only (no inline
or remote script), so that neither model output nor an imported conversation
can run script in the page even if the renderer let markup through. The page
and its assets need no key (`asset_paths` lists them for `security.py`);
/ui/features and the API calls the page makes carry the key the user entered.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from pagoda.frontend.api.errors import APIError

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
# Scripts, styles and requests from this origin only; no plugins, frames or forms.
UI_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; media-src 'self' blob:; font-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'"
)
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def asset_files() -> dict[str, Path]:
    """The files the page may load, by URL path (read from frontend/web/ when called)."""
    files = {"/": WEB_DIR / "index.html"}
    for path in sorted(WEB_DIR.rglob("*")):
        if path.is_file() and path.name != "index.html":
            files["/ui/" + path.relative_to(WEB_DIR).as_posix()] = path
    return files


def asset_paths() -> frozenset[str]:
    """The URL paths of the page and its assets: open without a key."""
    return frozenset(asset_files())


def static_file(path: Path, csp: str) -> FileResponse:
    """One static file with the page's security headers; never cached stale."""
    headers = {"Content-Security-Policy": csp, "Cache-Control": "no-cache", **SECURITY_HEADERS}
    return FileResponse(path, headers=headers)


def build_router(tasks: list[str]) -> APIRouter:
    """The page, its assets (a fixed list: no path from the URL reaches the disk)
    and the features the page shows."""
    router = APIRouter(include_in_schema=False)
    files = asset_files()

    @router.get("/")
    async def index() -> FileResponse:
        return static_file(files["/"], UI_CSP)

    @router.get("/ui/features")
    async def features() -> dict[str, list[str]]:
        return {"tasks": tasks}

    @router.get("/ui/{name:path}")
    async def asset(name: str) -> FileResponse:
        path = files.get("/ui/" + name)
        if path is None:
            raise APIError(404, f"no such file: /ui/{name}")
        return static_file(path, UI_CSP)

    return router
