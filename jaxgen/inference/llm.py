"""LLM, the Python front door: load a model once, then generate, stream and score. Start here;
`Generator` (jaxgen.inference.generator) is the static-batch tool beneath it, for a fixed batch run
start to finish and scoring without a serving engine.

    llm = LLM("runs/default", slots=8)  # a run folder or a Hugging Face folder, loaded once
    outs = llm.generate(["def fib(", "import "], SamplingConfig(temperature=0, max_new_tokens=32))
    outs[0].outputs[0].text  # one RequestOutput per prompt, holding its n completions
    for delta in llm.stream("def fib(", SamplingConfig(max_new_tokens=64)):
        print(delta, end="")
    llm.score(["x = "], ["1\n"])
    llm = LLM("runs/default", max_loras=4)  # multi-LoRA serving: adapters loaded at run time, one per request
    llm.load_lora("sql", "adapters/sql")  # a PEFT adapter folder
    llm.generate("SELECT", SamplingConfig(max_new_tokens=16), lora="sql")

As vLLM's `LLM(model).generate(prompts, SamplingParams)`: generation runs on the serving engine
(`jaxgen.inference.engine`), so every prompt is queued at once and decoded with continuous batching;
its compiled programs are kept between calls. The caller's thread drives the engine, one call at a time;
for concurrent clients run the HTTP server (serve.py http) instead.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from jaxgen import model
from jaxgen.config import ConfigError, ModelConfig, ServeConfig
from jaxgen.inference.engine import Engine
from jaxgen.inference.sampling import SamplingConfig, SamplingError, per_prompt
from jaxgen.inference.textstream import TextDeltas
from jaxgen.sharding import make_mesh
from jaxgen.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxgen.inference.engine import Sequence
    from jaxgen.inference.generator import Completion, Generator


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One prompt's results (vLLM's RequestOutput): its token ids and its `n` completions, in sample order."""

    prompt: str | list[int]
    prompt_token_ids: list[int]
    outputs: list[Completion]

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        """Per prompt token, its log-probability (None for the first), with SamplingConfig.prompt_logprobs."""
        return self.outputs[0].prompt_logprobs if self.outputs else None


class LLM:
    """A model loaded once, with a serving engine (and, for `score`, a Generator) on the same params.

    source: a run folder written by train.py (its latest checkpoint), a local Hugging Face model folder,
    or params given with their `cfg` and `tokenizer`. serve: the engine's slots and KV-cache pages;
    keyword arguments override its fields (`LLM(path, slots=8, kv_memory_gb=2)`).
    draft: a smaller model with the same tokenizer that drafts for speculating requests, as a folder
    (`serve.draft` / `LLM(path, draft="runs/tiny")`) or as (params, cfg) in memory.
    """

    def __init__(
        self, source, serve: ServeConfig = ServeConfig(), *, cfg: ModelConfig | None = None,
        tokenizer: Tokenizer | None = None, draft: str | Path | tuple | None = None, **serve_overrides,
    ):  # fmt: skip
        if isinstance(draft, str | Path):
            serve_overrides["draft"] = str(draft)
            draft = None
        self.serve = _serve_config(serve, serve_overrides)  # checked before anything loads
        if not isinstance(source, str | Path) and (cfg is None or tokenizer is None):
            raise ValueError("LLM(params, ...) needs cfg= and tokenizer= (or pass a run or Hugging Face folder)")
        from jaxgen.inference.loading import load_for_serving  # orbax only when a model loads, not on import

        mesh = _serving_mesh(self.serve)
        if not isinstance(source, str | Path):  # onto the engine's devices, wherever the caller's were
            source = _placed(source, cfg, mesh)
        loaded = load_for_serving(source, self.serve, mesh, cfg=cfg, tokenizer=tokenizer, draft=draft)
        # laid out for decoding once here; Engine and Generator take them as they are (idempotent)
        self.params = model.decode_params(loaded.params, self.serve.slots, loaded.cfg)
        self.cfg, self.tokenizer = loaded.cfg, loaded.tokenizer
        self.engine = Engine(self.params, self.cfg, self.tokenizer, self.serve, mesh=mesh if mesh.size > 1 else None,
                             draft=loaded.draft)  # fmt: skip
        self.engine.stats.ready = True  # a program compiled from now on made a generate call wait (/metrics)
        self._generator: Generator | None = None

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling: SamplingConfig | list[SamplingConfig] = SamplingConfig(),
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt (a single prompt is a list of one), in the order given.

        `sampling` is one config for every prompt or one per prompt; `lora` the LoRA adapter (`load_lora`) of
        every prompt or one per prompt (None: the base model). All are queued at once and run together until
        done. A request the engine can never run raises SamplingError / PageError (LoraNotFound for an
        adapter not loaded), and none of this call's requests stays queued.
        """
        prompts = _as_list(prompts)
        configs = per_prompt(sampling, len(prompts))
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise SamplingError(f"{len(loras)} adapters in lora for {len(prompts)} prompts: one each, or one for all",
                                "lora")  # fmt: skip
        groups = self._submit_all(prompts, configs, loras)
        self._run(r for group in groups for r in group)
        return [RequestOutput(p, g[0].prompt, [r.result() for r in g]) for p, g in zip(prompts, groups, strict=True)]

    def load_lora(self, name: str, source, scale: float | None = None) -> None:
        """Loads a LoRA adapter as `name` (needs `max_loras` > 0): `source` a PEFT adapter folder, or adapters in
        `jaxgen.model.lora`'s layout with their `scale` (alpha / rank). Nothing recompiles (`Engine.load_lora`)."""
        if isinstance(source, str | Path):
            self.engine.load_lora_folder(name, source)
        else:
            self.engine.load_lora(name, source, 1.0 if scale is None else scale)

    def update_lora(self, name: str, adapters: dict, scale: float = 1.0) -> None:
        """New weights for the loaded adapter `name`, written into its slot in place (`Engine.update_lora`): the
        LoRA-only swap of reinforcement learning, no recompilation, the base weights untouched."""
        self.engine.update_lora(name, adapters, scale)

    def unload_lora(self, name: str) -> None:
        """Unloads an adapter: new requests cannot name it, those using it finish (`Engine.unload_lora`)."""
        self.engine.unload_lora(name)

    def stream(self, prompt: str | list[int], sampling: SamplingConfig = SamplingConfig(), *,
               lora: str | None = None) -> Iterator[str]:  # fmt: skip
        """Yields text deltas of one completion (n=1) as they are decoded; joined, they are its exact text.

        The request is checked and queued by this call (errors are raised here, not at the first delta).
        Deltas never end inside a UTF-8 character or a possible stop string (`TextDeltas`). The iterator's
        return value (StopIteration.value) is the Completion. Closing the iterator early cancels the request.
        """
        if sampling.n != 1:
            raise SamplingError(f"n={sampling.n} is not allowed in stream: 1 (use generate for n samples)", "n")
        hold = max((len(s) for s in sampling.stop), default=1) - 1
        deltas = TextDeltas(self.tokenizer, hold)
        pending: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # None: the sequence ended

        def on_update(request: Sequence) -> None:  # during engine.step(), or on the engine's thread
            final = bool(request.finish_reason)
            delta = deltas.update(request.text, final=final)
            if delta:
                pending.put(delta)
            if final:
                pending.put(None)

        (request,) = self.engine.submit(prompt, sampling, on_update=on_update, lora=lora)
        return self._deltas(request, pending)

    def _deltas(self, request: Sequence, pending: queue.SimpleQueue) -> Iterator[str]:
        try:
            while True:
                if pending.empty() and not self.engine.running and not self.engine.idle():
                    self.engine.step()  # the caller's thread drives the engine
                    continue
                if pending.empty() and not self.engine.running:
                    break  # idle without a final update: nothing more will come
                delta = pending.get()
                if delta is None:
                    break
                yield delta
            return request.result()  # RequestFailed if the engine failed it
        finally:
            if not request.done_event.is_set():  # the caller stopped early: free the slot
                self.engine.cancel(request)

    def update_params(self, params) -> None:
        """New weights for every later call, without recompiling (`Engine.update_params`: sequences in
        flight are recomputed on them, the prefix cache emptied): a pytree of the loaded model's structure
        (training or decode layout), or a run or Hugging Face folder of the same model (held and quantized
        as `serve` says)."""
        loaded = isinstance(params, str | Path)
        if loaded:
            from jaxgen.inference.loading import load_weights

            params = load_weights(params, self.serve, self.cfg)
        elif self.serve.quantize == "int8":
            from jaxgen.model import quant

            params = quant.quantize_params(params, embedding=self.serve.quantize_embedding)
        self.engine.update_params(params, donate=loaded)  # weights read here are the engine's alone
        self.params = self.engine.params
        self._generator = None  # score() builds its Generator again, on these weights

    def sleep(self) -> None:
        """Frees the engine's KV cache until `wake_up()` (`Engine.sleep`)."""
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def score(self, prompts: list[str | list[int]], continuations: list[str | list[int]],
              lora: str | None = None) -> list[dict]:  # fmt: skip
        """Teacher-forced log-likelihood of each continuation given its prompt (`Generator.score`'s dicts).
        `lora`: a loaded adapter (`load_lora`) to score with, on the engine (its prompt log-probabilities,
        every pair queued at once); None: the base model, on a Generator."""
        if lora is not None:
            return self._score_with_adapter(prompts, continuations, lora)
        if self._generator is None:
            from jaxgen.inference.generator import Generator

            self._generator = Generator(self.params, self.cfg, self.tokenizer)
        return self._generator.score(prompts, continuations)

    def _score_with_adapter(self, prompts, continuations, lora: str) -> list[dict]:
        """`score` under adapter `lora`: each pair's tokens as a prompt with max_new_tokens=0, its prompt
        log-probabilities (and the top one, for `greedy`) read from the continuation's positions."""
        from jaxgen.inference.scoring import score_dict, token_pairs

        pairs = token_pairs(self.tokenizer, self.cfg, prompts, continuations)
        outs = self.generate([p + c for p, c in pairs], SamplingConfig(max_new_tokens=0, prompt_logprobs=1), lora)
        results = []
        for (p, _), out in zip(pairs, outs, strict=True):
            lps, tops = out.outputs[0].prompt_logprobs[len(p) :], out.outputs[0].prompt_top_logprobs[len(p) :]
            greedy = all(lp >= max(top.values()) for lp, top in zip(lps, tops, strict=True))
            results.append(score_dict(lps, greedy))
        return results

    def _submit_all(self, prompts, configs, loras) -> list[list[Sequence]]:
        groups: list[list[Sequence]] = []
        try:
            for i, (p, c, a) in enumerate(zip(prompts, configs, loras, strict=True)):
                groups.append(self.engine.submit(p, c, prompt_index=i, lora=a))
        except BaseException:  # one bad request: none of this call's requests stays queued
            for r in (r for group in groups for r in group):
                self.engine.cancel(r)
            raise
        return groups

    def _run(self, requests) -> None:
        """Until every request is done: steps the engine here, or waits when its own thread runs it."""
        if not self.engine.running:
            self.engine.run_until_idle()
        for r in requests:
            r.done_event.wait()


def _as_list(prompts) -> list:
    """A single prompt (text, or token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str) or (isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _serving_mesh(serve: ServeConfig):
    """The engine's devices, as serve.py picks them: serve.data_parallel x serve.tensor_parallel of this
    process's devices (by default one). Not the training default (every device on data), which would
    run the engine, and hold its page pool, once on each device."""
    return make_mesh(serve.mesh, jax.local_devices())


def _placed(params, cfg: ModelConfig, mesh):
    """Params handed in, moved onto the engine's mesh (one device: onto it whole)."""
    if mesh.size == 1:
        return jax.device_put(params, mesh.devices.flat[0])
    return jax.device_put(params, model.param_shardings(cfg, mesh))


def _serve_config(serve: ServeConfig, overrides: dict) -> ServeConfig:
    fields = [f.name for f in dataclasses.fields(ServeConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"unknown serve setting {unknown[0]}; allowed: {', '.join(fields)}")
    return dataclasses.replace(serve, **overrides)
