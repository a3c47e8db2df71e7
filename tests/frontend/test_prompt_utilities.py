"""/tokenize, /detokenize, /tokenizer_info and the render routes, on the real server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.frontend.conftest import MODEL_NAME, Server

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_tokenize_detokenize_round_trip(server: Server) -> None:
    r = post(
        server,
        "/tokenize",
        {"model": MODEL_NAME, "prompt": "Hello world", "return_token_strs": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "Hello world"
    back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


def test_tokenized_messages_count_matches_chat_usage(server: Server) -> None:
    tok = post(server, "/tokenize", {"model": MODEL_NAME, "messages": CHAT}).json()
    c = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    chat = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == tok["count"]
    render = post(
        server, "/v1/chat/completions/render", {"model": MODEL_NAME, "messages": CHAT}
    ).json()
    assert render["token_ids"] == tok["tokens"]
    assert render["prompt"].endswith("<|im_start|>assistant\n")


def test_completion_render_and_tokenizer_info(server: Server) -> None:
    r = post(server, "/v1/completions/render", {"model": MODEL_NAME, "prompt": ["a b", "c d e"]})
    counts = [post(server, "/tokenize", {"prompt": p}).json()["count"] for p in ("a b", "c d e")]
    assert [len(p["token_ids"]) for p in r.json()] == counts
    ids = post(server, "/v1/completions/render", {"prompt": [1, 2, 3]}).json()
    assert ids[0]["token_ids"] == [1, 2, 3]
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert info["eos_token_id"] == 2 and "im_start" in info["chat_template"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "a", "messages": CHAT}),
        ("/tokenize", {"prompt": 5}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": "abc"}),
        ("/tokenize", {"model": "nope", "prompt": "a"}),
    ],
)
def test_prompt_utilities_reject_bad_input(server: Server, path: str, body: dict) -> None:
    r = post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]


def test_sagemaker_invocations_and_load(server: Server) -> None:
    chat = post(server, "/invocations", {"messages": CHAT, "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    comp = post(server, "/invocations", {"prompt": "Hi", "max_tokens": 3})
    assert comp.status_code == 200 and comp.json()["object"] == "text_completion"
    bad = post(server, "/invocations", {"input": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["message"]
    wrong = post(server, "/invocations", {"messages": "x"})
    assert wrong.status_code == 400
    assert httpx.get(server.base_url + "/ping").status_code == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200  # SageMaker probes both
    assert httpx.get(server.base_url + "/load").json() == {"server_load": 0}


def test_retrieve_one_model(server: Server) -> None:
    """GET /v1/models/{model}: OpenAI's retrieve, by the official client too."""
    card = httpx.get(f"{server.v1}/models/{MODEL_NAME}").json()
    assert card["id"] == MODEL_NAME and card["object"] == "model" and card["parent"] is None
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    missing = httpx.get(f"{server.v1}/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_batch_keeps_order_and_isolates_failures(server: Server) -> None:
    good = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    body = {
        "requests": [
            good,
            {"model": MODEL_NAME, "messages": []},
            {**good, "model": "nope"},
            {**good, "max_tokens": 2},
        ]
    }
    r = post(server, "/v1/chat/completions/batch", body)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3]
    assert [d["status"] for d in data] == [200, 400, 404, 200]
    assert data[0]["response"]["usage"]["completion_tokens"] <= 4
    assert data[3]["response"]["usage"]["completion_tokens"] <= 2
    assert data[1]["error"]["message"] and data[2]["error"]["code"] == "model_not_found"
    single = post(server, "/v1/chat/completions", good).json()
    assert (
        data[0]["response"]["choices"][0]["message"]["content"]
        == (single["choices"][0]["message"]["content"])
    )
    assert post(server, "/v1/chat/completions/batch", {"requests": []}).status_code == 400
