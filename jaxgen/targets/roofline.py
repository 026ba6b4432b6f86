"""From a compiler's counts to an estimated step time: flops, HBM bytes and collective bytes per device.

    costs = costs_of(compiled)                         # per device, what the compiler's cost model counts
    est = estimate(costs, target.chip)                 # seconds if compute, memory or network bound
    est.seconds, est.bound

An estimate, never a measurement: it assumes each part runs at the chip's published peak (`catalog`)
and that the three overlap perfectly (the step takes as long as the slowest), so it is a lower bound on
the step time of this program on that chip. The flops are the target compiler's own
(`compiled.cost_analysis()`); the HBM bytes its "bytes accessed" on XLA:CPU, counted from the optimised
HLO by memory space on TPU, and both counted from the HLO on XLA:GPU without a GPU, which gives no analysis
(`hlo.hlo_counts`; `costs_of` says why); for the network, the bytes of every collective in the optimised
HLO (`collective_bytes`).

XLA's cost analysis counts the body of a loop once, whatever its trip count: a program whose layers run
in a `lax.scan` (training) is counted from compiles with the layers unrolled at two depths and
extrapolated along the line through them (`along_depth`), as `plan.by_depth` does for memory.
"""

from __future__ import annotations

import dataclasses
import re

from jaxgen.targets import hlo
from jaxgen.targets.catalog import Chip

# bytes a device sends per byte of the collective's result (ring algorithms, large groups): an
# all-reduce is a reduce-scatter then an all-gather
_SENT_PER_BYTE = {
    "all-gather": 1.0, "all-reduce": 2.0, "reduce-scatter": 1.0, "all-to-all": 1.0, "collective-permute": 1.0,
}  # fmt: skip
_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(_SENT_PER_BYTE) + r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-device counts of one program: `flops`, HBM `bytes` accessed, `collectives` (bytes each device
    sends, by collective kind), and `kernels`: the custom calls it makes (Mosaic TPU kernels are
    "tpu_custom_call", cuDNN's attention "__cudnn$fmha...", Triton-lowered Pallas "__gpu$xla.gpu.triton"),
    by target, with their counts; `int8_products`: its matrix products of int8 by int8 (`hlo.int8_products`)."""

    flops: float
    bytes: float
    collectives: dict = dataclasses.field(default_factory=dict)
    kernels: dict = dataclasses.field(default_factory=dict)
    int8_products: int = 0

    @property
    def network(self) -> float:
        return float(sum(self.collectives.values()))

    def scaled(self, k: float) -> Costs:
        collectives = {n: b * k for n, b in self.collectives.items()}
        return Costs(self.flops * k, self.bytes * k, collectives, self.kernels, self.int8_products)


def costs_of(compiled) -> Costs:
    """The counts of a compiled program (`jax.stages.Compiled`), per device: the compiler's flops, and its
    HBM bytes. XLA:GPU without a GPU has no cost analysis: both are counted from its optimised HLO. The TPU
    compiler's "bytes accessed" counts every operand and result wherever it lives: a weight its memory-space
    assignment prefetches into on-chip memory counts as read from HBM, written, and read again; so on TPU
    the HBM bytes are counted from the HLO too, by memory space (`hlo.hlo_counts`)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis  # older jax: one dict per program
    text = compiled.as_text()
    if analysis is None:  # XLA:GPU compiling without a GPU has none: count from the HLO's kernels
        flops, accessed = hlo.hlo_counts(text)
    else:
        flops, accessed = float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))
        if _platform(compiled) == "tpu":
            accessed = hlo.hlo_counts(text, memory_spaces=True)[1]
    return Costs(flops, accessed, collective_bytes(text), custom_calls(text), hlo.int8_products(text))


def _platform(compiled) -> str:
    """The platform a compiled program's devices are ("tpu", "gpu", "cpu"); "" when it names none."""
    import jax

    shardings = jax.tree.leaves((compiled.output_shardings, compiled.input_shardings))
    return next(iter(shardings[0].device_set)).platform if shardings else ""


def custom_calls(hlo_text: str) -> dict[str, int]:
    """How many custom calls of each target optimised HLO text makes."""
    out: dict[str, int] = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
        out[target] = out.get(target, 0) + 1
    return out


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """Bytes each device sends per collective kind in optimised HLO text: the result's bytes (for a
    reduce-scatter the operand's, about the result's times the group) times `_SENT_PER_BYTE`. Async pairs
    count once (their `-start`); a collective inside a loop body counts once (see the module docstring)."""
    out: dict[str, float] = {}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        shape, kind = match.groups()
        if kind != "all-reduce" and shape.startswith("(") and line.split(" = ", 1)[1].find("-start(") > 0:
            shape = "{}[{}]".format(*hlo.ARRAY.findall(shape)[-1])  # an async start's (operand, result): the result
        size = hlo.shape_bytes(shape)
        if kind == "reduce-scatter":
            size *= _group_size(line)
        out[kind] = out.get(kind, 0.0) + size * _SENT_PER_BYTE[kind]
    return out


def _group_size(line: str) -> int:
    groups = re.search(r"replica_groups=\{\{([\d,]+)\}", line) or re.search(r"replica_groups=\[\d+,(\d+)\]", line)
    if not groups:
        return 1
    text = groups.group(1)
    return len(text.split(",")) if "," in text else int(text)


def along_depth(one: Costs, two: Costs, depth: int) -> Costs:
    """The counts of a `depth`-layer program from those at 1 and 2 layers (layers alike)."""
    return along(one, two, lambda a, b: a + (b - a) * (depth - 1))


def along(lo: Costs, hi: Costs, line) -> Costs:
    """Every count of `lo` and `hi` (two depths) taken along `line(lo_value, hi_value)`; kernels as `hi`'s."""
    kinds = set(lo.collectives) | set(hi.collectives)
    pick = lambda c, k: c.collectives.get(k, 0.0)
    collectives = {k: line(pick(lo, k), pick(hi, k)) for k in kinds}
    int8 = round(line(lo.int8_products, hi.int8_products))
    return Costs(line(lo.flops, hi.flops), line(lo.bytes, hi.bytes), collectives, hi.kernels, int8)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds a program takes on one chip if bound by compute, by HBM traffic, by the interconnect."""

    compute: float
    memory: float
    network: float

    @property
    def seconds(self) -> float:
        return max(self.compute, self.memory, self.network)

    @property
    def bound(self) -> str:
        return max(("compute", self.compute), ("memory", self.memory), ("network", self.network), key=lambda x: x[1])[0]


def estimate(costs: Costs, chip: Chip) -> Estimate:
    """Per-device `costs` at `chip`'s peaks (dense bf16 FLOP/s, HBM bytes/s, interconnect bytes/s)."""
    return Estimate(
        costs.flops / chip.peak_flops, costs.bytes / chip.hbm_bandwidth, costs.network / chip.link_bandwidth
    )
