"""The hardware jaxgen compiles for without having it: named TPU slices and GPU nodes with their peaks.

    target = TARGETS["tpu-v5p-8"]        # 4 chips of TPU v5p (a v5p-8 counts TensorCores: 2 a chip)
    target.chips, target.hbm_bytes, target.peak_flops, target.hbm_bandwidth, target.link_bandwidth

Every peak is the vendor's published figure per chip (dense bfloat16 FLOP/s; HBM bytes/s; the chip's
interconnect bytes/s one way: ICI for TPU, NVLink for GPU), used only by `roofline` to turn a compiler's
counts into an estimate. A TPU slice's `topology` is libtpu's name (`v5p:2x2x1`); a GPU node's is
`slices x hosts x GPUs` for `jax.experimental.topologies`, with the GPU described by a
`GpuTargetConfigProto` text shipped in `specs/` (its source in specs/README.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

SPECS = Path(__file__).resolve().parent / "specs"
CPU = "cpu"  # the fallback: fake CPU devices, XLA:CPU's compiler


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's published figures."""

    kind: str  # what the compiler's devices call it
    platform: str  # "tpu" or "cuda"
    hbm_bytes: float
    peak_flops: float  # dense bfloat16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # interconnect bytes/s one way, per chip (ICI; NVLink)
    spec: str | None = None  # GPU: the GpuTargetConfigProto file in specs/


# Sources: Google Cloud TPU system architecture pages (v5e, v5p, v6e); NVIDIA H100 and H200 datasheets (SXM).
CHIPS = {
    "v5e": Chip("TPU v5 lite", "tpu", 16e9, 197e12, 819e9, 200e9),
    "v5p": Chip("TPU v5", "tpu", 95e9, 459e12, 2765e9, 600e9),
    "v6e": Chip("TPU v6 lite", "tpu", 32e9, 918e12, 1640e9, 448e9),
    "h100": Chip("NVIDIA H100 80GB HBM3", "cuda", 80e9, 989e12, 3.35e12, 450e9, "h100_sxm.txtpb"),
    "h200": Chip("NVIDIA H200 141GB HBM3e", "cuda", 141e9, 989e12, 4.8e12, 450e9, "h200.txtpb"),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """A slice or node: `chips` of `chip` laid out as `topology` (the compiler's own name for it)."""

    name: str
    chip: Chip
    topology: str
    chips: int

    @property
    def platform(self) -> str:
        return self.chip.platform

    def spec_text(self) -> str:
        """A GPU target's GpuTargetConfigProto text."""
        return (SPECS / self.chip.spec).read_text()


def _tpu(generation: str, cores: int, topology: str) -> Target:
    # Cloud TPU names v5p and v4 slices by TensorCores (2 a chip), v5e and v6e by chips
    per_chip = 2 if generation in ("v5p", "v4") else 1
    chips = 1
    for n in topology.split("x"):
        chips *= int(n)
    assert chips * per_chip == cores, (generation, cores, topology)
    return Target(f"tpu-{generation}-{cores}", CHIPS[generation], f"{generation}:{topology}", chips)


def _gpu(kind: str, gpus: int, nodes: int = 1) -> Target:
    name = f"{kind}x{gpus}" + (f"x{nodes}" if nodes > 1 else "")
    return Target(name, CHIPS[kind], f"1x{nodes}x{gpus}", gpus * nodes)


TARGETS = {
    t.name: t
    for t in (
        _tpu("v5e", 4, "2x2"), _tpu("v5e", 8, "2x4"), _tpu("v5e", 256, "16x16"),
        _tpu("v5p", 8, "2x2x1"), _tpu("v5p", 64, "4x4x2"), _tpu("v5p", 256, "4x4x8"),
        _tpu("v6e", 4, "2x2"), _tpu("v6e", 8, "2x4"), _tpu("v6e", 256, "16x16"),
        _gpu("h100", 1), _gpu("h100", 8), _gpu("h100", 8, 4), _gpu("h200", 1), _gpu("h200", 8), _gpu("h200", 8, 4),
    )
}  # fmt: skip


def get(name: str) -> Target:
    """The target called `name`; ValueError naming the known ones otherwise."""
    if name not in TARGETS:
        raise ValueError(f"target {name!r} is not known: one of {', '.join(TARGETS)}")
    return TARGETS[name]
