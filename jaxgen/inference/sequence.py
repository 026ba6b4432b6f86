"""A sequence in the serving engine: its `Sequence` record, its `Status`, the engine's errors and the
fixed limits it checks a request against (`check_limits`).

The engine and its scheduler (`jaxgen.inference.engine`, `.scheduler`) write a request's progress (its
pages are the page policy's: `Sequence.pages` reads them); clients read it (`result()`, `text`, `tokens`,
`finish_reason`, `done_event`) and may be called back after each decode chunk (`on_update`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from jaxgen.inference.adapters import LoraRef
from jaxgen.inference.decode import Completion, HostRows, finish_row
from jaxgen.inference.sampling import MAX_STOP_SEQUENCE, SamplingConfig, SamplingError
from jaxgen.inference.scoring import prompt_entries

log = logging.getLogger(__name__)


class Status(str, enum.Enum):
    """Where a sequence is: WAITING -> PREFILL -> RUNNING -> DONE, or CANCELLED / FAILED from any live state;
    a preempted sequence goes back from PREFILL or RUNNING to WAITING, its tokens kept.
    A str enum, so `request.status == "running"` reads as it did."""

    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


LIVE = (Status.WAITING, Status.PREFILL, Status.RUNNING)


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped: it admits no new request."""


class RequestFailed(RuntimeError):
    """A request ended with an error (`Sequence.error`), not with a completion."""


def check_limits(c: SamplingConfig, stops: list[tuple[int, ...]], max_logprobs: int) -> None:
    """SamplingError for settings past the engine's fixed limits: more log-probabilities than `max_logprobs`
    (serve.max_logprobs), a stop token sequence longer than MAX_STOP_SEQUENCE."""
    for name, value in (("logprobs", c.logprobs), ("prompt_logprobs", c.prompt_logprobs or 0)):
        if value > max_logprobs:
            raise SamplingError(f"{name}={value} is not allowed: at most {max_logprobs} (serve.max_logprobs)", name)
    if any(len(q) > MAX_STOP_SEQUENCE for q in stops):
        message = f"a stop token sequence is longer than {MAX_STOP_SEQUENCE} tokens"
        raise SamplingError(message, "stop_token_sequences")


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sequence in the engine (a request with n samples is n of these)."""

    prompt: list[int]
    sampling: SamplingConfig  # its seed already offset for the sample index
    prompt_index: int = 0
    sample_index: int = 0
    on_update: Callable[[Sequence], None] | None = None  # called from the engine thread after each chunk
    lora: LoraRef | None = None  # the LoRA adapter it runs with (multi-LoRA serving), None: the base model
    # progress, written by the engine
    status: Status = Status.WAITING
    slot: int = -1
    admitted: int = -1  # the order it last got a slot in (the most recent is preempted first)
    preemptions: int = 0
    prefilled: int = 0  # tokens of `sequence` in the cache
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)  # when asked for
    prompt_top_logprobs: list[dict[int, float] | None] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # stop, length; cancelled or error when it ended without a completion
    error: str | None = None  # what went wrong, for a FAILED request
    cached_tokens: int = 0  # tokens of its last prefill served from the prefix cache
    # speculative decoding's standard rule: preempted with a residual draw pending, that residual (V,) float32
    # (`Runner.keep_residuals`), restored to its slot when it decodes again
    residual: np.ndarray | None = dataclasses.field(default=None, repr=False)
    t_submit: float = 0.0
    t_first: float | None = None
    t_done: float | None = None
    done_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    # the page policy's lists (`PagePolicy.held`), lent by the scheduler that queues it
    held: Mapping[Sequence, list[int]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def pages(self) -> list[int]:
        """The KV-cache pages it holds now, in position order (a copy; [] when it holds none)."""
        return list(self.held.get(self, ()))

    @property
    def prefix_salt(self) -> bytes:
        """What keys its prefix-cache pages beside their tokens: its adapter's load (b"" for the base model)."""
        return b"" if self.lora is None else self.lora.key

    @property
    def sequence(self) -> list[int]:
        """What a prefill puts in the cache: the prompt, and after a preemption the tokens so far."""
        return self.prompt + self.tokens

    def limit(self, context: int) -> int:
        """The most tokens (prompt included) this sequence can reach: max_new_tokens or the context."""
        return min(len(self.prompt) + self.sampling.max_new_tokens, context)

    @property
    def wants_prompt_scores(self) -> bool:
        """Its settings ask for prompt log-probabilities and its prefill has not yet scored every prompt token
        (a preempted sequence keeps those it has)."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    def take_prompt_scores(self, scores, start: int, n: int) -> None:
        """Appends the prompt log-probabilities of a scored prefill chunk of `n` tokens from `start`."""
        if start == 0:
            self.prompt_logprobs, self.prompt_top_logprobs = [None], [None]  # nothing predicts the first token
        k = min(n, len(self.prompt) - 1 - start)  # chunk positions whose next token is in the prompt
        lps, tops = prompt_entries(
            scores.logprobs[0, :k], scores.top_ids[0, :k], scores.top_logprobs[0, :k], self.sampling.prompt_logprobs
        )
        self.prompt_logprobs += lps[1:]
        self.prompt_top_logprobs += tops[1:]

    def take(self, host: HostRows, row: int) -> list[int]:
        """Appends what the last decode chunk gave row `row` (tokens, log-probabilities); returns the new tokens."""
        n = int(host.generated[row]) - len(self.tokens)  # a live row fills columns 0.. of the chunk's buffers
        new = host.tokens[row, :n].tolist()
        self.tokens += new
        self.logprobs += host.logprobs[row, :n].tolist()
        if self.sampling.logprobs:
            self.top_logprobs += host.alternatives(row, 0, n, self.sampling.logprobs)
        return new

    def complete(self, tokenizer, stops: list[tuple[int, ...]], reason: str) -> None:
        """Its text and finish reason, its tokens cut at a stop string (`finish_row`, as in Generator)."""
        keep, self.text, self.finish_reason = finish_row(tokenizer, self.tokens, self.sampling, stops, reason)
        self.tokens, self.logprobs = self.tokens[:keep], self.logprobs[:keep]
        self.top_logprobs = self.top_logprobs[:keep]
        self.t_done = time.perf_counter()

    def end(self) -> None:
        """Its end, however it ended (the engine freed its slot and pages): the finish reason of a cancelled
        or failed one, the client told (`on_update`), waiters woken."""
        if self.status == Status.CANCELLED:
            self.finish_reason = "cancelled"
        elif self.status == Status.FAILED:
            self.finish_reason = "error"
        if self.on_update is not None:
            try:
                self.on_update(self)
            except Exception:
                log.exception("a request's on_update failed as it ended")
        self.done_event.set()

    def result(self, timeout: float | None = None) -> Completion:
        """The completion; RequestFailed for a failed request (a cancelled one returns what it had)."""
        if not self.done_event.wait(timeout):
            raise TimeoutError("request not finished")
        if self.status == Status.FAILED:
            raise RequestFailed(self.error)
        alts = self.top_logprobs if self.sampling.logprobs else None
        prompt = (self.prompt_logprobs, self.prompt_top_logprobs) if self.sampling.prompt_logprobs is not None else ()
        return Completion(
            self.prompt_index, self.sample_index, self.tokens, self.text, self.finish_reason, self.logprobs, alts,
            *prompt,
        )  # fmt: skip
