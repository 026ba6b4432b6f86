"""Training: the jitted train step, the run loop, checkpoints, metrics and the data pipeline.

step.py        TrainState, the optimizer, the teacher-forced loss, the jitted train and eval steps
loss.py        the LM head and cross-entropy in chunks, gradient formed on the way (no whole logits)
preference.py  preference tuning: DPO, IPO, SimPO as a table of objectives, their jitted step
reference.py   preference tuning's frozen reference, scored once and cached beside the data
trainer.py     train(cfg, run_dir): data, evaluation, checkpoints, metrics, signals, resume
eagle.py       train_head(cfg, run_dir): an EAGLE-3 draft head for a frozen target (draft.target), load_head
checkpoint.py  orbax checkpoints with fallback past damaged ones (loading for inference: jaxgen.inference.loading)
metrics.py     metrics.jsonl, TensorBoard, the loss plot, the matmul-rate measurement
data/          corpus sources, the token store, packing and the grain iterators

`train` and `TrainResult` are imported on first use, so that the checkpoint reader alone (which
`jaxgen.inference.loading` needs) brings no trainer, data pipeline or optimizer with it.
"""

__all__ = ["TrainResult", "train"]


def __getattr__(name: str):
    if name in __all__:
        from jaxgen.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'jaxgen.training' has no attribute {name!r}")
