"""`pagoda run-batch`: OpenAI batch files answered by the real routes, in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagoda.frontend.run_batch import check_line
from tests.frontend.conftest import MODEL_NAME, Server
from tests.frontend.servers import REPO
from tests.frontend.test_openai_e2e import client

CHAT_BODY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Name a fruit."}],
    "temperature": 0,
    "max_tokens": 8,
}


def line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"method": "POST", "url": "/v1/completions", "body": {}}', "custom_id"),
        ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "POST"),
        ('{"custom_id": "a", "url": "/v1/files", "body": {}}', "url must be"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": 3}', "body"),
        ('{"custom_id": "a", "url": "/v1/completions", "body": {"stream": true}}', "stream"),
    ],
)
def test_bad_lines_are_explained(text: str, why: str) -> None:
    _custom_id, checked = check_line(text)
    assert isinstance(checked, str) and why in checked


def run_batch(tmp_path: Path, lines: list[str], *args: str) -> list[dict[str, Any]]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    argv = [sys.executable, "-m", "pagoda.frontend.pagoda_cli", "run-batch", "-i", str(src)]
    argv += ["-o", str(dst), "--disable-progress-bar", *args]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(x) for x in dst.read_text().splitlines()]


@pytest.mark.slow
def test_batch_against_server_keeps_order_and_isolates_failures(
    server: Server, tmp_path: Path
) -> None:
    lines = [
        line("chat", "/v1/chat/completions", CHAT_BODY),
        "{broken",
        line("comp", "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}),
        line("hot", "/v1/chat/completions", {**CHAT_BODY, "temperature": 9}),
        line("files", "/v1/files", {}),
        line("long", "/v1/completions", {"prompt": "x", "max_tokens": 10**6}),
    ]
    out = run_batch(tmp_path, lines, "--url", server.base_url)
    assert [r["custom_id"] for r in out] == ["chat", None, "comp", "hot", "files", "long"]
    assert len({r["id"] for r in out}) == len(out)
    chat, broken, comp, hot, files, long = out
    direct = client(server).chat.completions.create(**CHAT_BODY)  # type: ignore[call-overload]
    assert chat["response"]["status_code"] == 200 and chat["error"] is None
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == (
        direct.choices[0].message.content
    )
    assert comp["response"]["body"]["usage"]["completion_tokens"] == 4
    assert broken["response"] is None and "JSON" in broken["error"]["message"]
    assert files["response"] is None and "url" in files["error"]["message"]
    for bad in (hot, long):
        assert bad["response"]["status_code"] == 400
        assert bad["response"]["body"]["error"]["message"]


@pytest.mark.slow
def test_batch_starts_its_own_engine(tmp_path: Path) -> None:
    lines = [
        line(f"c{i}", "/v1/completions", {"prompt": f"{i} + {i} =", "max_tokens": 3})
        for i in range(5)
    ]
    lines.append(line("chat", "/v1/chat/completions", CHAT_BODY))
    flags = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20)]
    out = run_batch(tmp_path, lines, *flags)
    assert [r["custom_id"] for r in out] == [*(f"c{i}" for i in range(5)), "chat"]
    assert all(r["response"]["status_code"] == 200 for r in out), out
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 3 for r in out[:5])
