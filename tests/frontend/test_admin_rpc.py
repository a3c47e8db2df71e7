"""POST /collective_rpc: allow-listed engine utility calls behind --admin-api-key."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.frontend.conftest import ENGINE_FLAGS, Server
from tests.frontend.servers import private_server

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def admin_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory: Path = tmp_path_factory.mktemp("admin")
    api_flags = ("--enable-admin-api", "--admin-api-key", "admin-secret", "--api-key", "user-key")
    with private_server(directory, ENGINE_FLAGS, *api_flags, name="admin") as base:
        yield base


def rpc(base: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        base + "/collective_rpc",
        json=body,
        headers=ADMIN if headers is None else headers,
        timeout=60,
    )


def test_admin_key_required_and_separate_from_api_key(admin_base: str) -> None:
    assert rpc(admin_base, {"method": "ping"}, headers={}).status_code == 401
    user = {"Authorization": "Bearer user-key"}
    r = rpc(admin_base, {"method": "ping"}, headers=user)
    assert r.status_code == 401 and "admin" in r.json()["error"]["message"]
    assert httpx.post(admin_base + "/sleep", headers=user).status_code == 401
    # The admin key does not open the generation routes, the API key does.
    assert httpx.get(admin_base + "/v1/models", headers=ADMIN).status_code == 401
    assert httpx.get(admin_base + "/v1/models", headers=user).status_code == 200
    r = rpc(admin_base, {"method": "ping"}, headers={"X-Api-Key": "admin-secret"})
    assert r.json() == {"results": ["pong"]}


def test_allowed_methods_return_json_results(admin_base: str) -> None:
    r = rpc(admin_base, {"method": "get_stats"})
    assert r.status_code == 200, r.text
    [stats] = r.json()["results"]
    assert stats["num_running"] == 0 and stats["num_blocks"] > 0
    r = rpc(admin_base, {"method": "echo", "args": [1, "two", [3]], "kwargs": {"k": {"v": 4}}})
    assert r.json() == {"results": [{"args": [1, "two", [3]], "kwargs": {"k": {"v": 4}}}]}
    assert rpc(admin_base, {"method": "check_invariants"}).json() == {"results": [True]}
    assert rpc(admin_base, {"method": "reset_prefix_cache"}).json() == {"results": [True]}
    assert rpc(admin_base, {"method": "sleep", "kwargs": {"level": 1}}).status_code == 200
    assert rpc(admin_base, {"method": "is_sleeping"}).json() == {"results": [True]}
    user = {"Authorization": "Bearer user-key"}  # a read-only route: the API key
    assert httpx.get(admin_base + "/is_sleeping", headers=user).json()["is_sleeping"] is True
    assert rpc(admin_base, {"method": "wake_up", "args": [["weights", "kv_cache"]]}).is_success
    assert rpc(admin_base, {"method": "is_sleeping"}).json() == {"results": [False]}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"method": "shutdown"}, 400, "not allowed"),
        ({"method": "start_profile"}, 400, "not allowed"),
        ({"method": "_utilities"}, 400, "not allowed"),
        ({"args": []}, 400, "method"),
        ([1, 2], 400, "method"),
        ({"method": "get_stats", "args": "x"}, 400, "args"),
        ({"method": "get_stats", "kwargs": [1]}, 400, "kwargs"),
        ({"method": "get_stats", "kwargs": {"bogus": 1}}, 400, "bogus"),
        ({"method": "sleep", "args": [7]}, 400, "level"),
        ({"method": "get_stats", "timeout": 0}, 400, "timeout"),
        ({"method": "get_stats", "timeout": "1"}, 400, "timeout"),
    ],
)
def test_bad_calls_are_4xx_or_504(admin_base: str, body: object, status: int, needle: str) -> None:
    r = rpc(admin_base, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    # The engine is fine afterwards.
    assert rpc(admin_base, {"method": "ping"}).json() == {"results": ["pong"]}


def test_timeout_is_504_and_the_call_still_completes(admin_base: str) -> None:
    # Parking ~0.5 GB of weights takes far longer than 50 ms.
    r = rpc(admin_base, {"method": "sleep", "args": [1], "timeout": 0.05})
    assert r.status_code == 504 and "in time" in r.json()["error"]["message"]
    for _ in range(100):
        if rpc(admin_base, {"method": "is_sleeping"}).json() == {"results": [True]}:
            break
        time.sleep(0.1)
    assert rpc(admin_base, {"method": "wake_up", "timeout": 120}).status_code == 200
    assert rpc(admin_base, {"method": "is_sleeping"}).json() == {"results": [False]}


def test_collective_rpc_off_by_default(server: Server) -> None:
    assert (
        httpx.post(server.base_url + "/collective_rpc", json={"method": "ping"}).status_code == 404
    )
