"""Training: the jitted train step, the run loop, checkpoints, metrics and the data pipeline.

step.py        TrainState, the optimizer, the teacher-forced loss, the jitted train and eval steps
loss.py        the LM head and cross-entropy in chunks, gradient formed on the way (no whole logits)
trainer.py     train(cfg, run_dir): data, evaluation, checkpoints, metrics, signals, resume
checkpoint.py  orbax checkpoints with fallback past damaged ones; load_run / load_model
metrics.py     metrics.jsonl, TensorBoard, the loss plot, the matmul-rate measurement
data/          corpus sources, the token store, packing and the grain iterators
"""

from jaxgen.training.checkpoint import load_model, load_run
from jaxgen.training.trainer import TrainResult, train

__all__ = ["TrainResult", "load_model", "load_run", "train"]
