"""When speculation pays: the engine's per-chunk choice between a speculative and a plain decode chunk, and
the Generator's per-group one (a group of requests decoded together: its drafter's prefill and speculative
state are part of its cost, so it chooses once, before its prefill, and its chunks all run the one way).

A speculative step feeds W + 1 tokens per row (and runs the drafter); it pays while the tokens it keeps per
step outweigh what the wider step costs. Both sides move with the batch: at batch 1 a step is bound by
reading the weights and a wider one is nearly free on an accelerator, while a large batch is bound by
compute, where W + 1 tokens per row cost close to W + 1 times as much; and acceptance moves with the text.
So the rule is measured, not modelled: per batch size (running rows, in power-of-two buckets) the engine
keeps the tokens per second of its recent speculative chunks (tokens kept: target steps plus accepted
drafts) and of its recent plain ones (a token per row and step), and

    a chunk speculates  iff  never measured plain at this batch,  or  spec tokens/s >= KEEP x plain tokens/s

with the unfavoured side run once every PROBE_EVERY chunks (the Generator's: groups) of that batch size to
keep its figure current.
Rows that asked for drafts decode plainly in a plain chunk, exactly as they would have: speculation never
changes the output, only the time. The gate is the engine's only clock-dependent decision, and its clock is
injectable (tests set the figures). The Generator tells its gate the rate of every chunk it runs, plain
requests' included, so a batch size's plain figure is known before its first speculating group.
"""

from __future__ import annotations

import dataclasses

KEEP = 0.95  # speculate while at least this share of plain decoding's tokens/s: on ties, drafts' acceptance wins
PROBE_EVERY = 16  # chunks of one batch size between runs of the side not chosen
SMOOTHING = 0.3  # weight of a new chunk's rate in the running figure


@dataclasses.dataclass
class _Rates:
    spec: float | None = None  # tokens per second
    plain: float | None = None
    chunks: int = 0


def bucket(rows: int) -> int:
    """The batch-size bucket of `rows` running rows: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


class SpecGate:
    """The rule of the module, per batch-size bucket; `choose` before a chunk (the Generator: a group), `observe`
    once its results are in."""

    def __init__(self):
        self.rates: dict[int, _Rates] = {}
        self.skipped = 0  # chunks (the Generator's: groups) that ran plain although rows asked for drafts

    def choose(self, rows: int) -> bool:
        """Whether the next chunk, with `rows` running rows of which some asked for drafts, speculates."""
        r = self.rates.setdefault(bucket(rows), _Rates())
        r.chunks += 1
        if r.spec is None or r.plain is None:  # measure speculation first, then plain once
            speculate = r.spec is None
        else:
            speculate = pays(r.spec, r.plain)
            if r.chunks % PROBE_EVERY == 0:  # the other side, to keep its figure current
                speculate = not speculate
        self.skipped += not speculate
        return speculate

    def observe(self, rows: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A chunk of `rows` rows gave `tokens` tokens in `seconds` (from its dispatch, or the previous chunk's
        results, to its results)."""
        if seconds <= 0 or tokens <= 0:
            return
        r = self.rates.setdefault(bucket(rows), _Rates())
        rate = tokens / seconds
        old = r.spec if speculative else r.plain
        new = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        if speculative:
            r.spec = new
        else:
            r.plain = new


def pays(spec_rate: float, plain_rate: float) -> bool:
    """The rule: speculation stays on while its tokens/s reach KEEP of plain decoding's."""
    return spec_rate >= KEEP * plain_rate
