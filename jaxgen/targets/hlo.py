"""Reading XLA's optimised HLO text: its computations, the operations a computation launches, and (where
a compiler gives no cost analysis: XLA:GPU without a GPU) the flops and bytes its kernels move.

    comps = computations(text)        # {name: instruction lines}, the entry one also as "ENTRY"
    ops(comps, "ENTRY")               # launches by opcode
    hlo_counts(text)                  # (flops, HBM bytes accessed) counted from the kernels' shapes
    int8_products(text)               # matrix products of int8 by int8
    collective_axes(comps, name, mesh)  # the mesh axes each collective of a computation runs across
"""

from __future__ import annotations

import collections
import re

# Instructions that launch nothing: they name buffers, pieces of tuples or views of them.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")


_SHAPED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}  # fmt: skip
_CONTROL = {"while", "conditional", "call", "async-start", "async-done"}


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Optimised HLO text as {computation name: its instruction lines}; the entry one also under "ENTRY"."""
    out, name = {}, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            name = header.group(1)
            out[name] = []
            if line.startswith("ENTRY"):
                out["ENTRY"] = out[name]
        elif line.strip() == "}":
            name = None
        elif name is not None and _INSTRUCTION.match(line):
            out[name].append(line)
    return out


def ops(comps: dict[str, list[str]], name: str) -> collections.Counter:
    """The operations computation `name` runs, by opcode: one each (a fusion is one kernel, a cuBLAS
    call one custom-call, a conditional or a nested while one launch of their own), free ones (`FREE`)
    left out, and the computations a `call` runs (XLA:GPU's command buffers) counted in its place."""
    counts = collections.Counter()
    for line in comps[name]:
        op = _INSTRUCTION.match(line).group(1)
        if op == "call":
            counts += ops(comps, re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
        elif op not in FREE:
            counts[op] += 1
    return counts


def int8_products(hlo_text: str) -> int:
    """How many matrix products multiply int8 by int8, with int32 sums: a `dot` (or `convolution`, as the
    TPU compiler writes one) of two int8 operands, or an int32 `reduce` the compiler made of a product
    (metadata `dot_general`: a product of one row, which XLA computes as a multiply and a sum). The products a
    compiler kept in int8, not converted to float first."""
    shapes, products, sums = {}, [], 0
    for name, shape, op, rest, _ in _instructions(hlo_text.splitlines()):
        shapes[name] = shape
        if op in ("dot", "convolution"):
            products.append(_operand_names(rest))
        sums += op == "reduce" and shape.startswith("s32[") and '/dot_general"' in rest
    int8 = lambda name: shapes.get(name, "").startswith("s8[")
    return sums + sum(bool(names) and all(map(int8, names)) for names in products)


def _operands(rest: str) -> str:
    """The operand list of an instruction, from the text after its opening parenthesis to the matching one
    (operands may carry shapes with parenthesised layouts, e.g. {1,0:T(8,128)(2,1)})."""
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return rest[:i]
    return rest


def _instructions(lines):
    """(name, shape, opcode, the text after the opcode's parenthesis, whether it is the ROOT) of each
    instruction among HLO text `lines`."""
    for line in lines:
        if found := _SHAPED.match(line):
            yield (*found.groups(), line.lstrip().startswith("ROOT"))


def _operand_names(rest: str) -> list[str]:
    """The names of an instruction's operands (each "%x", or "s8[4]{0:T(8)} %x" with its shape)."""
    return re.findall(r"%([\w.\-]+)", _operands(rest))


def shape_bytes(shape_text: str) -> float:
    """Bytes of an HLO shape (an array or a tuple of them), e.g. "(f32[4,64]{1,0}, bf16[8])"."""
    return float(sum(DTYPE_BYTES.get(dtype, 4) * _prod(dims) for dtype, dims in ARRAY.findall(shape_text)))


def dims_of(shape_text: str) -> list[int]:
    found = ARRAY.search(shape_text)
    return [int(d) for d in filter(None, found.group(2).split(","))] if found else []


def _prod(dims) -> int:
    n = 1
    for d in dims.split(",") if isinstance(dims, str) else dims:
        if d != "":
            n *= int(d)
    return n


def hlo_counts(hlo_text: str, memory_spaces: bool = False) -> tuple[float, float]:
    """(flops, HBM bytes accessed) of one run of a program from its optimised HLO: the flops of every `dot`
    (2 x the result's elements x the contracted size; a cuBLAS gemm call likewise), and for every kernel
    of a computation that is not fused into another, the bytes of its operands and result (an operand a
    fusion only slices or gathers from, what it takes). An unfused in-place `dynamic-update-slice` (a cache
    write) moves its update only, as XLA's own cost analysis counts it. `memory_spaces` (TPU): arrays that
    the compiler's memory-space assignment put in on-chip memory (`S(1)`, `S(2)` in their layout) are not
    HBM traffic; a `copy-start` or `slice-start` into them reads what it moves from HBM once, and kernels
    reading the copy read on-chip memory. Each computation counts once (a loop's body once, whatever its
    trip count: compile layers unrolled). A fusion whose root updates a parameter in place (a cache write
    fused with what computes the new entry, `_updated_in_place`) likewise writes its update, not the buffer."""
    comps = computations(hlo_text)
    # computations inside a kernel: a fusion's, a reduction's or a sort's (not a `call`'s: command buffers)
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo_text))
    for line in hlo_text.splitlines():
        if " call(" not in line:
            fused.update(re.findall(r"to_apply=%?([\w.\-]+)", line))
    size = hbm_bytes if memory_spaces else shape_bytes
    flops = bytes_ = 0.0
    for name, lines in comps.items():
        if name == "ENTRY":
            continue
        shapes = {}
        for inst, shape, op, rest, _ in _instructions(lines):
            shapes[inst] = shape
            if op == "dot" or (op == "custom-call" and "__cublas" in rest):
                flops += _dot_flops(shape, rest, shapes)
            if name in fused or op in FREE or op in _CONTROL or op in ("copy-done", "slice-done"):
                continue
            operands = _operand_names(rest)
            held = [size(shapes.get(o, "")) for o in operands]
            if op in _ASYNC_MOVES:  # the destination's bytes, read where the source lives, written where it goes
                destination = _ARRAYS.findall(shape)[_ASYNC_MOVES[op]][0]
                moved = shape_bytes(destination)
                bytes_ += moved * (held[0] > 0) + moved * (size(destination) > 0)
                continue
            if op == "dynamic-update-slice":  # the update read where it lives, written where the buffer is
                update = shape_bytes(shapes.get(operands[1], ""))
                bytes_ += held[1] + update * (size(shape) > 0)
                continue
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            fused_lines = comps.get(called.group(1), []) if op == "fusion" and called else []
            sliced = _sliced_parameters(fused_lines)
            updated = _updated_in_place(fused_lines)
            if updated is not None:  # the buffer parameter neither read nor written whole: its update written
                buffer, update = updated
                held[buffer], written = 0.0, update * (size(shape) > 0)
            else:
                written = size(shape)
            bytes_ += written + sum(min(sliced.get(i, b), b) for i, b in enumerate(held))
    return flops, bytes_


# asynchronous copies the compiler inserts (TPU: into and out of on-chip memory) -> where their destination
# is among the arrays of their result: copy-start's (destination, source, context), slice-start's
# ((source), destination, context); the matching -done moves nothing more
_ASYNC_MOVES = {"copy-start": 0, "slice-start": 1}
# an array's shape with its layout, e.g. bf16[2048,512]{1,0:T(8,128)(2,1)S(1)}
_ARRAYS = re.compile(r"(\b[a-z]+\d*[a-z0-9]*\[[\d,]*\](\{[^}]*\})?)")
_ON_CHIP = re.compile(r"S\([12]\)")  # TPU: 1 its on-chip vector memory, 2 its scalar memory


def hbm_bytes(shape_text: str) -> float:
    """Bytes of the arrays of an HLO shape (TPU's) that live in HBM: all but those whose layout names
    memory space 1 (on-chip memory, where TPU's memory-space assignment puts buffers) or 2 (scalar memory)."""
    return sum(shape_bytes(array) for array, layout in _ARRAYS.findall(shape_text) if not _ON_CHIP.search(layout))


def _sliced_parameters(fused_lines: list[str]) -> dict[int, float]:
    """{parameter number: bytes read} for a fused computation's parameters that only `dynamic-slice`s,
    `slice`s or `gather`s read (the kernel reads what it takes, not the whole buffer: embedding rows, a cache
    block)."""
    params, uses, sizes = {}, {}, {}
    for inst, shape, op, rest, _ in _instructions(fused_lines):
        if op == "parameter":
            params[inst] = int(re.match(r"\s*(\d+)", rest).group(1))
            continue
        for j, o in enumerate(_operand_names(rest)):
            if o in params:
                slicing = op in ("dynamic-slice", "slice", "gather") and j == 0
                uses.setdefault(o, []).append(slicing)
                sizes[o] = sizes.get(o, 0.0) + shape_bytes(shape)
    return {params[p]: sizes[p] for p, kinds in uses.items() if all(kinds)}


def _updated_in_place(fused_lines: list[str]) -> tuple[int, float] | None:
    """(parameter number, update bytes) when a fused computation's root is a `dynamic-update-slice` of one
    of its parameters (through bitcasts) that nothing else in it reads: XLA emits such a fusion in place, its
    output the parameter's buffer, so the kernel writes the update and never reads or writes the rest (a
    cache write at decode)."""
    shapes, params, source, users, root = {}, {}, {}, collections.Counter(), None
    for inst, shape, op, rest, is_root in _instructions(fused_lines):
        shapes[inst] = shape
        operands = _operand_names(rest)
        users.update(operands)
        if op == "parameter":
            params[inst] = int(re.match(r"\s*(\d+)", rest).group(1))
        elif op == "bitcast" and operands:
            source[inst] = operands[0]
        if is_root:
            root = (op, operands)
    if root is None or root[0] != "dynamic-update-slice" or len(root[1]) < 2:
        return None
    buffer = root[1][0]
    while buffer in source and users[buffer] == 1:
        buffer = source[buffer]
    if buffer not in params or users[buffer] != 1:
        return None
    return params[buffer], shape_bytes(shapes.get(root[1][1], ""))


def _dot_flops(shape: str, rest: str, shapes: dict) -> float:
    operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
    contracting = re.search(r'lhs_contracting_dim(?:s=\{|ensions":\[)"?([\d", ]*)', rest)
    if not operands or not contracting:
        return 0.0
    lhs = dims_of(shapes.get(operands[0], ""))
    k = _prod([lhs[int(d)] for d in re.findall(r"\d+", contracting.group(1)) if int(d) < len(lhs)])
    return 2.0 * _prod(dims_of(shape)) * k


def reachable(comps: dict[str, list[str]], name: str) -> list[str]:
    """Computation `name` and every computation it calls, fuses, loops over or branches to, transitively."""
    seen, todo = [], [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in comps:
            continue
        seen.append(current)
        for line in comps[current]:
            todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", line)
    return seen


_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of a collective instruction, from any of the forms XLA prints: explicit
    ({{0,4},{1,5}}), iota ([4,2]<=[2,4]T(1,0)) or by mesh axes (mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, with
    or without device_ids=([2,4]T(1,0))); a collective-permute's source-target pairs as groups of two. None
    if it names none (a collective over every device); a form not read here is refused, naming it."""
    if m := re.search(r"source_target_pairs=" + _BRACED, line):
        return _braced(m.group(1))
    if re.search(r"replica_groups=\{\}", line) or "replica_groups=" not in line:
        return None
    if m := re.search(r"replica_groups=" + _BRACED, line):
        return _braced(m.group(1))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        ids = _iota(m.group(3), m.group(4))
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    pattern = r"replica_groups=mesh\[([^\]]*)\],? (?:device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\) )?\{([^}]*)\}"
    if m := re.search(pattern, line):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = _iota(m.group(2) or ",".join(map(str, sizes)), m.group(3)).reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        kept = [i for i in range(len(sizes)) if i not in over]
        return ids.transpose(kept + over).reshape(-1, _prod([sizes[i] for i in over])).tolist()
    raise ValueError(f"replica groups in a form not read here: {line.split('replica_groups=')[1][:120]!r}")


_BRACED = r"\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}"  # {{0,4},{1,5}}


def _braced(groups: str) -> list[list[int]]:
    return [[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]*)\}", groups)]


def _iota(dims: str, perm: str | None):
    import numpy as np

    ids = np.arange(_prod(dims)).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def collective_axes(comps: dict[str, list[str]], name: str, mesh) -> list[tuple[str, frozenset]]:
    """(opcode, the axes of `mesh` its devices differ along) of every collective computation `name` runs
    (of a program compiled on `mesh`'s devices, in their order): e.g. ("all-reduce", {"data"}) for gradients
    summed over data replicas. A collective over every device spans every axis of size > 1."""
    import numpy as np

    shape = mesh.devices.shape  # a group names devices by their place in the program's devices: the mesh's, flat
    where = {i: np.unravel_index(i, shape) for i in range(mesh.devices.size)}
    out = []
    for line in comps[name]:
        op = _INSTRUCTION.match(line).group(1).removesuffix("-start")
        if op not in _COLLECTIVE_OPS:
            continue
        groups = replica_groups(line) or [sorted(where)]
        spanned = {
            mesh.axis_names[k]
            for group in groups
            for k in range(len(shape))
            if len({where[d][k] for d in group}) > 1
        }  # fmt: skip
        out.append((op, frozenset(spanned)))
    return out
