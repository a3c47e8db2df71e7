"""`pagoda run-batch`: OpenAI's batch file format, answered by the real routes.

Each input line is `{"custom_id", "method": "POST", "url", "body"}`; each
output line is `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`, in input order. Lines go through the same FastAPI app as
`api-server` (in process, without a socket), so validation and error bodies
are exactly the server's. A line that cannot be read is reported in its own
output line (`response` null, `error` set); it never stops the batch.

Without `--url` an engine core is started for the run and stopped after it;
with `--url` the lines are sent to a running server instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import uuid
from typing import Any

import httpx
from tqdm import tqdm

# Routes a batch line may name (OpenAI's batch endpoints, plus vLLM's pooling ones).
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
)


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="a JSONL file of requests")
    parser.add_argument("-o", "--output-file", required=True, help="where to write the results")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=256,
        help="requests in flight at once (the engine batches them)",
    )
    parser.add_argument("--url", default=None, help="send the lines to this running server instead")
    parser.add_argument("--disable-progress-bar", action="store_true")


def check_line(line: str) -> tuple[str | None, dict[str, Any] | str]:
    """(custom_id, request) for a good line, (custom_id or None, why) for a bad one."""
    try:
        item = json.loads(line)
    except ValueError as e:
        return None, f"the line is not valid JSON: {e}"
    if not isinstance(item, dict):
        return None, "each line must be a JSON object"
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        return None, "custom_id must be a string"
    if item.get("method", "POST") != "POST":
        return custom_id, "method must be POST"
    if item.get("url") not in BATCH_URLS:
        return custom_id, f"url must be one of {', '.join(BATCH_URLS)}"
    body = item.get("body")
    if not isinstance(body, dict):
        return custom_id, "body must be a JSON object"
    if body.get("stream"):
        return custom_id, "stream is not allowed in a batch"
    return custom_id, item


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


async def answer(client: httpx.AsyncClient, line: str) -> dict[str, Any]:
    """The output record of one input line."""
    custom_id, checked = check_line(line)
    if isinstance(checked, str):
        return {
            "id": _line_id(),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": "invalid_request", "message": checked},
        }
    try:
        reply = await client.post(checked["url"], json=checked["body"])
    except httpx.HTTPError as e:
        return {
            "id": _line_id(),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": "server_error", "message": f"{type(e).__name__}: {e}"},
        }
    try:
        body: Any = reply.json()
    except ValueError:
        body = {"error": {"message": reply.text[:500], "type": "server_error"}}
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {
            "status_code": reply.status_code,
            "request_id": reply.headers.get("x-request-id", ""),
            "body": body,
        },
        "error": None,
    }


async def run_lines(
    client: httpx.AsyncClient, lines: list[str], max_concurrency: int, progress: bool
) -> list[dict[str, Any]]:
    """All lines answered concurrently (bounded), results in input order."""
    gate = asyncio.Semaphore(max(1, max_concurrency))
    bar = tqdm(total=len(lines), desc="run-batch", unit="req", disable=not progress)

    async def one(line: str) -> dict[str, Any]:
        async with gate:
            result = await answer(client, line)
        bar.update(1)
        return result

    try:
        return list(await asyncio.gather(*(one(line) for line in lines)))
    finally:
        bar.close()


async def _run(ns: argparse.Namespace) -> int:
    with open(ns.input_file, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    progress = not ns.disable_progress_bar
    if ns.url:
        async with httpx.AsyncClient(base_url=ns.url, timeout=None) as client:
            results = await run_lines(client, lines, ns.max_concurrency, progress)
    else:
        results = await _run_with_engine(ns, lines, progress)
    with open(ns.output_file, "w", encoding="utf-8") as f:
        for record in results:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    failed = sum(1 for r in results if r["error"] or r["response"]["status_code"] != 200)
    print(
        f"run-batch: {len(results)} requests, {failed} failed → {ns.output_file}", file=sys.stderr
    )
    return 0


async def _run_with_engine(
    ns: argparse.Namespace, lines: list[str], progress: bool
) -> list[dict[str, Any]]:
    from pagoda.engine_core.args import engine_args_to_argv
    from pagoda.frontend.api.app import FrontendConfig, build_app
    from pagoda.frontend.async_llm import AsyncLLM
    from pagoda.protocol.addresses import default_ipc_address

    address = default_ipc_address()
    argv = [sys.executable, "-m", "pagoda.engine_core.cli", "--address", address]
    process = subprocess.Popen([*argv, *engine_args_to_argv(ns)])
    try:
        engine = await AsyncLLM.connect(
            address,
            chat_template=ns.chat_template,
            log_stats=True,
            served_model_name=ns.served_model_name,
        )
        config = FrontendConfig(
            served_model_name=ns.served_model_name,
            chat_template=ns.chat_template,
            tool_call_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
        )
        app = build_app(engine, config)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://run-batch", timeout=None
            ) as client:
                return await run_lines(client, lines, ns.max_concurrency, progress)
        finally:
            await engine.client.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_batch(ns: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(_run(ns))
