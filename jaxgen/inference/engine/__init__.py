"""The serving engine (`Engine`): continuous batching over a paged KV cache, as vLLM v1's loop.

core.py     Engine: the public API, the thread and drain; one step is schedule -> execute -> update
runner.py   Runner: the device state and the jitted steps, run to a plan; weight updates, sleep and wake, recovery
lora.py     AdapterControl: LoRA adapters loaded into, updated in and unloaded from the bank's slots

The scheduler (`jaxgen.inference.scheduler`) plans each step and takes its outputs; it is pure Python.
"""

from jaxgen.inference.budget import check_deterministic
from jaxgen.inference.engine.core import Engine, EngineAsleep
from jaxgen.inference.sequence import LIVE, EngineClosed, RequestFailed, Sequence, Status

__all__ = [
    "LIVE",
    "Engine",
    "EngineAsleep",
    "EngineClosed",
    "RequestFailed",
    "Sequence",
    "Status",
    "check_deterministic",
]
