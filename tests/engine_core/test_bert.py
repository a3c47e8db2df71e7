"""BERT encoders and pooling requests against HF transformers + the pooling config.

The reference is HF `BertModel` (each sequence alone, unpadded) followed by
the pooling that the model's sentence-transformers config asks for. The real
model is all-MiniLM-L6-v2 (mean pooling, normalized); tiny random BERTs cover
CLS and last-token pooling without normalization, and a tiny Llama run with
runner="pooling" covers decoder embeddings.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.model_config import (
    ModelLoadError,
    PoolerConfig,
    load_model_config,
    supported_tasks,
)
from pagoda.protocol.messages import AddRequest, RequestDelta
from pagoda.protocol.pooling_params import PoolingParams
from pagoda.protocol.sampling_params import SamplingParams
from tests.conftest import build_tiny_bert
from tests.engine_core.helpers import NUM_THREADS

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog, again and again, until it tires.",
    "a",
    "Embeddings turn text into vectors that can be compared by cosine similarity.",
]


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(1.0 - np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@torch.inference_mode()
def hf_embeddings(
    model_dir: Path, prompts: list[list[int]], pooler: PoolerConfig, decoder: bool = False
) -> list[np.ndarray]:
    """HF last_hidden_state of each prompt alone, pooled as the config says."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [n, hidden]
        if pooler.pooling_type == "CLS":
            vec = hidden[0]
        elif pooler.pooling_type == "LAST":
            vec = hidden[-1]
        else:
            vec = hidden.mean(dim=0)
        if pooler.normalize:
            vec = F.normalize(vec, dim=-1)
        out.append(vec.numpy())
    return out


def embed_all(
    engine: EngineCore, prompts: list[list[int]], params: PoolingParams | None = None
) -> tuple[dict[str, np.ndarray], list[RequestDelta], int]:
    """Add every prompt as a pooling request, step to the end: vectors, errors, steps."""
    errors = []
    for i, ids in enumerate(prompts):
        error = engine.add_request(
            AddRequest(str(i), ids, SamplingParams(), 0.0, pooling_params=params or PoolingParams())
        )
        if error is not None:
            errors.append(error)
    vectors: dict[str, np.ndarray] = {}
    steps = 0
    while engine.has_work():
        steps += 1
        for _, delta in engine.step():
            assert delta.finish_reason == "stop" and delta.pooled is not None
            assert delta.new_token_ids == []
            vectors[delta.request_id] = np.frombuffer(delta.pooled, dtype="<f4")
        engine.scheduler.block_manager.check_invariants()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a pooling request kept its blocks"
    return vectors, errors, steps


@pytest.fixture(scope="module")
def minilm_engine(minilm_dir: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(minilm_dir), num_threads=NUM_THREADS))


@pytest.fixture(scope="module")
def minilm_prompts(minilm_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def test_minilm_config_is_read_from_its_files(minilm_dir: Path) -> None:
    config = load_model_config(str(minilm_dir))
    assert config.is_encoder and config.architecture == "BertModel"
    assert config.pooler == PoolerConfig("MEAN", normalize=True)
    assert config.encoder is not None and config.encoder.max_seq_length == 256
    assert supported_tasks(config, "auto") == ["embed"]
    assert supported_tasks(config, "pooling") == ["embed"]
    with pytest.raises(ModelLoadError, match="encoder"):
        supported_tasks(config, "generate")


def test_minilm_matches_hf_alone_and_batched(
    minilm_engine: EngineCore, minilm_dir: Path, minilm_prompts: list[list[int]]
) -> None:
    ready = minilm_engine.ready_message()
    assert ready.supported_tasks == ["embed"] and ready.hidden_size == 384
    assert ready.max_model_len == 256  # sentence-transformers' max_seq_length
    reference = hf_embeddings(minilm_dir, minilm_prompts, PoolerConfig("MEAN", True))
    batched, errors, steps = embed_all(minilm_engine, minilm_prompts)
    assert not errors and steps == 1, "pooling requests of different lengths share one step"
    for i, ref in enumerate(reference):
        alone, _, _ = embed_all(minilm_engine, [minilm_prompts[i]])
        for got in (alone["0"], batched[str(i)]):
            assert got.shape == (384,)
            assert cosine_distance(got, ref) < 1e-5
            assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
    # Different texts, different vectors (the comparison above is not vacuous).
    assert cosine_distance(batched["0"], batched["1"]) > 0.1


def test_normalize_can_be_turned_off(
    minilm_engine: EngineCore, minilm_dir: Path, minilm_prompts: list[list[int]]
) -> None:
    reference = hf_embeddings(minilm_dir, minilm_prompts[:1], PoolerConfig("MEAN", False))
    got, _, _ = embed_all(minilm_engine, minilm_prompts[:1], PoolingParams(normalize=False))
    np.testing.assert_allclose(got["0"], reference[0], atol=1e-5)
    assert abs(float(np.linalg.norm(got["0"])) - 1.0) > 0.01


def test_bad_pooling_requests_fail_cleanly(minilm_engine: EngineCore) -> None:
    too_long = [101] + [2023] * 300 + [102]
    cases = {
        "long": (too_long, PoolingParams()),
        "dims": ([101, 102], PoolingParams(dimensions=8)),
        "oov": ([101, 40000], PoolingParams()),
    }
    for request_id, (ids, params) in cases.items():
        delta = minilm_engine.add_request(
            AddRequest(request_id, ids, SamplingParams(), 0.0, pooling_params=params)
        )
        assert delta is not None and delta.finish_reason == "error", request_id
    generate = minilm_engine.add_request(AddRequest("gen", [101, 102], SamplingParams(), 0.0))
    assert generate is not None and generate.error is not None
    assert "['embed']" in generate.error
    assert not minilm_engine.has_work()


def test_pooling_requests_wait_for_a_step_with_room(minilm_dir: Path) -> None:
    """Never chunked: a prompt that does not fit this step's budget waits for the next."""
    engine = EngineCore(
        EngineConfig(
            model=str(minilm_dir), max_num_batched_tokens=64, max_model_len=64, num_threads=1
        )
    )
    prompts = [[101] + [2023 + i] * 40 + [102] for i in range(3)]
    vectors, errors, steps = embed_all(engine, prompts)
    assert not errors and len(vectors) == 3 and steps == 3
    alone, _, _ = embed_all(engine, prompts[2:])
    assert cosine_distance(alone["0"], vectors["2"]) < 1e-6


@pytest.mark.parametrize(("pooling", "normalize"), [("CLS", False), ("LAST", True)])
def test_tiny_bert_pooling_modes(tmp_path: Path, pooling: str, normalize: bool) -> None:
    model_dir = build_tiny_bert(tmp_path / "bert", pooling, normalize)
    config = load_model_config(str(model_dir))
    assert config.pooler == PoolerConfig(pooling, normalize)
    prompts = [[1, 5, 9, 2], [1, 7, 7, 7, 7, 7, 7, 3, 2], [1, 2]]
    reference = hf_embeddings(model_dir, prompts, PoolerConfig(pooling, normalize))
    engine = EngineCore(EngineConfig(model=str(model_dir), num_threads=NUM_THREADS))
    vectors, errors, _ = embed_all(engine, prompts)
    assert not errors
    for i, ref in enumerate(reference):
        np.testing.assert_allclose(vectors[str(i)], ref, atol=1e-5)


def test_decoder_runs_as_a_last_token_pooler(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["llama"]
    engine = EngineCore(
        EngineConfig(
            model=str(model_dir),
            runner="pooling",
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            num_threads=NUM_THREADS,
        )
    )
    assert engine.ready_message().supported_tasks == ["embed"]
    prompts = [[1, 5, 9, 2, 11], [1, 7, 7, 7, 7, 7, 7, 3, 2, 4, 4, 4, 4, 4, 4, 4, 4, 8], [3]]
    reference = hf_embeddings(model_dir, prompts, PoolerConfig("LAST", True), decoder=True)
    vectors, errors, steps = embed_all(engine, prompts)
    assert not errors and steps == 1
    for i, ref in enumerate(reference):
        assert cosine_distance(vectors[str(i)], ref) < 1e-5
    generate = engine.add_request(AddRequest("gen", [1, 2], SamplingParams(), 0.0))
    assert generate is not None and generate.error is not None and "embed" in generate.error


def test_generation_engine_refuses_pooling(tiny_models: dict[str, Path]) -> None:
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_models["llama"]),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            num_threads=NUM_THREADS,
        )
    )
    assert engine.ready_message().supported_tasks == ["generate"]
    delta = engine.add_request(
        AddRequest("p", [1, 2], SamplingParams(), 0.0, pooling_params=PoolingParams())
    )
    assert delta is not None and delta.error is not None and "['generate']" in delta.error


def test_offline_sdk_embed_encode_score(minilm_dir: Path, minilm_engine: EngineCore) -> None:
    from pagoda.frontend.llm import LLM
    from pagoda.frontend.processor import UnsupportedTaskError

    llm = LLM(str(minilm_dir), num_threads=NUM_THREADS)
    embeds = llm.embed(TEXTS, use_tqdm=False)
    assert [len(e.outputs.embedding) for e in embeds] == [384] * len(TEXTS)
    engine_vectors, _, _ = embed_all(minilm_engine, [e.prompt_token_ids for e in embeds])
    for i, e in enumerate(embeds):
        np.testing.assert_array_equal(
            np.asarray(e.outputs.embedding, "<f4"), engine_vectors[str(i)]
        )
    encoded = llm.encode([embeds[0].prompt_token_ids], use_tqdm=False)
    # Alone rather than padded in a batch: equal up to float32 rounding.
    np.testing.assert_allclose(encoded[0].outputs.data, embeds[0].outputs.embedding, atol=1e-6)
    scores = llm.score(TEXTS[0], [TEXTS[0], TEXTS[1]], use_tqdm=False)
    assert abs(scores[0].outputs.score - 1.0) < 1e-6
    a, b = (np.asarray(e.outputs.embedding) for e in embeds[:2])
    expected = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert abs(scores[1].outputs.score - expected) < 1e-6
    cut = llm.embed("word " * 400, truncate_prompt_tokens=10, use_tqdm=False)
    assert len(cut[0].prompt_token_ids) == 10 and cut[0].prompt_token_ids[-1] == 102
    with pytest.raises(UnsupportedTaskError, match="embed"):
        llm.generate("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed("word " * 400, use_tqdm=False)


def test_padding_groups_bound_the_waste() -> None:
    from pagoda.engine_core.worker.encoder_runner import padding_groups

    lens = [5, 250, 7, 6, 120, 118, 249, 5]
    groups = padding_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for group in groups:
        real = sum(lens[i] for i in group)
        assert len(group) * max(lens[i] for i in group) <= 1.25 * real
    assert len(groups) == 3  # short, middle, long
    assert padding_groups([10] * 4) == [[0, 1, 2, 3]]
