"""Where a run or an engine runs: the device mesh and joining other processes."""

from __future__ import annotations

import dataclasses
import math

from jaxgen.config.base import check


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; -1 takes all remaining devices. Default: all devices on `data`.

    `context` splits every sequence's tokens over devices (context parallelism: `model.attention_impl`
    ring or allgather); the mesh has that axis only when it is above 1, so the default mesh is
    (data, fsdp, tensor) as before."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1  # a positive size: -1 is for the other axes

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        check(
            all(s == -1 or s > 0 for s in sizes) and sizes.count(-1) <= 1,
            "mesh",
            dict(data=self.data, fsdp=self.fsdp, tensor=self.tensor),
            "positive sizes, with at most one -1 (all remaining devices)",
        )
        check(isinstance(self.context, int) and self.context > 0, "mesh.context", self.context, "a positive integer")

    def shape(self, num_devices: int) -> tuple[int, ...]:
        """Mesh shape on `num_devices` devices, in the order of `axes()`; fully given sizes may use fewer
        (the first ones)."""
        sizes = [self.data, self.fsdp] + ([self.context] if self.context > 1 else []) + [self.tensor]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            check(num_devices % fixed == 0, "mesh", sizes, f"sizes whose product divides {num_devices} devices")
            sizes[sizes.index(-1)] = num_devices // fixed
        check(math.prod(sizes) <= num_devices, "mesh", sizes, f"at most {num_devices} devices in all")
        return tuple(sizes)

    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names, in device order (tensor innermost, then context: the busiest links)."""
        return ("data", "fsdp") + (("context",) if self.context > 1 else ()) + ("tensor",)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Running as one of several processes (`jaxgen.distributed`); the defaults detect it from the environment."""

    coordinator: str | None = None  # HOST:PORT of process 0; auto = JAX's detection; None = the environment
    num_processes: int = 1
    process_id: int = 0
    heartbeat_timeout_s: int = 60  # a process silent this long is taken as dead and every process stops
    init_timeout_s: int = 300  # how long to wait for all processes to join

    def __post_init__(self):
        for name in ("num_processes", "heartbeat_timeout_s", "init_timeout_s"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"distributed.{name}", value, "a positive integer")
