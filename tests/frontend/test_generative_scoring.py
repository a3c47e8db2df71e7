"""POST /generative_scoring against the real processes, checked against HF transformers.

The shared server runs the default model in float32; transformers loads the
same GGUF file, and its log_softmax at the last prompt position gives the
reference probabilities. The prompts are built with transformers' own
tokenizer of the model (query with special tokens, items without).
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from pagoda.engine_core.model_config import ModelLoadError, default_model_path
from pagoda.engine_core.tokenizer_files import tokenizer_dir_for
from pagoda.frontend.api.app import FrontendConfig, build_app
from pagoda.frontend.async_llm import AsyncLLM
from pagoda.protocol.messages import PROTOCOL_VERSION, Ready, SchedulerStats
from tests.engine_core.hf_reference import hf_logprobs
from tests.frontend.conftest import MODEL_NAME, Server

ATOL = 1e-4
QUERY = "Question: is the following city the capital of France? City:"
ITEMS = [" Paris", " London", " Berlin"]


@dataclass
class Reference:
    """The default model and its tokenizer as transformers loads them."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def label_logprobs(self, prompt: list[int], labels: list[int]) -> list[float]:
        """Full-vocabulary logprobs of `labels` after `prompt`."""
        return hf_logprobs(self.model, prompt)[-1, labels].tolist()


@pytest.fixture(scope="module")
def hf() -> Reference:
    try:
        path = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    directory, name = path.rsplit("/", 1)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir_for(path))
    return Reference(model.eval(), tokenizer)


@pytest.fixture(scope="module")
def labels(hf: Reference) -> list[int]:
    """The ids of " Yes" and " No" (one token each)."""
    ids = [hf.encode(word, False) for word in (" Yes", " No")]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def score(server: Server, body: dict[str, Any], path: str = "/generative_scoring") -> Any:
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    return [w / sum(weights) for w in weights]


def check_against_hf(
    answer: dict[str, Any], expected_logprobs: list[list[float]], labels: list[int], soft: bool
) -> None:
    assert [d["index"] for d in answer["data"]] == list(range(len(expected_logprobs)))
    for item, lps in zip(answer["data"], expected_logprobs, strict=True):
        probs = softmax(lps) if soft else [math.exp(v) for v in lps]
        assert item["object"] == "score"
        assert item["score"] == pytest.approx(probs[0], abs=ATOL)
        assert list(item["label_probs"]) == [str(t) for t in labels]
        for got, want in zip(item["label_probs"].values(), probs, strict=True):
            assert got == pytest.approx(want, abs=ATOL)


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_text_items_match_hf(
    server: Server, hf: Reference, labels: list[int], apply_softmax: bool
) -> None:
    answer = score(
        server,
        {
            "model": MODEL_NAME,
            "query": QUERY,
            "items": ITEMS,
            "label_token_ids": labels,
            "apply_softmax": apply_softmax,
        },
    )
    query = hf.encode(QUERY, True)
    prompts = [query + hf.encode(item, False) for item in ITEMS]
    check_against_hf(answer, [hf.label_logprobs(p, labels) for p in prompts], labels, apply_softmax)
    assert answer["id"].startswith("generative-scoring-")
    assert answer["object"] == "list"
    assert answer["model"] == MODEL_NAME
    assert isinstance(answer["created"], int)
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == len(ITEMS)  # one sampled token per item, as vLLM counts
    assert usage["total_tokens"] == usage["prompt_tokens"] + len(ITEMS)
    if apply_softmax:
        assert sum(answer["data"][0]["label_probs"].values()) == pytest.approx(1.0, abs=1e-6)
    else:
        # A capital is a likely answer: the full-vocabulary mass of Yes/No is real but not all.
        assert 0.0 < sum(answer["data"][0]["label_probs"].values()) < 1.0


def test_token_items_item_first_on_the_v1_path(
    server: Server, hf: Reference, labels: list[int]
) -> None:
    query = hf.encode(" Is this sentence about a city? Answer:", False)
    items = [hf.encode(text, True) for text in ("Paris is big.", "I like tea.")]
    answer = score(
        server,
        {
            "query": query,
            "items": items,
            "label_token_ids": labels,
            "item_first": True,
            "request_id": "mine-1",
        },
        path="/v1/generative_scoring",
    )
    expected = [hf.label_logprobs(item + query, labels) for item in items]
    check_against_hf(answer, expected, labels, soft=True)
    assert answer["id"] == "generative-scoring-mine-1"
    assert answer["usage"]["prompt_tokens"] == sum(len(i) + len(query) for i in items)


def test_repeated_labels_count_once_and_order_follows_the_request(
    server: Server, hf: Reference, labels: list[int]
) -> None:
    yes, no = labels
    answer = score(server, {"query": QUERY, "items": [" Paris"], "label_token_ids": [no, yes, no]})
    prompt = hf.encode(QUERY, True) + hf.encode(" Paris", False)
    check_against_hf(answer, [hf.label_logprobs(prompt, [no, yes])], [no, yes], soft=True)


def block_size(server: Server) -> int:
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    match = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', metrics)
    assert match is not None
    return int(match.group(1))


def test_the_query_is_computed_once_for_all_items(
    server: Server, hf: Reference, labels: list[int]
) -> None:
    """Items that all start differently after a query of several blocks: the
    first one computes the query's full blocks, the others take them from
    the prefix cache, and the scores are still those of HF."""
    query_text = f"Run {uuid.uuid4().hex}: " + "Rate the next city as a holiday place. " * 6
    items = [" Paris", " Lyon", " Rome", " Oslo", " Cairo"]
    query = hf.encode(query_text, True)
    bs = block_size(server)
    assert len(query) >= 3 * bs
    answer = score(server, {"query": query_text, "items": items, "label_token_ids": labels})
    prompts = [query + hf.encode(item, False) for item in items]
    assert len({p[len(query)] for p in prompts}) == len(items)  # no item shares the next token
    check_against_hf(answer, [hf.label_logprobs(p, labels) for p in prompts], labels, soft=True)
    shared = len(query) // bs * bs
    usage = answer["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == shared * (len(items) - 1)
    # Asked again, every item finds the query's blocks (and none of its own
    # beyond them: each item is shorter than a block).
    again = score(server, {"query": query_text, "items": items, "label_token_ids": labels})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == shared * len(items)
    assert [d["score"] for d in again["data"]] == pytest.approx(
        [d["score"] for d in answer["data"]], abs=1e-6
    )


VOCAB = 49152  # the default model's vocabulary
TOO_LONG = [1] * 1023  # with one item token: the whole 1024-token context


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"label_token_ids": [VOCAB]}, "label_token_ids", "outside the vocabulary"),
        ({"label_token_ids": [-1]}, "label_token_ids", "outside the vocabulary"),
        ({"label_token_ids": []}, "label_token_ids", "at least one"),
        ({"label_token_ids": ["1"]}, "label_token_ids.0", "integer"),
        ({"label_token_ids": [True]}, "label_token_ids.0", "integer"),
        ({"label_token_ids": list(range(1025))}, "label_token_ids", "at most"),
        ({"label_token_ids": None}, "label_token_ids", "list"),
        ({"items": []}, "items", "at least one"),
        ({"items": [" a", ""]}, "items", "items[1] is empty"),
        ({"items": [[]]}, "items", "items[0] is empty"),
        ({"items": [" a", [1, 2]]}, "items", "not a mix"),
        ({"items": " a"}, "items", "list"),
        ({"items": [[1, VOCAB]]}, "items", "out of vocabulary"),
        ({"items": [[1.5]]}, "items", "items[0] must be a string or a list of token ids"),
        ({"items": [["a"]]}, "items", "items[0] must be"),
        ({"items": [" x"] * 2049}, "items", "at most 2048"),
        ({"query": 5}, "query", "query must be a string or a list of token ids"),
        ({"query": [1, True]}, "query", "query must be"),
        ({"query": [VOCAB + 7]}, "query", "out of vocabulary"),
        ({"query": TOO_LONG, "items": [[5]]}, "items", "maximum context length is 1024"),
        ({"priority": 2**70}, "priority", "64-bit"),
        ({"apply_softmax": "maybe"}, "apply_softmax", "bool"),
    ],
)
def test_hostile_input_is_a_400_in_openai_shape(
    server: Server, body: dict[str, Any], param: str, message: str
) -> None:
    full = {"query": "q", "items": [" a"], "label_token_ids": [1, 2], **body}
    r = httpx.post(server.base_url + "/generative_scoring", json=full, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]
    assert len(error["message"]) < 400  # never the input echoed back


def test_unknown_model_and_missing_fields(server: Server) -> None:
    url = server.base_url + "/generative_scoring"
    r = httpx.post(
        url, json={"model": "nope", "query": "q", "items": ["a"], "label_token_ids": [1]}
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url, json={"query": "q", "items": ["a"]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "label_token_ids"
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


class NoEngineClient:
    """An engine client that was told what the engine serves and never sends anything."""

    def __init__(self) -> None:
        self.ready = Ready(
            "test", PROTOCOL_VERSION, "test-model", "/none", "/none", 512, 1000, 16, 64, [0],
            ["generate"],
        )  # fmt: skip
        self.stats = SchedulerStats()
        self.dead: str | None = None


@pytest.mark.parametrize("path", ["/generative_scoring", "/v1/generative_scoring"])
def test_both_paths_need_the_api_key(path: str) -> None:
    engine = AsyncLLM(NoEngineClient(), tokenizer=None)  # type: ignore[arg-type]
    client = TestClient(build_app(engine, FrontendConfig(api_keys=("sesame",))))
    body = {"query": [1], "items": [], "label_token_ids": [1]}
    refused = client.post(path, json=body)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert client.post(path, json=body, headers={"X-API-Key": "wrong"}).status_code == 401
    # With the key the route itself answers (its own 400 for the empty items).
    passed = client.post(path, json=body, headers={"Authorization": "Bearer sesame"})
    assert passed.status_code == 400
    assert passed.json()["error"]["param"] == "items"
