"""LoRA over HTTP: adapters as models, vLLM's load/unload routes, the REST forms, errors.

A real engine with --enable-lora over the default model, and random
PEFT-format adapters written for its shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import write_random_lora
from tests.frontend.conftest import ENGINE_FLAGS, MODEL_NAME, Server
from tests.frontend.servers import private_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pagoda.engine_core.model_config import default_model_path, load_model_config
    from pagoda.engine_core.worker.lora import module_shapes

    config = load_model_config(default_model_path())
    shapes = module_shapes(config)
    root = tmp_path_factory.mktemp("adapters")
    layers = config.num_layers
    return {
        "a": write_random_lora(root / "a", layers, shapes, 8, 16, seed=1),
        "c": write_random_lora(
            root / "c", layers, {k: shapes[k] for k in ("q_proj", "down_proj")}, 4, 8, seed=2
        ),
        "big": write_random_lora(root / "big", 1, {"q_proj": shapes["q_proj"]}, 32, 32),
        "wrong": write_random_lora(root / "wrong", 1, {"q_proj": (64, 64)}, 4, 4),
    }


@pytest.fixture(scope="module")
def base(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = (
        *ENGINE_FLAGS,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"a={adapters['a']}",
    )
    with private_server(tmp_path_factory.mktemp("lora-server"), flags, name="lora") as url:
        yield url


def complete(base: str, model: str, prompt: str = "The capital of France is") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


def test_models_list_adapters(base: str, adapters: dict[str, Path]) -> None:
    cards = {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}
    assert cards["a"]["root"] == str(adapters["a"])
    assert cards["a"]["parent"] == MODEL_NAME
    assert cards[MODEL_NAME]["parent"] is None
    one = httpx.get(f"{base}/v1/models/a").json()  # retrieve: an adapter's own card
    assert one["id"] == "a" and one["parent"] == MODEL_NAME


def test_adapter_is_picked_by_model_name(base: str) -> None:
    plain = text_of(complete(base, MODEL_NAME))
    with_a = text_of(complete(base, "a"))
    assert with_a != plain
    assert text_of(complete(base, "a")) == with_a  # greedy: the same again
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    assert error_of(complete(base, "nope"), 404)["code"] == "model_not_found"


def test_load_and_unload_routes(base: str, adapters: dict[str, Path]) -> None:
    url = f"{base}/v1/load_lora_adapter"
    ok = httpx.post(url, json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert ok.status_code == 200 and "added successfully" in ok.text
    plain = text_of(complete(base, MODEL_NAME, "Once upon a time"))
    assert text_of(complete(base, "c", "Once upon a time")) != plain
    error_of(httpx.post(url, json={"lora_name": "c", "lora_path": str(adapters["c"])}), 400)
    error_of(httpx.post(url, json={"lora_name": "x", "lora_path": "/no/such/adapter"}), 404)
    big = error_of(
        httpx.post(url, json={"lora_name": "big", "lora_path": str(adapters["big"])}), 400
    )
    assert "max_lora_rank" in big["message"]
    error_of(httpx.post(url, json={"lora_name": "w", "lora_path": str(adapters["wrong"])}), 400)
    error_of(httpx.post(url, json={"lora_name": "x"}), 400)
    error_of(httpx.post(url, content=b"not json"), 400)
    unload = f"{base}/v1/unload_lora_adapter"
    done = httpx.post(unload, json={"lora_name": "c"})
    assert done.status_code == 200 and "removed successfully" in done.text
    error_of(httpx.post(unload, json={"lora_name": "c"}), 404)
    error_of(complete(base, "c"), 404)


def test_rest_routes_and_pinning(base: str, adapters: dict[str, Path]) -> None:
    made = httpx.post(
        f"{base}/v1/loras", json={"name": "d", "path": str(adapters["c"]), "pinned": True}
    )
    assert made.status_code == 200, made.text
    assert made.json()["pinned"] is True and made.json()["parent"] == MODEL_NAME
    assert text_of(complete(base, "d"))
    listed = {m["id"] for m in httpx.get(f"{base}/v1/loras").json()["data"]}
    assert {"a", "d"} <= listed
    pinned = httpx.post(f"{base}/v1/loras/a/pin")
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    # Both slots pinned: a third adapter cannot be pinned, nor served.
    httpx.post(f"{base}/v1/loras", json={"name": "e", "path": str(adapters["c"])})
    error_of(httpx.post(f"{base}/v1/loras/e/pin"), 409)
    assert "pinned" in error_of(complete(base, "e"), 400)["message"]
    error_of(httpx.post(f"{base}/v1/loras/nope/pin"), 404)
    for name in ("d", "e"):
        gone = httpx.delete(f"{base}/v1/loras/{name}")
        assert gone.status_code == 200 and gone.json()["deleted"] is True
    error_of(httpx.delete(f"{base}/v1/loras/d"), 404)
    stats = httpx.get(f"{base}/stats").json()
    assert stats["num_used_blocks"] == 0  # no request left a block behind


def test_lora_routes_absent_without_enable_lora(server: Server) -> None:
    response = httpx.post(f"{server.v1}/load_lora_adapter", json={"lora_name": "a"})
    assert response.status_code == 404
