"""End to end: an engine core + API server on all-MiniLM-L6-v2, through real HTTP.

Embeddings are checked against HF BertModel + the model's pooling config
(mean, normalized), through the official `openai` client (float and base64)
and raw HTTP; score / rerank / pooling shapes; and the 400s for tasks a
model does not serve, in both directions.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pagoda.engine_core.model_config import PoolerConfig
from tests.engine_core.test_bert import cosine_distance, hf_embeddings
from tests.frontend.conftest import Server
from tests.frontend.servers import Processes, api_argv, engine_argv, free_port, wait_healthy

TEXTS = ["Hello world", "A cat sits on the mat.", "Stock markets fell sharply today."]
NAME = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def embed_server(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    procs = Processes()
    address = f"ipc://{tmp_path_factory.mktemp('embed')}/engine"
    port = free_port()
    procs.start(
        engine_argv(
            address, "--model", str(minilm_dir), "--served-model-name", NAME, "--num-threads", "1"
        ),
        "engine-embed",
    )
    procs.start(api_argv(address, port), "api-embed")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, procs)
        yield base
    finally:
        procs.stop()


@pytest.fixture(scope="module")
def client(embed_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=embed_server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    return hf_embeddings(minilm_dir, prompts, PoolerConfig("MEAN", True))


def post(base: str, path: str, body: object) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def test_openai_client_float_and_base64(client: openai.OpenAI, reference: list[np.ndarray]) -> None:
    floats = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert floats.model == NAME and [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3 * 2
    # Asked for base64, the client hands the string over as it came.
    encoded = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")
    for a, b in zip(floats.data, encoded.data, strict=True):
        assert isinstance(b.embedding, str)
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        np.testing.assert_array_equal(np.asarray(a.embedding, dtype=np.float32), decoded)
    # Given no format, the client asks for base64 itself and decodes it.
    default = client.embeddings.create(model=NAME, input=TEXTS)
    for a, b in zip(floats.data, default.data, strict=True):
        np.testing.assert_array_equal(np.asarray(a.embedding), np.asarray(b.embedding))
    for data, ref in zip(floats.data, reference, strict=True):
        got = np.asarray(data.embedding, dtype=np.float32)
        assert got.shape == (384,)
        assert cosine_distance(got, ref) < 1e-5


def test_raw_base64_is_little_endian_float32(embed_server: str) -> None:
    body = {"input": TEXTS[0], "encoding_format": "base64"}
    raw = post(embed_server, "/v1/embeddings", body).json()["data"][0]["embedding"]
    decoded = struct.unpack("<384f", base64.b64decode(raw))
    floats = post(embed_server, "/v1/embeddings", {"input": TEXTS[0]}).json()
    assert list(decoded) == floats["data"][0]["embedding"]


def test_input_shapes_and_usage(embed_server: str) -> None:
    one = post(embed_server, "/v1/embeddings", {"input": "Hello world"}).json()
    ids = [101, 7592, 2088, 102]  # the same text as token ids
    as_ids = post(embed_server, "/v1/embeddings", {"input": ids}).json()
    as_lists = post(embed_server, "/v1/embeddings", {"input": [ids, ids[:2]]}).json()
    assert one["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert len(as_ids["data"]) == 1 and as_lists["usage"]["prompt_tokens"] == 6
    assert one["data"][0]["object"] == "embedding" and one["object"] == "list"
    a = np.asarray(one["data"][0]["embedding"])
    for other in (as_ids["data"][0]["embedding"], as_lists["data"][0]["embedding"]):
        assert cosine_distance(a, np.asarray(other)) < 1e-6


def test_truncation_and_length_limit(embed_server: str) -> None:
    long_text = "word " * 400
    too_long = post(embed_server, "/v1/embeddings", {"input": long_text})
    assert too_long.status_code == 400 and "256" in too_long.json()["error"]["message"]
    cut = post(embed_server, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 16})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 16
    # The cut applies to that request only.
    assert post(embed_server, "/v1/embeddings", {"input": long_text}).status_code == 400
    cut_ids = post(
        embed_server,
        "/v1/embeddings",
        {"input": list(range(1000, 1300)), "truncate_prompt_tokens": -1},
    )
    assert cut_ids.status_code == 200 and cut_ids.json()["usage"]["prompt_tokens"] == 256


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[101, 102], []]}, "input"),
        ({"input": [101, 99999]}, "prompt"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "model": "other"}, "model"),
        ({"inputs": "hi"}, "input"),
    ],
)
def test_bad_embedding_requests(embed_server: str, body: dict[str, object], param: str) -> None:
    r = post(embed_server, "/v1/embeddings", body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_dimensions_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=NAME, input="hi", dimensions=64)


def test_score(embed_server: str) -> None:
    one_to_n = post(embed_server, "/v1/score", {"text_1": TEXTS[1], "text_2": TEXTS}).json()
    assert one_to_n["object"] == "list" and len(one_to_n["data"]) == 3
    assert all(d["object"] == "score" for d in one_to_n["data"])
    scores = [d["score"] for d in one_to_n["data"]]
    assert abs(scores[1] - 1.0) < 1e-5 and scores[2] < scores[1]
    emb = post(embed_server, "/v1/embeddings", {"input": [TEXTS[1], TEXTS[2]]}).json()["data"]
    a, b = (np.asarray(e["embedding"]) for e in emb)
    assert abs(scores[2] - float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))) < 1e-6
    n_to_n = post(embed_server, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    assert len(n_to_n["data"]) == 2 and n_to_n["usage"]["prompt_tokens"] > 0
    bad = post(embed_server, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


def test_rerank(embed_server: str) -> None:
    docs = ["The stock market crashed.", "Kittens love to sleep on mats.", "A dog barks."]
    body = {"query": "Where do cats sleep?", "documents": docs}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = post(embed_server, path, body).json()
        assert r["results"][0] == {
            "index": 1,
            "relevance_score": pytest.approx(r["results"][0]["relevance_score"]),
            "document": {"text": docs[1]},
        }
        scores = [x["relevance_score"] for x in r["results"]]
        assert scores == sorted(scores, reverse=True) and len(scores) == 3
        assert r["usage"]["total_tokens"] > 0
    top = post(embed_server, "/v1/rerank", {**body, "top_n": 1, "return_documents": False})
    assert [x.keys() for x in top.json()["results"]] == [{"index", "relevance_score"}]
    empty = post(embed_server, "/v1/rerank", {"query": "q", "documents": []})
    assert empty.status_code == 400


def test_pooling_route(embed_server: str) -> None:
    r = post(embed_server, "/pooling", {"input": ["Hello world"]}).json()
    assert r["object"] == "list" and r["data"][0]["object"] == "pooling"
    emb = post(embed_server, "/v1/embeddings", {"input": "Hello world"}).json()
    assert r["data"][0]["data"] == emb["data"][0]["embedding"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": "hi", "priority": 2**64 + 5}),
        ("/v1/score", {"text_1": "a", "text_2": ["b"], "priority": 2**64 + 5}),
        ("/rerank", {"query": "a", "documents": ["b"], "priority": -(2**70)}),
    ],
)
def test_priority_past_64_bits_is_a_400(embed_server: str, path: str, body: object) -> None:
    """Found by the fuzzer: such a priority reached the engine socket's encoder (500)."""
    r = httpx.post(embed_server + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions/batch", [{"messages": [{"role": "user", "content": "hi"}]}]),
        ("/v1/messages", {"model": NAME, "max_tokens": 2, "messages": []}),
        ("/invocations", {"prompt": "hi"}),
    ],
)
def test_generation_routes_refuse_an_embedding_model(
    embed_server: str, path: str, body: object
) -> None:
    r = post(embed_server, path, body)
    assert r.status_code == 400, r.text
    text = r.text
    assert "'generate'" in text and "['embed']" in text


def test_embedding_model_still_serves_the_rest(embed_server: str) -> None:
    assert httpx.get(embed_server + "/v1/models").json()["data"][0]["id"] == NAME
    tokens = post(embed_server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["tokens"] == [101, 7592, 2088, 102]
    sagemaker = post(embed_server, "/invocations", {"input": "Hello world"})
    assert sagemaker.status_code == 200 and len(sagemaker.json()["data"][0]["embedding"]) == 384


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": "hi"}),
        ("/pooling", {"input": "hi"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/v2/rerank", {"query": "a", "documents": ["b"]}),
    ],
)
def test_pooling_routes_refuse_a_generation_model(server: Server, path: str, body: object) -> None:
    r = post(server.base_url, path, body)
    assert r.status_code == 400, r.text
    assert "'embed'" in r.text and "['generate']" in r.text


def test_concurrent_requests_batch_and_free_everything(embed_server: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"sentence number {i} " * (1 + i % 7) for i in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda t: post(embed_server, "/v1/embeddings", {"input": t}), texts)
        )
    assert all(r.status_code == 200 for r in results)
    together = post(embed_server, "/v1/embeddings", {"input": texts}).json()["data"]
    for r, d in zip(results, together, strict=True):
        a, b = np.asarray(r.json()["data"][0]["embedding"]), np.asarray(d["embedding"])
        assert cosine_distance(a, b) < 1e-6
    stats = httpx.get(embed_server + "/stats").json()
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0
