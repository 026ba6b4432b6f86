"""What a training run reads: the data, the optimizer, the run's length and rhythm, its checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxgen.config.base import check, check_literals


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # chat: JSONL `messages`, loss on the assistant; preference: JSONL prompt, chosen, rejected (preference tuning)
    source: Literal["stdlib", "files", "jsonl", "chat", "preference"] = "stdlib"
    paths: tuple[str, ...] = ()  # globs, for files, jsonl, chat and preference
    text_field: str = "text"
    prompt_field: str | None = None  # jsonl fine-tuning: loss only on the response
    response_field: str | None = None
    tokenizer: str = "byte"  # "byte", "byte-chat" (with a chat template), a tokenizer.json or a folder with one
    seq_len: int = 128  # T: tokens per training sequence
    eval_fraction: float = 0.02  # share of documents held out
    eval_batches: int = 4
    cache_dir: str = "~/.cache/jaxgen/tokens"
    seed: int = 0

    def __post_init__(self):
        check_literals(self, "data")
        check(self.seq_len > 0, "data.seq_len", self.seq_len, "a positive integer")
        check(0 < self.eval_fraction < 1, "data.eval_fraction", self.eval_fraction, "a number in (0, 1)")
        if self.source != "stdlib":
            check(bool(self.paths), "data.paths", self.paths, f"at least one glob for source={self.source}")
        check(
            (self.prompt_field is None) == (self.response_field is None),
            "data.prompt_field",
            self.prompt_field,
            "set together with data.response_field",
        )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 1e-3  # peak, reached after warmup
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables

    def __post_init__(self):
        check(self.learning_rate > 0, "optimizer.learning_rate", self.learning_rate, "a number > 0")
        check(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        check(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "an integer >= 0")
        check(self.grad_clip >= 0, "optimizer.grad_clip", self.grad_clip, "a number >= 0 (0 disables)")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            check(0 <= value < 1, f"optimizer.{name}", value, "a number in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    steps: int = 200  # total optimizer steps of the run
    batch_size: int = 8  # sequences per optimizer step (global, all devices)
    grad_accum: int = 1  # micro-batches per step; batch_size must divide by it
    # under grad_accum on an fsdp mesh: False, each micro-batch's gradient is reduce-scattered onto the weights'
    # fsdp shards (ZeRO-3: nothing whole is held); True, the weights are gathered (in model.dtype) once a step
    # and every device sums its own rows' whole gradient, reduced over fsdp once a step (ZeRO-1's trade: a
    # float32 gradient and the gathered weights on every device, one reduction a step). Data replicas sum
    # once a step either way (jaxgen.training.step._accumulate_grads)
    accumulate_whole: bool = False
    eval_every: int = 50
    log_every: int = 10
    seed: int = 0
    max_nonfinite_in_row: int = 5  # stop after this many skipped (non-finite) updates in a row
    steps_per_run: int = 0  # stop this invocation after N steps (time-sliced jobs); 0 = run to the end
    peak_flops: float = 0.0  # for MFU; 0 = measure the matmul rate of this machine at start
    loss_chunk: int = 1024  # tokens of each row per step of the LM head and loss (jaxgen.training.loss): the
    #   (B, T, V) logits are never whole; 0 = all at once
    # Fine-tuning: a local Hugging Face model folder. Its config.json replaces the `model` section (all
    # but model.dtype), its tokenizer replaces data.tokenizer, and its weights are the starting point.
    init_from: str | None = None
    # sft: next-token cross-entropy; dpo, ipo, simpo: preference tuning on data.source=preference pairs
    # (jaxgen.training.preference, its settings in the `preference` section)
    objective: Literal["sft", "dpo", "ipo", "simpo"] = "sft"

    def __post_init__(self):
        check_literals(self, "training")
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "log_every", "max_nonfinite_in_row"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"training.{name}", value, "a positive integer")
        check(
            self.batch_size % self.grad_accum == 0,
            "training.grad_accum",
            self.grad_accum,
            f"a divisor of training.batch_size={self.batch_size}",
        )
        check(self.steps_per_run >= 0, "training.steps_per_run", self.steps_per_run, "an integer >= 0")
        check(self.loss_chunk >= 0, "training.loss_chunk", self.loss_chunk, "an integer >= 0 (0 = no chunks)")
        check(isinstance(self.accumulate_whole, bool), "training.accumulate_whole", self.accumulate_whole,
              "true or false")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every N steps (also at the end and on SIGTERM / Ctrl-C)
    keep: int = 3  # keep the last K checkpoints

    def __post_init__(self):
        check(self.every > 0, "checkpoint.every", self.every, "a positive integer")
        check(self.keep > 0, "checkpoint.keep", self.keep, "a positive integer")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning's settings (training.objective dpo, ipo or simpo; jaxgen.training.preference)."""

    beta: float = 0.1  # dpo: the sigmoid's scale; ipo: the target margin is 1 / (2 beta); simpo: ~2 (SimPO's)
    label_smoothing: float = 0.0  # dpo and simpo: the share of pairs taken to be mislabelled (conservative DPO)
    simpo_gamma: float = 0.5  # simpo: the target reward margin

    def __post_init__(self):
        check(self.beta > 0 and self.beta < float("inf"), "preference.beta", self.beta, "a finite number > 0")
        smoothing = self.label_smoothing
        check(0 <= smoothing < 0.5, "preference.label_smoothing", smoothing, "a number in [0, 0.5)")
        check(abs(self.simpo_gamma) < float("inf"), "preference.simpo_gamma", self.simpo_gamma, "a finite number")


@dataclasses.dataclass(frozen=True)
class DraftHeadConfig:
    """A draft head for speculative decoding, trained for a frozen target (`draft.target` set: train.py
    trains the head, `jaxgen.training.eagle`, not the model)."""

    kind: Literal["eagle3"] = (
        "eagle3"  # EAGLE-3: one decoder layer on three of the target's layers (jaxgen.model.eagle)
    )
    target: str = ""  # the frozen target: a jaxgen run folder or a local Hugging Face folder; "" = no head
    layers: tuple[int, ...] = ()  # the target layers tapped (their input; num_layers = the last output); () = default
    vocab_size: int = 0  # the draft vocabulary: the most frequent tokens of the training data; 0 = the target's
    unroll: int = 3  # k: draft steps unrolled in training (EAGLE-3's training-time test), each fed its own features
    data: Literal["corpus", "generations"] = "corpus"  # what the head learns on: the training data, or the
    #   target's own greedy continuations of the training data's prompts (made once, kept in the run folder)
    generations: int = 512  # data=generations: sequences the target writes (each data.seq_len tokens)

    def __post_init__(self):
        check_literals(self, "draft")
        check(self.vocab_size >= 0, "draft.vocab_size", self.vocab_size, "an integer >= 0 (0 = the target's)")
        check(isinstance(self.unroll, int) and 1 <= self.unroll <= 8, "draft.unroll", self.unroll, "1..8")
        check(len(self.layers) in (0, 3) and all(isinstance(i, int) and i >= 0 for i in self.layers),
              "draft.layers", self.layers, "three layer indices >= 0, or [] (the default)")  # fmt: skip
        check(self.generations > 0, "draft.generations", self.generations, "a positive integer")
