"""Subtitles from transcription segments: SubRip (srt) and WebVTT (vtt).

    1                                 WEBVTT
    00:00:00,000 --> 00:00:04,200
    Hello there.                      00:00:00.000 --> 00:00:04.200
                                      Hello there.

Times are cut (not rounded) to whole milliseconds, so a cue never ends
after the audio does. A segment's text is stripped of the space Whisper puts
before each segment; an empty segment (silence) gives no cue, and the cues
are numbered without gaps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """A stretch of transcribed audio: seconds from the start, and its text."""

    start: float
    end: float
    text: str


def timestamp(seconds: float, decimal_marker: str) -> str:
    """HH:MM:SS,mmm (srt) or HH:MM:SS.mmm (vtt); hours go past 99 if they must."""
    if seconds < 0:
        raise ValueError(f"a timestamp cannot be negative: {seconds}")
    millis = int(seconds * 1000 + 1e-6)  # 1e-6: 4.2 * 1000 is 4199.999...
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{millis:03d}"


def _cues(segments: list[Segment]) -> list[tuple[Segment, str]]:
    cues = []
    for segment in segments:
        # A blank line ends a cue in both formats: keep the text to non-blank lines.
        text = "\n".join(line for line in segment.text.strip().splitlines() if line.strip())
        if text:
            cues.append((segment, text))
    return cues


def to_srt(segments: list[Segment]) -> str:
    blocks = [
        f"{i}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{text}\n"
        for i, (s, text) in enumerate(_cues(segments), start=1)
    ]
    return "\n".join(blocks)


def to_vtt(segments: list[Segment]) -> str:
    blocks = ["WEBVTT\n"]
    for s, text in _cues(segments):
        # "-->" in a cue's text would read as a timing line.
        text = text.replace("-->", "->")
        blocks.append(f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{text}\n")
    return "\n".join(blocks)
