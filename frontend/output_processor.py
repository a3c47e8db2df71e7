"""OutputProcessor: engine deltas → text, stop strings, logprobs, RequestOutputs.

Runs in the frontend (API server or SDK), never in the engine. For each
sample it detokenizes incrementally, looks for stop strings across token
boundaries and holds back any tail that could still become one, so a stop
string never leaks into a stream. When a stop string matches, the caller
aborts the engine request. A request with n > 1 is fanned out into n engine
requests (one per sample) that this class folds back into one output.
Without a tokenizer (token ids in and out) nothing is detokenized: outputs
carry token ids, no text, and logprobs no decoded tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pagoda.frontend.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagoda.frontend.tokenizer import Tokenizer
from pagoda.protocol.messages import Logprobs, RequestDelta
from pagoda.protocol.sampling_params import SamplingParams

OutputKind = Literal["cumulative", "delta", "final"]


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample i of n: one engine request; seeded samples get seed + i."""
    import msgspec

    seed = params.seed + index if params.seed is not None and params.n > 1 else params.seed
    return msgspec.structs.replace(params, n=1, seed=seed)


@dataclass
class SampleState:
    """Detokenization and stop-string state of one sample."""

    index: int
    params: SamplingParams
    decoder: object
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0  # chars of `text` already handed out
    sent_token_len: int = 0
    logprobs: list[PositionLogprobs] | None = None
    sent_logprobs_len: int = 0
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_sent: bool = False
    weight_versions: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class RequestState:
    """One user request (n samples) being assembled from engine deltas."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        output_kind: OutputKind,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.output_kind = output_kind
        # Positions are kept for logprobs and for logprob_token_ids alike.
        wants_logprobs = params.logprobs is not None or params.logprob_token_ids is not None
        self.samples = [
            SampleState(
                i,
                params,
                None if tokenizer is None else tokenizer.decode_stream(params.skip_special_tokens),
                logprobs=[] if wants_logprobs else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.error: str | None = None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def child_ids(self) -> list[str]:
        n = self.params.n
        return [child_request_id(self.request_id, i, n) for i in range(n)]

    # ----------------------------------------------------------------- update

    def apply(self, index: int, delta: RequestDelta) -> bool:
        """Fold one engine delta into sample `index`; True if a stop string ended it."""
        sample = self.samples[index]
        if sample.finish_reason is not None:
            return False
        if delta.error is not None:
            self.error = delta.error
        if self.first_token_time is None and delta.new_token_ids:
            self.first_token_time = time.monotonic()
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [
                self._to_position(lp) if lp else None for lp in delta.prompt_logprobs
            ]
        stop_terminated = delta.finish_reason == "stop" and delta.new_token_ids
        for i, token_id in enumerate(delta.new_token_ids):
            sample.token_ids.append(token_id)
            if delta.new_logprobs is not None and sample.logprobs is not None:
                lp = delta.new_logprobs[i]
                sample.logprobs.append(self._to_position(lp))
                if sample.cumulative_logprob is not None:
                    sample.cumulative_logprob += lp.logprobs[0]
            is_last = i == len(delta.new_token_ids) - 1
            if self.tokenizer is None:
                continue  # token ids only
            if is_last and stop_terminated and not self.params.include_stop_str_in_output:
                continue  # EOS / stop token: its text is not part of the output
            piece = sample.decoder.step(self.tokenizer.backend, token_id)  # type: ignore[attr-defined]
            if piece:
                previous_len = len(sample.text)
                sample.text += piece
                if self.params.stop and self._check_stop_strings(sample, previous_len):
                    return True
        if delta.finish_reason is not None:
            sample.finish_reason = "stop" if delta.finish_reason == "stop" else delta.finish_reason
            sample.stop_reason = delta.stop_reason
            sample.kv_transfer_params = delta.kv_transfer_params
            if delta.weight_versions:
                sample.weight_versions = [
                    {"version": v, "start": start, "end": end}
                    for v, start, end in delta.weight_versions
                ]
        return False

    def _check_stop_strings(self, sample: SampleState, previous_len: int) -> bool:
        search_from = max(0, previous_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            pos = sample.text.find(stop, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        cut = pos + len(stop) if self.params.include_stop_str_in_output else pos
        sample.text = sample.text[:cut]
        sample.finish_reason = "stop"
        sample.stop_reason = stop
        return True

    def _to_position(self, lp: Logprobs) -> PositionLogprobs:
        position: PositionLogprobs = {}
        for j, (token_id, value) in enumerate(zip(lp.token_ids, lp.logprobs, strict=True)):
            rank = lp.rank if j == 0 else j
            if token_id in position:
                continue  # the chosen token is also in the top-N
            position[token_id] = Logprob(value, rank, self._token_text(token_id))
        if lp.requested is not None:
            # logprob_token_ids' values; their rank is not computed.
            requested = self.params.logprob_token_ids or []
            for token_id, value in zip(requested, lp.requested, strict=True):
                if token_id not in position:
                    position[token_id] = Logprob(value, None, self._token_text(token_id))
        return position

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.token_text(token_id)

    def finish_all(self, reason: str) -> None:
        for sample in self.samples:
            if sample.finish_reason is None:
                sample.finish_reason = reason

    # ----------------------------------------------------------------- output

    def _holdback(self, sample: SampleState) -> int:
        """Chars at the end of the text that could still begin a stop string."""
        if sample.finish_reason is not None or not self.params.stop:
            return 0
        text = sample.text
        for k in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return k
        return 0

    def make_output(self) -> RequestOutput | None:
        """The output to hand out now, or None if there is nothing new."""
        finished = self.finished
        if self.output_kind == "final" and not finished:
            return None
        outputs: list[CompletionOutput] = []
        any_new = False
        for sample in self.samples:
            visible = len(sample.text) - self._holdback(sample)
            if self.output_kind == "delta":
                text = sample.text[sample.sent_text_len : visible]
                token_ids = sample.token_ids[sample.sent_token_len :]
                logprobs = (
                    sample.logprobs[sample.sent_logprobs_len :]
                    if sample.logprobs is not None
                    else None
                )
                finishing = sample.finish_reason is not None and not sample.finish_sent
                if not (text or token_ids or finishing):
                    continue  # delta mode lists only the samples that changed
                any_new = True
                sample.sent_text_len = visible
                sample.sent_token_len = len(sample.token_ids)
                if sample.logprobs is not None:
                    sample.sent_logprobs_len = len(sample.logprobs)
                sample.finish_sent = sample.finish_reason is not None
                outputs.append(
                    CompletionOutput(
                        sample.index,
                        text,
                        token_ids,
                        sample.cumulative_logprob,
                        logprobs,
                        sample.finish_reason,
                        sample.stop_reason,
                        sample.weight_versions if sample.finish_reason else None,
                        sample.kv_transfer_params if sample.finish_reason else None,
                    )
                )
            else:
                any_new = True
                outputs.append(
                    CompletionOutput(
                        sample.index,
                        sample.text[:visible],
                        list(sample.token_ids),
                        sample.cumulative_logprob,
                        list(sample.logprobs) if sample.logprobs is not None else None,
                        sample.finish_reason,
                        sample.stop_reason,
                        sample.weight_versions if sample.finish_reason else None,
                        sample.kv_transfer_params if sample.finish_reason else None,
                    )
                )
        if not any_new:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )
