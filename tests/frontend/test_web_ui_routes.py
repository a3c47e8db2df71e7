"""The web UI's and the docs pages' routes, without a browser or an engine:
what is served, what is open without a key, the policy header,
--disable-web-ui (the browser tests are in test_web_ui.py)."""

from __future__ import annotations

import argparse
from typing import Any

from starlette.testclient import TestClient

from pagoda.frontend.api.app import FrontendConfig, build_app
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.frontend.cli import add_frontend_args, frontend_args_to_argv
from tests.frontend.test_websocket_auth import NoEngineClient

AUTH = {"Authorization": "Bearer k"}


def client(**config: Any) -> TestClient:
    engine = AsyncLLM(NoEngineClient(), tokenizer=None)  # type: ignore[arg-type]
    return TestClient(build_app(engine, FrontendConfig(**config)))


def test_page_assets_and_docs_carry_the_policy() -> None:
    c = client()
    page = c.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/ui/app.js">' in page.text
    for path in (
        "/",
        "/ui/app.js",
        "/ui/markdown.js",
        "/docs",
        "/redoc",
        "/docs/assets/swagger-ui.css",
    ):
        r = c.get(path)
        assert r.status_code == 200, path
        assert "script-src 'self';" in r.headers["content-security-policy"], path
        assert (
            "unsafe-inline"
            not in r.headers["content-security-policy"].split("script-src")[1].split(";")[0]
        )
    assert (
        c.get("/ui/app.js")
        .headers["content-type"]
        .startswith(("text/javascript", "application/javascript"))
    )
    assert c.get("/docs/assets/redoc.standalone.js").status_code == 200
    assert c.get("/ui/features").json() == {"tasks": ["generate"]}
    # The pages stay out of the API schema.
    paths = c.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith(("/ui", "/docs", "/redoc"))]


def test_only_the_files_are_open_under_a_key() -> None:
    c = client(api_keys=("k",))
    for path in ("/", "/ui/app.js", "/ui/style.css", "/docs", "/redoc", "/docs/assets/favicon.png"):
        assert c.get(path).status_code == 200, path
    for path in (
        "/ui/features",
        "/ui/nothing.js",
        "/ui/../pyproject.toml",
        "/openapi.json",
        "/v1/models",
    ):
        assert c.get(path).status_code == 401, path
    assert c.get("/ui/features", headers=AUTH).status_code == 200
    # No path from the URL reaches the disk: only the listed files are served.
    for path in ("/ui/nothing.js", "/ui/..%2F..%2Fpyproject.toml", "/ui/%2e%2e/api/app.py"):
        assert c.get(path, headers=AUTH).status_code == 404, path


def test_disable_web_ui_keeps_the_api_and_the_docs() -> None:
    c = client(enable_web_ui=False, api_keys=("k",))
    assert c.get("/", headers=AUTH).status_code == 404
    assert c.get("/ui/app.js", headers=AUTH).status_code == 404
    assert c.get("/ui/app.js").status_code == 401  # no longer an open path
    assert c.get("/docs").status_code == 200
    # --tokens-only has no chat to offer.
    assert client(tokens_only=True).get("/").status_code == 404


def test_pagoda_serve_passes_disable_web_ui_on() -> None:
    serve = argparse.ArgumentParser()
    add_frontend_args(serve)
    api = argparse.ArgumentParser()
    add_frontend_args(api)
    assert api.parse_args(
        frontend_args_to_argv(serve.parse_args(["--disable-web-ui"]))
    ).disable_web_ui
    assert not api.parse_args(frontend_args_to_argv(serve.parse_args([]))).disable_web_ui
