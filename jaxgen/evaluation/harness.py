"""jaxgen as an lm-evaluation-harness model: `lm_eval`'s `LM` interface over Generator and Engine, in-process.

    from jaxgen.evaluation.harness import JaxgenLM
    import lm_eval
    lm = JaxgenLM(checkpoint="runs/tiny")             # a run folder or a Hugging Face model folder
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

Registered as the model "jaxgen" when this module is imported (`python -m jaxgen.evaluation --model jaxgen
--model_args checkpoint=DIR ...` does that, then runs lm-eval's command line).

- `loglikelihood` (every multiple-choice task): the context and continuation are tokenized as lm-eval's
  other causal models do (`TemplateLM`: the whole string encoded, the context's tokens split off), then
  scored in batches by `Generator.score_shared`: each distinct context runs once into a KV cache and its
  choices read it (a four-way question costs one context and four endings, not four of each); sorted by
  length so that a batch pads little.
- `loglikelihood_rolling` (perplexity tasks): lm-eval's rolling windows of the context length, scored the same way.
- `generate_until`: every request queued at once on the continuous-batching `Engine` (greedy unless the
  task asks `do_sample`), `until` as stop strings.
"""

from __future__ import annotations

import logging

import lm_eval.models  # noqa: F401  lm-eval's own models first: it loads them only into an empty registry
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from jaxgen.config import ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.generator import Generator
from jaxgen.inference.sampling import MAX_STOP_STRINGS, SamplingConfig

log = logging.getLogger(__name__)


@register_model("jaxgen")
class JaxgenLM(TemplateLM):
    """lm-eval's model interface on a jaxgen checkpoint. Arguments (also as `--model_args k=v,...`):
    checkpoint (a run folder or an HF folder), batch_size (rows scored together), max_gen_toks (the
    default generation length), slots (the engine's decode slots), kv_memory_gb (its page pool)."""

    def __init__(
        self, checkpoint: str | None = None, batch_size: int | str = 32, max_gen_toks: int = 256, slots: int = 16,
        kv_memory_gb: float = 1.0, *, model=None, **unused,
    ):  # fmt: skip
        super().__init__()
        if unused:
            log.warning("JaxgenLM ignores these arguments: %s", ", ".join(sorted(unused)))
        if model is None:
            if checkpoint is None:
                raise ValueError("JaxgenLM needs checkpoint=DIR (a jaxgen run folder or a Hugging Face model folder)")
            from jaxgen.inference.loading import load_model

            model = load_model(checkpoint)
        self.cfg, self.tok, self.params = model  # (ModelConfig, Tokenizer, params), as load_model returns
        self.batch_size = 32 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.gen = Generator(self.params, self.cfg, self.tok, max_batch=self.batch_size)
        self._serve = ServeConfig(slots=int(slots), kv_memory_gb=float(kv_memory_gb))
        self._engine: Engine | None = None  # built on the first generation request (its programs compile then)

    # --- tokenization, as lm-eval's TemplateLM asks --------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, special=bool(add_special_tokens))

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    @property
    def tokenizer_name(self) -> str:
        return "jaxgen-" + str(self.tok.vocab_size)

    # --- scoring -----------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation) per request of
        (key, context ids, continuation ids); the context is cut from the left to fit the model's context."""
        pairs = [self._fit(ctx, cont) for _, ctx, cont in requests]
        # a context's choices side by side (they share its cache), similar lengths in a batch
        order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), pairs[i][0], len(pairs[i][1])))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        bar = tqdm(total=len(pairs), desc="jaxgen loglikelihood", disable=disable_tqdm)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            scores = self.gen.score_shared([pairs[i][0] for i in batch], [pairs[i][1] for i in batch])
            for i, s in zip(batch, scores, strict=True):
                out[i] = (s["logprob"], s["greedy"])
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
            bar.update(len(batch))
        bar.close()
        return out

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        if not cont:
            raise ValueError("lm-eval asked for the log-likelihood of an empty continuation")
        if len(cont) >= self.max_length:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit the context of {self.max_length}")
        ctx = ctx[-(self.max_length - len(cont)) :] if len(ctx) + len(cont) > self.max_length else ctx
        return (ctx or [self.prefix_token_id]), cont

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's whole log-likelihood, over lm-eval's rolling windows of the model's context."""
        out = []
        for (string,) in tqdm([r.args for r in requests], desc="jaxgen rolling", disable=disable_tqdm):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1, context_len=1,
            )  # fmt: skip
            pieces = [(None, *make_disjoint_window(w)) for w in windows]
            total = sum(lp for lp, _ in self._loglikelihood_tokens(pieces, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # --- generation --------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request queued on the engine at once (continuous batching), answers in order."""
        if self._engine is None:
            self._engine = Engine(self.params, self.cfg, self.tok, self._serve)
        prompts, configs = [], []
        for context, gen_kwargs in (r.args for r in requests):
            c = self._sampling(dict(gen_kwargs))
            ids = self.tok_encode(context) or [self.prefix_token_id]
            room = self.max_length - min(c.max_new_tokens, self.max_length // 2)  # cut the context from the left
            prompts.append(ids[-room:])
            configs.append(c)
        results = self._engine.generate(prompts, configs)
        for r, c in zip(requests, results, strict=True):
            self.cache_hook.add_partial("generate_until", r.args, c.text)
        return [c.text for c in results]

    def _sampling(self, kw: dict) -> SamplingConfig:
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        do_sample = kw.pop("do_sample", False)
        temperature = float(kw.pop("temperature", 0.0)) if do_sample else 0.0
        c = SamplingConfig(
            max_new_tokens=int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks))),
            temperature=temperature, top_p=float(kw.pop("top_p", 1.0)), top_k=int(kw.pop("top_k", 0)),
            seed=int(kw.pop("seed", 0)), stop=tuple(until[:MAX_STOP_STRINGS]),
        )  # fmt: skip
        if kw:
            log.warning("JaxgenLM ignores these generation arguments: %s", ", ".join(sorted(kw)))
        return c
