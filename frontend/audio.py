"""Audio for speech to text: decode an upload, resample it, cut it, and compute
Whisper's log-mel features. numpy, soundfile and soxr only (no torch in the API
server).

    samples = decode_audio(upload_bytes)         # mono float32 at 16 kHz
    for chunk in split_audio(samples):           # <= 30 s each
        features = log_mel_features(chunk, 80)   # float32 [80, 3000]

The features are what the engine's Whisper encoder reads (`AddRequest.
encoder_features`, little-endian float32 [n_mels, 3000]). They follow the
feature pipeline of faster-whisper's `transcribe` for one 30 s window, the
reference the engine's tokens are compared with:

- a periodic Hann window of 400 samples, hop 160, the signal reflect-padded
  by 200 samples at each end (a centred STFT) after 160 zero samples are
  appended; the last two frames are left out (the dynamic range below still
  counts the second to last);
- power spectrum through a Slaney-style mel filter bank (linear below 1 kHz,
  logarithmic above, each filter scaled to equal area) of 80 or 128 mels;
- log10 with a floor of 1e-10, everything below the window's maximum - 8
  raised to it, then (x + 4) / 4;
- frames past the audio's end are 0.0, as faster-whisper pads its features
  (OpenAI's whisper pads the audio instead, which gives the floor value).

Long audio is cut into windows of at most 30 s as vLLM does: each cut lies
in the last second before the 30 s mark, at the start of the quietest
(lowest RMS) 0.1 s stretch there, so a cut rarely falls inside a word.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import numpy.typing as npt

SAMPLE_RATE = 16_000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480,000 samples in one window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3,000 feature frames in one window
OVERLAP_SECONDS = 1
# The stretch whose energy is compared when looking for a quiet cut: 0.1 s.
QUIET_WINDOW_SAMPLES = 1600
SUPPORTED_FORMATS = ("WAV", "FLAC", "OGG", "MP3")
# Decoding reads this many frames at a time (about 1.4 s at 48 kHz).
DECODE_BLOCK_FRAMES = 1 << 16
# A WAV data size at least this large is a streaming writer's placeholder.
UNKNOWN_WAV_LENGTH = 0x7FFF0000

Samples = npt.NDArray[np.float32]


class AudioError(ValueError):
    """The upload is not audio this server can read; the message says why."""


def decode_audio(data: bytes) -> Samples:
    """Mono float32 samples at 16 kHz from a WAV, FLAC, OGG or MP3 file's bytes."""
    import soundfile

    if not data:
        raise AudioError("the audio file is empty")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            container = "WAV" if f.format == "WAVEX" else f.format  # WAVE_FORMAT_EXTENSIBLE
            if container not in SUPPORTED_FORMATS:
                raise AudioError(
                    f"unsupported audio format {f.format}; send one of {list(SUPPORTED_FORMATS)}"
                )
            declared = f.frames
            samples, num_frames = _read_mono_16k(f)
    except AudioError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(
            f"the file could not be decoded as audio ({_short(e)}); "
            f"send one of {list(SUPPORTED_FORMATS)}"
        ) from None
    if num_frames == 0:
        raise AudioError("the audio file holds no samples")
    if container in ("WAV", "FLAC") and num_frames < declared:
        # Formats whose header states the length: fewer samples means a cut file.
        raise AudioError(
            f"the audio file is truncated: {num_frames} of {declared} samples are present"
        )
    if container == "WAV":
        _check_wav_length(data)
    return samples


def _read_mono_16k(f: Any) -> tuple[Samples, int]:
    """An open soundfile.SoundFile's samples, mixed down and resampled block by
    block (a long upload at 48 kHz stereo never sits whole in memory at that
    rate); also how many frames the file held."""
    stream = None
    if f.samplerate != SAMPLE_RATE:
        import soxr

        stream = soxr.ResampleStream(f.samplerate, SAMPLE_RATE, 1, dtype="float32")
    pieces = []
    num_frames = 0
    # block: [frames, channels]
    for block in f.blocks(DECODE_BLOCK_FRAMES, dtype="float32", always_2d=True):
        num_frames += len(block)
        mono = block.mean(axis=1, dtype=np.float32)
        pieces.append(mono if stream is None else stream.resample_chunk(mono))
    if stream is not None:
        pieces.append(stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
    samples = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    return samples.astype(np.float32, copy=False), num_frames


def _check_wav_length(data: bytes) -> None:
    """A WAV whose data chunk is shorter than its header says is cut short.

    libsndfile reads such a file without complaint (it trusts the file size),
    so the header is read here. Writers to a pipe put a placeholder of about
    2 or 4 GiB there (espeak-ng writes 0x7FFFF000, others 0xFFFFFFFF), as the
    length is not known yet: a size that large is not checked.
    """
    offset = 12  # "RIFF", size, "WAVE"
    while offset + 8 <= len(data):
        chunk_id = data[offset : offset + 4]
        size = int.from_bytes(data[offset + 4 : offset + 8], "little")
        if chunk_id == b"data":
            present = len(data) - offset - 8
            if size < UNKNOWN_WAV_LENGTH and present < size:
                raise AudioError(
                    f"the audio file is truncated: {present} of {size} bytes of samples are present"
                )
            return
        offset += 8 + size + (size & 1)  # chunks are padded to an even length


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def split_audio(samples: Samples) -> list[Samples]:
    """`samples` cut into windows of at most 30 s, each cut at a quiet point."""
    chunks = []
    start = 0
    while len(samples) - start > N_SAMPLES:
        end = start + N_SAMPLES
        cut = quietest_point(samples, end - OVERLAP_SECONDS * SAMPLE_RATE, end)
        chunks.append(samples[start:cut])
        start = cut
    chunks.append(samples[start:])
    return chunks


def quietest_point(samples: Samples, begin: int, end: int) -> int:
    """The start of the lowest-RMS 0.1 s stretch of samples[begin:end]; `begin`
    when the range is shorter than one stretch."""
    num = (end - begin) // QUIET_WINDOW_SAMPLES
    if num == 0:
        return begin
    # [num, QUIET_WINDOW_SAMPLES]
    stretches = samples[begin : begin + num * QUIET_WINDOW_SAMPLES].reshape(num, -1)
    energy = np.sqrt(np.mean(np.square(stretches, dtype=np.float64), axis=1))
    # argmin picks the first of equal minima: the earliest quiet point.
    return begin + int(np.argmin(energy)) * QUIET_WINDOW_SAMPLES


def mel_filter_bank(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> Samples:
    """Whisper's Slaney-style mel filters: [n_mels, n_fft // 2 + 1], triangles
    on the Slaney mel scale from 0 Hz to Nyquist, each scaled to unit area."""
    # Slaney's scale: 3 mels per 200 Hz up to 1 kHz (mel 15), then a
    # logarithmic step of ln(6.4) / 27 per mel.
    linear_step = 200.0 / 3.0
    knee_hz = 1000.0
    knee_mel = knee_hz / linear_step
    log_step = np.log(6.4) / 27.0

    def hz_to_mel(hz: float) -> float:
        return hz / linear_step if hz < knee_hz else knee_mel + np.log(hz / knee_hz) / log_step

    def mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.where(
            mel < knee_mel, mel * linear_step, knee_hz * np.exp(log_step * (mel - knee_mel))
        )

    # n_mels + 2 edges: filter i rises from edge i to edge i+1, falls to edge i+2.
    edges_hz = mel_to_hz(np.linspace(0.0, hz_to_mel(sample_rate / 2), n_mels + 2))
    bins_hz = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)  # [n_fft // 2 + 1]
    left, centre, right = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (bins_hz[None, :] - left) / (centre - left)
    falling = (right - bins_hz[None, :]) / (right - centre)
    triangles = np.clip(np.minimum(rising, falling), 0.0, None)  # [n_mels, n_fft // 2 + 1]
    area_scale = 2.0 / (right - left)
    return (triangles * area_scale).astype(np.float32)


def log_mel_features(samples: Samples, n_mels: int) -> Samples:
    """Whisper's log-mel features of one window of at most 30 s: float32 [n_mels, 3000]."""
    if len(samples) > N_SAMPLES:
        raise ValueError(f"a window holds at most {N_SAMPLES} samples, got {len(samples)}")
    signal = np.pad(samples.astype(np.float32), (0, HOP_LENGTH))
    half = N_FFT // 2
    signal = np.pad(signal, (half, half), mode="reflect")
    # [num_frames + 1, N_FFT]; the last frame is dropped below.
    frames = np.lib.stride_tricks.sliding_window_view(signal, N_FFT)[::HOP_LENGTH]
    window = np.hanning(N_FFT + 1)[:-1].astype(np.float32)  # periodic Hann
    spectrum = np.fft.rfft(frames * window, axis=-1).astype(np.complex64)
    power = np.abs(spectrum[:-1]) ** 2  # [num_frames, N_FFT // 2 + 1]
    mel = mel_filter_bank(n_mels) @ power.T  # [n_mels, num_frames]
    log_mel = np.log10(np.clip(mel, 1e-10, None))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    log_mel = (log_mel + 4.0) / 4.0
    features = np.zeros((n_mels, N_FRAMES), dtype=np.float32)
    # The last frame mostly covers the appended zeros: faster-whisper leaves it out too.
    num = min(log_mel.shape[1] - 1, N_FRAMES)
    features[:, :num] = log_mel[:, :num]
    return features


def features_bytes(features: Samples) -> bytes:
    """The wire form of features: little-endian float32, row-major [n_mels, 3000]."""
    return np.ascontiguousarray(features, dtype="<f4").tobytes()
