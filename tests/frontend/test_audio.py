"""Audio decoding, chunking and Whisper's log-mel features (frontend/audio.py).

The features are compared with faster-whisper's own feature extractor, run
the way its `transcribe` runs it on one window of at most 30 s. Tolerance:
1e-4 after Whisper's (x + 4) / 4 scaling, i.e. 4e-4 in log10 power, a
relative power error of 0.1 %. Both sides compute a float32 STFT of the
same frames, so what may differ is float32 rounding in the FFT and the
filter-bank product (about 1e-6 relative each); 1e-4 leaves two orders of
magnitude for that while any real difference (a window, an off-by-one
frame, another mel scale) moves values by 1e-2 or more.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile

from pagoda.frontend.audio import (
    N_FRAMES,
    SAMPLE_RATE,
    AudioError,
    decode_audio,
    features_bytes,
    log_mel_features,
    mel_filter_bank,
    split_audio,
)

faster_whisper = pytest.importorskip("faster_whisper")
from faster_whisper.audio import pad_or_trim  # noqa: E402
from faster_whisper.feature_extractor import FeatureExtractor  # noqa: E402

TOLERANCE = 1e-4


def reference_features(samples: np.ndarray, n_mels: int) -> np.ndarray:
    """faster-whisper's encoder input for a clip of at most 30 s."""
    features = FeatureExtractor(feature_size=n_mels)(samples)
    content_frames = features.shape[-1] - 1
    return np.asarray(pad_or_trim(features[:, :content_frames]))


def voiced(seconds: float, seed: int = 0) -> np.ndarray:
    """A speech-like signal: a 120 Hz pulse train through three formant
    resonances, in syllables of 0.2 s separated by pauses, plus breath noise."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    pitch = 120 + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = np.cumsum(pitch) / SAMPLE_RATE
    source = (np.diff(np.floor(phase), prepend=0.0) > 0).astype(np.float64)
    out = np.zeros(n)
    for formant, bandwidth in ((700, 80), (1200, 90), (2600, 120)):
        # A two-pole resonator at the formant, run as a short FIR of its impulse response.
        k = np.arange(400) / SAMPLE_RATE
        impulse = np.exp(-np.pi * bandwidth * k) * np.sin(2 * np.pi * formant * k)
        out += np.convolve(source, impulse)[:n]
    syllables = (np.sin(2 * np.pi * 2.5 * t) > 0.0).astype(np.float64)
    signal = 0.3 * out / np.abs(out).max() * syllables + 0.003 * rng.standard_normal(n)
    return signal.astype(np.float32)


def test_mel_filter_bank_matches_reference() -> None:
    for n_mels in (80, 128):
        reference = FeatureExtractor(feature_size=n_mels).mel_filters
        assert mel_filter_bank(n_mels).shape == (n_mels, 201)
        np.testing.assert_allclose(mel_filter_bank(n_mels), reference, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("seconds", [0.5, 5.0, 12.34, 30.0])
@pytest.mark.parametrize("n_mels", [80, 128])
def test_features_match_faster_whisper(seconds: float, n_mels: int) -> None:
    rng = np.random.default_rng(int(seconds * 100) + n_mels)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    tone = 0.3 * np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 0.5 * t)
    for samples in (
        voiced(seconds, seed=n_mels),
        (tone + 0.05 * rng.standard_normal(n)).astype(np.float32),
        (0.5 * rng.standard_normal(n)).astype(np.float32),
    ):
        features = log_mel_features(samples, n_mels)
        assert features.shape == (n_mels, N_FRAMES)
        assert features.dtype == np.float32
        np.testing.assert_allclose(
            features, reference_features(samples, n_mels), rtol=0, atol=TOLERANCE
        )


def test_features_of_silence_and_of_a_decoded_file() -> None:
    silence = np.zeros(3 * SAMPLE_RATE, dtype=np.float32)
    np.testing.assert_allclose(
        log_mel_features(silence, 80), reference_features(silence, 80), atol=TOLERANCE
    )
    # 44.1 kHz stereo FLAC: decoded, mixed down, resampled, then featurized.
    clip = voiced(4.0, seed=3)
    stereo = np.stack([clip, 0.5 * clip], axis=1)
    data = encode(stereo, 44_100, "FLAC")
    samples = decode_audio(data)
    np.testing.assert_allclose(
        log_mel_features(samples, 80), reference_features(samples, 80), atol=TOLERANCE
    )


def test_features_wire_form() -> None:
    features = log_mel_features(voiced(1.0), 80)
    data = features_bytes(features)
    assert len(data) == 80 * N_FRAMES * 4
    back = np.frombuffer(data, dtype="<f4").reshape(80, N_FRAMES)
    np.testing.assert_array_equal(back, features)


def test_window_longer_than_30_s_is_refused() -> None:
    with pytest.raises(ValueError, match="at most"):
        log_mel_features(np.zeros(31 * SAMPLE_RATE, dtype=np.float32), 80)


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


FORMATS = [
    ("WAV", "PCM_16", 1e-3),
    ("WAV", "FLOAT", 1e-6),
    ("FLAC", "PCM_16", 1e-3),
    ("OGG", "VORBIS", None),
    ("MP3", "MPEG_LAYER_III", None),
]


@pytest.mark.parametrize(("fmt", "subtype", "exact"), FORMATS)
@pytest.mark.parametrize("rate", [16_000, 44_100])
def test_decode_every_format(fmt: str, subtype: str, exact: float | None, rate: int) -> None:
    if fmt not in soundfile.available_formats():
        pytest.skip(f"this libsndfile ({soundfile.__libsndfile_version__}) cannot write {fmt}")
    if fmt == "MP3" and rate == 44_100:
        rate = 48_000  # libsndfile's MP3 encoder takes the MPEG-1 rates
    seconds = 2.0
    t = np.arange(int(seconds * rate)) / rate
    clip = (0.4 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    samples = decode_audio(encode(clip, rate, fmt, subtype))
    assert samples.dtype == np.float32
    assert samples.ndim == 1
    # Lossy codecs add priming samples; the duration is right to within 0.1 s.
    assert abs(len(samples) / SAMPLE_RATE - seconds) < 0.1
    if exact is not None:
        expected = (0.4 * np.sin(2 * np.pi * 300 * np.arange(len(samples)) / SAMPLE_RATE))[100:-100]
        # Resampling (soxr) passes a 300 Hz tone unchanged to well under 1e-3.
        np.testing.assert_allclose(samples[100:-100], expected, atol=max(exact, 2e-3))
    else:
        # A lossy codec keeps the tone's energy: RMS of 0.4 / sqrt(2).
        rms = float(np.sqrt(np.mean(samples[SAMPLE_RATE // 4 : -SAMPLE_RATE // 4] ** 2)))
        assert abs(rms - 0.4 / np.sqrt(2)) < 0.03


def test_long_upload_resampled_in_blocks_matches_whole() -> None:
    # 20 s at 48 kHz: many decode blocks, resampled as one stream.
    import soxr

    rate = 48_000
    rng = np.random.default_rng(5)
    clip = (0.2 * rng.standard_normal(20 * rate)).astype(np.float32)
    samples = decode_audio(encode(clip, rate, "WAV", "FLOAT"))
    whole = soxr.resample(clip, rate, SAMPLE_RATE)
    assert len(samples) == len(whole) == 20 * SAMPLE_RATE
    np.testing.assert_allclose(samples, whole, atol=1e-4)


def test_extensible_wav() -> None:
    # WAVE_FORMAT_EXTENSIBLE, as many tools write float or multichannel WAVs.
    data = encode(voiced(1.0), SAMPLE_RATE, "WAVEX", "FLOAT")
    assert len(decode_audio(data)) == SAMPLE_RATE
    with pytest.raises(AudioError, match="truncated"):
        decode_audio(data[: len(data) - 1000])


def test_stereo_is_mixed_down() -> None:
    left = np.full(1600, 0.5, dtype=np.float32)
    data = encode(np.stack([left, -0.25 * np.ones_like(left)], axis=1), SAMPLE_RATE, "WAV", "FLOAT")
    np.testing.assert_allclose(decode_audio(data), 0.125, atol=1e-6)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"hello, this is not audio at all" * 10, "could not be decoded"),
        (b'{"json": true}', "could not be decoded"),
        (b"RIFF\x24\x00\x00\x00WAVE", "could not be decoded"),  # header cut short
    ],
)
def test_bad_input_gives_clear_errors(data: bytes, message: str) -> None:
    with pytest.raises(AudioError, match=message):
        decode_audio(data)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_truncated_file(fmt: str) -> None:
    data = encode(voiced(2.0), SAMPLE_RATE, fmt, "PCM_16")
    with pytest.raises(AudioError, match="truncated|could not be decoded"):
        decode_audio(data[: len(data) // 2])


def test_wav_written_to_a_pipe_is_not_truncated() -> None:
    # A writer to a pipe (espeak-ng --stdout) cannot go back to fill in the
    # lengths: it leaves placeholders near 2 GiB in the RIFF and data sizes.
    data = bytearray(encode(voiced(1.0), SAMPLE_RATE, "WAV", "PCM_16"))
    data[4:8] = (0x7FFFF024).to_bytes(4, "little")
    data[40:44] = (0x7FFFF000).to_bytes(4, "little")
    assert data[36:40] == b"data"
    assert len(decode_audio(bytes(data))) == SAMPLE_RATE


def test_file_with_no_samples() -> None:
    data = encode(np.zeros(0, dtype=np.float32), SAMPLE_RATE, "WAV", "PCM_16")
    with pytest.raises(AudioError, match="no samples"):
        decode_audio(data)


def test_unsupported_container_is_named() -> None:
    data = encode(voiced(0.5), SAMPLE_RATE, "AIFF", "PCM_16")
    with pytest.raises(AudioError, match="unsupported audio format AIFF"):
        decode_audio(data)


def test_chunking_splits_75_s_at_quiet_points() -> None:
    # Loud noise everywhere but two 0.1 s gaps, each inside the last second
    # before a 30 s mark: 29.4 s into the clip and 29.6 s after the first cut.
    rng = np.random.default_rng(7)
    samples = (0.5 * rng.standard_normal(75 * SAMPLE_RATE)).astype(np.float32)
    first = int(29.4 * SAMPLE_RATE)
    second = first + int(29.6 * SAMPLE_RATE)
    for gap in (first, second):
        samples[gap : gap + 1600] *= 0.001
    chunks = split_audio(samples)
    assert [len(c) for c in chunks] == [first, second - first, len(samples) - second]
    assert all(len(c) <= 30 * SAMPLE_RATE for c in chunks)
    np.testing.assert_array_equal(np.concatenate(chunks), samples)


def test_chunking_leaves_short_audio_whole() -> None:
    samples = voiced(30.0)
    assert [len(c) for c in split_audio(samples)] == [len(samples)]
    # Silence throughout: the earliest quiet stretch, one second before the mark.
    silence = np.zeros(61 * SAMPLE_RATE, dtype=np.float32)
    lengths = [len(c) for c in split_audio(silence)]
    assert lengths == [29 * SAMPLE_RATE, 29 * SAMPLE_RATE, 3 * SAMPLE_RATE]
