"""Beam search in the same style as sampling: a jitted `lax.while_loop` over a named `BeamState`.

    hyps = beam_search(gen, ["def fib("], width=4, max_new_tokens=32, length_penalty=1.0)

Each prompt keeps `width` live beams (rows of the KV cache, reordered every step) and the `width`
best finished hypotheses. A hypothesis's score is its summed log-probability divided by
(generated length) ** length_penalty. With early_stopping a prompt stops once it has `width`
finished hypotheses; without, once no live beam can still beat the worst finished one (as in
Hugging Face's heuristic). Beams still alive at `max_new_tokens` count as finished, and so do a
prompt's beams when their next token would lie past the model's context (as greedy's "length").
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import model
from jaxgen.config import ModelConfig
from jaxgen.inference.decode import bucket
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import SamplingError
from jaxgen.model.kvcache import KVCache

NEG = -1e30


@flax.struct.dataclass
class BeamState:
    step: jax.Array  # () int32
    tokens: jax.Array  # (P, W, M) live beams' tokens
    scores: jax.Array  # (P, W) live beams' summed log-probabilities
    fin_tokens: jax.Array  # (P, W, M)
    fin_scores: jax.Array  # (P, W) length-normalised; NEG = empty
    fin_lengths: jax.Array  # (P, W)
    done: jax.Array  # (P,) bool
    logits: jax.Array  # (P * W, V) next-token logits of each live beam
    positions: jax.Array  # (P * W,)
    cache: KVCache


@dataclasses.dataclass
class Hypothesis:
    tokens: list[int]
    text: str
    score: float  # summed log-probability / length ** length_penalty
    logprob: float  # summed log-probability


def _normalise(logprob, length, penalty):
    return logprob / jnp.maximum(length, 1).astype(jnp.float32) ** penalty


def _beam_step(params, s: BeamState, eos_ids, cfg: ModelConfig, penalty: float, early_stopping: bool):
    p, w, _ = s.tokens.shape
    v = s.logits.shape[-1]
    logp = jax.nn.log_softmax(s.logits, axis=-1).reshape(p, w, v)
    cand = (s.scores[..., None] + logp).reshape(p, w * v)
    top, idx = jax.lax.top_k(cand, 2 * w)  # (P, 2W): enough to keep W live beams after EOS ones leave
    beam, tok = idx // v, idx % v
    # A prompt whose token this step takes its last position ends all its candidates, as EOS would.
    out_of_positions = s.positions.reshape(p, w)[:, 0] + 1 >= cfg.max_seq_len  # (P,)
    ends = jnp.any(tok[..., None] == eos_ids, axis=-1) | out_of_positions[:, None]  # (P, 2W)
    length = s.step + 1

    def gather(x):  # (P, W, ...) rows of the chosen beams
        return jnp.take_along_axis(x, beam.reshape(p, 2 * w, *([1] * (x.ndim - 2))), axis=1)

    cand_tokens = jax.lax.dynamic_update_slice_in_dim(gather(s.tokens), tok[..., None], s.step, axis=2)
    # finished: the best W of the old finished set and this step's ending (EOS or last-position) candidates
    fin_new = jnp.where(ends & ~s.done[:, None], _normalise(top, length, penalty), NEG)
    all_scores = jnp.concatenate([s.fin_scores, fin_new], axis=1)
    keep = jax.lax.top_k(all_scores, w)[1]
    fin_scores = jnp.take_along_axis(all_scores, keep, axis=1)
    fin_tokens = jnp.take_along_axis(jnp.concatenate([s.fin_tokens, cand_tokens], 1), keep[..., None], axis=1)
    all_lengths = jnp.concatenate([s.fin_lengths, jnp.full((p, 2 * w), length)], axis=1)
    fin_lengths = jnp.take_along_axis(all_lengths, keep, axis=1)
    # live: the best W candidates that did not end
    live_scores, live = jax.lax.top_k(jnp.where(ends, NEG, top), w)
    rows = (jnp.arange(p)[:, None] * w + jnp.take_along_axis(beam, live, axis=1)).reshape(-1)
    tokens = jnp.take_along_axis(cand_tokens, live[..., None], axis=1)
    next_tok = jnp.take_along_axis(tok, live, axis=1).reshape(-1)
    cache = s.cache.take_rows(rows)
    logits, cache = model.forward(params, next_tok[:, None], s.positions[:, None], cache, cfg=cfg)
    full = jnp.sum(fin_scores > NEG / 2, axis=1) == w
    if early_stopping:
        done = s.done | full | out_of_positions
    else:  # no live beam can still beat the worst finished hypothesis
        beaten = _normalise(live_scores[:, 0], length, penalty) <= fin_scores[:, -1]
        done = s.done | (full & beaten) | out_of_positions
    return s.replace(
        step=length, tokens=tokens, scores=live_scores, fin_tokens=fin_tokens, fin_scores=fin_scores,
        fin_lengths=fin_lengths, done=done, logits=logits[:, 0], positions=s.positions + 1, cache=cache,
    )  # fmt: skip


def _beam_loop(params, s: BeamState, eos_ids, cfg, penalty, early_stopping, max_new):
    step = functools.partial(_beam_step, eos_ids=eos_ids, cfg=cfg, penalty=penalty, early_stopping=early_stopping)
    room = s.cache.max_len - s.cache.end  # decode steps the cache can hold
    limit = jnp.minimum(max_new, room)
    return jax.lax.while_loop(lambda s: (s.step < limit) & ~jnp.all(s.done), lambda s: step(params, s), s)


_jitted_loop = jax.jit(_beam_loop, static_argnames=("cfg", "penalty", "early_stopping", "max_new"), donate_argnums=1)


def beam_search(
    gen: Generator, prompts, width: int = 4, max_new_tokens: int = 32, length_penalty: float = 1.0,
    early_stopping: bool = False, stop_token_ids: tuple[int, ...] = (),
) -> list[list[Hypothesis]]:  # fmt: skip
    """For each prompt, its `width` hypotheses, best first."""
    if width < 1:
        raise SamplingError(f"width={width} is not allowed: an integer >= 1")
    if max_new_tokens < 1:
        raise SamplingError(f"max_new_tokens={max_new_tokens} is not allowed: an integer >= 1")
    ids = gen.encode_prompts(prompts)
    cfg = gen.cfg
    p = bucket(len(ids), minimum=1)
    t = bucket(max(len(x) for x in ids))
    # Slots for the padded prompts plus every new token, as in Generator: the padding (up to the bucket t)
    # takes slots too, so capping at the context length would leave no room when t reaches it. Positions
    # past the context are not decoded: a prompt's beams end there (see _beam_step).
    cache_len = max(bucket(t + min(max_new_tokens, cfg.max_seq_len)), gen.min_cache_len)
    tokens = np.zeros((p, t), np.int32)
    positions = np.full((p, t), -1, np.int32)
    lengths = np.ones((p,), np.int32)
    for i, x in enumerate(ids):
        tokens[i, : len(x)], positions[i, : len(x)], lengths[i] = x, np.arange(len(x)), len(x)
    rows = np.repeat(np.arange(p, dtype=np.int32), width)
    cache, logits = gen.prefill(tokens, positions, rows, lengths, cache_len)
    scores = np.full((p, width), NEG, np.float32)
    scores[:, 0] = 0.0  # all beams start equal: only the first may expand, or the W beams would coincide
    state = BeamState(
        step=jnp.int32(0), tokens=jnp.zeros((p, width, max_new_tokens), jnp.int32), scores=jnp.asarray(scores),
        fin_tokens=jnp.zeros((p, width, max_new_tokens), jnp.int32), fin_scores=jnp.full((p, width), NEG),
        fin_lengths=jnp.zeros((p, width), jnp.int32), done=jnp.asarray(np.arange(p) >= len(ids)), logits=logits,
        positions=jnp.asarray(np.repeat(lengths, width)), cache=cache,
    )  # fmt: skip
    eos = jnp.asarray([*gen.tokenizer.eos_ids, *stop_token_ids], jnp.int32)
    state = _jitted_loop(gen.params, state, eos, cfg, float(length_penalty), bool(early_stopping), max_new_tokens)
    return _collect(gen, jax.device_get(state), len(ids), width, float(length_penalty))


def _collect(gen: Generator, s: BeamState, n: int, width: int, penalty: float) -> list[list[Hypothesis]]:
    """Finished hypotheses, topped up with the live beams when fewer than `width` finished."""
    out = []
    steps = int(s.step)
    for i in range(n):
        hyps = []
        for j in range(width):
            if s.fin_scores[i, j] > NEG / 2:
                length = int(s.fin_lengths[i, j])
                lp = float(s.fin_scores[i, j]) * max(length, 1) ** penalty
                hyps.append((float(s.fin_scores[i, j]), lp, s.fin_tokens[i, j, :length].tolist()))
        for j in range(width if not s.done[i] else 0):  # a finished prompt's live beams no longer count
            if s.scores[i, j] > NEG / 2:
                score = float(s.scores[i, j]) / max(steps, 1) ** penalty
                hyps.append((score, float(s.scores[i, j]), s.tokens[i, j, :steps].tolist()))
        hyps.sort(key=lambda h: -h[0])
        out.append([Hypothesis(tok, _text(gen, tok), sc, lp) for sc, lp, tok in hyps[:width]])
    return out


def _text(gen: Generator, tokens: list[int]) -> str:
    if tokens and tokens[-1] in gen.tokenizer.eos_ids:
        tokens = tokens[:-1]
    return gen.tokenizer.decode(tokens)
