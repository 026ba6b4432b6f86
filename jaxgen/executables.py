"""Compiled programs kept on disk and loaded at the next start, without tracing, lowering or compiling (issue 45).

    executables.use("~/.cache/jaxgen/executables")     # process-wide; the command lines do it with $JAXGEN_EXECUTABLES
    step = executables.Program(fn, "decode_chunk", static_argnames="cfg", donate_argnums=1)
    state = step(params, state, cfg=cfg)                # compiled once per signature, or loaded from the store

jax's persistent compilation cache skips XLA's compile but not jax's tracing and lowering, which it needs for
its key (the program's text): for the engine's programs those took most of a warm start. A `Program` keys
its executables by what it can read without tracing: its name, the text `key` that names what its function
closes over, the static arguments' reprs, and each array argument's shape, dtype, weak type and sharding.
That key does not see the code, so every stored entry also carries a fingerprint of everything else that
changes a program: jaxgen's own source, the versions of jax, jaxlib, flax, optax and numpy, the backend and
its devices, the process count, jax's numerics flags, XLA_FLAGS and $JAXGEN_CPU_DECODE_SUMS. An entry is used
only when all of it matches; a stale one (another jaxgen, another jax, another device), a foreign one (its
signature is not the one asked for) or a damaged one (its checksum, or it does not load) is compiled again, with
one log line that says why, and replaced. Without a store (`use(None)`, the library's default) a Program is `jax.jit`.

XLA:CPU serializes an executable that jax's persistent cache loaded without its kernels (it loads, then fails
to run: "Function ... not found"), so a program missing from the store is compiled by XLA in this process,
never taken from jax's caches (`_compile_fresh`): after an upgrade of jaxgen (every entry stale) each program
is compiled once more, even where jax's cache has it.

Programs of one `group` (an engine's, named by everything that decides its programs) are listed, in the
order they were first used, in a manifest beside the entries; `Store.prefetch(group)` loads that list in
threads at the next start (XLA loads without holding the GIL), so the loads overlap each other and the start's
other work, and a Program that asks for one of them waits for its load instead of starting it.

A store entry is one file: a JSON header line (fingerprint, signature, payload's sha256) and the payload,
`jax.experimental.serialize_executable`'s bytes and the argument and result tree structures, pickled. Files
are written whole and renamed into place, so a killed process or two processes at once leave no torn entry.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger(__name__)
LOADED_EVENT = "/jaxgen/executables/loaded"  # jax.monitoring events, one per program loaded (stats count them)
LOAD_DURATION_EVENT = "/jaxgen/executables/load_duration"
SUFFIX = ".jaxexe"
_store: Store | None = None


def use(path: str | os.PathLike | None, target: tuple[str, list] | None = None) -> Store | None:
    """Keeps every Program's executables in the folder `path` from now on (None: none kept). Returns the store.
    target: (backend, compile-only devices) of another machine (`jaxgen.targets.devices`): the programs are
    compiled for it and stored under its fingerprint, never loaded here (see `Store`)."""
    global _store
    _store = Store(path, target) if path else None
    if _store is not None:
        source_hash()  # now, before the files can change under a running process
    return _store


def current() -> Store | None:
    return _store


def in_use() -> bool:
    """Programs are stored and loaded: a store is set, and this is the only process (with several, each would
    call an executable over arrays it holds only part of, which a loaded executable refuses where jit's call
    reshards them: "not fully addressable"; not stored there yet)."""
    return _store is not None and jax.process_count() == 1


@functools.cache
def source_hash() -> str:
    """sha256 of jaxgen's Python sources, which a stored executable was traced from."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def fingerprint(target: tuple[str, list] | None = None) -> dict[str, str]:
    """Everything beside a program's signature that changes what compiles (see the module docstring), here or
    on `target`'s devices (their compiler's platform version is the one its real devices report: the plugin's)."""
    import flax
    import jaxlib
    import optax

    from jaxgen.model.kernels import cpu

    backend, devices = _machine(target)
    flags = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable", "jax_numpy_rank_promotion",
             "jax_disable_most_optimizations", "jax_exec_time_optimization_effort")  # fmt: skip
    return {
        "jaxgen_source": source_hash(),
        "versions": f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, "
        f"optax {optax.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}",
        "backend": f"{backend} {devices[0].client.platform_version}",
        "devices": f"{len(devices)} x {devices[0].device_kind}, {jax.process_count()} process(es)",
        "flags": ", ".join(f"{f}={jax.config.values.get(f)}" for f in flags),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu_decode_sums": "1" if cpu.sums_wanted() else "0",
    }


def _machine(target: tuple[str, list] | None) -> tuple[str, list]:
    """(backend, devices) a program is compiled for: `target`'s, or this process's."""
    return target or (jax.default_backend(), jax.devices())


class Store:
    """A folder of serialized executables, one file per (program, signature); see the module docstring.

    With a `target` (backend, compile-only devices: `python -m jaxgen.precompile --target`) the programs are
    compiled for that machine on this one and stored under its fingerprint; nothing is loaded (there are no
    such devices here), so every program is compiled and its entry replaced."""

    def __init__(self, path: str | os.PathLike, target: tuple[str, list] | None = None):
        self.root = Path(os.path.expanduser(str(path)))
        self.target = target
        self.loaded = self.saved = 0
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future] = {}  # signature -> its prefetched load
        self._listed: dict[str, list] = {}  # group -> its manifest's [name, signature] pairs
        self._clear_leftovers()

    def _clear_leftovers(self, age_s: float = 3600.0) -> None:
        """Deletes what processes killed while writing left (`.partial` files older than `age_s`: a live
        writer's is seconds old)."""
        now = time.time()
        for partial in self.root.glob("*.partial"):
            with contextlib.suppress(OSError):  # another process's cleanup got there first
                if now - partial.stat().st_mtime > age_s:
                    partial.unlink()

    def path(self, name: str, signature: str) -> Path:
        """The entry's file, named by the program, its signature and the devices it is for (so that a folder
        holding a target's programs and this machine's keeps both)."""
        backend, devices = _machine(self.target)
        machine = f"{backend} {len(devices)} x {devices[0].device_kind}"
        return self.root / f"{name}-{hashlib.sha256(f'{signature}|{machine}'.encode()).hexdigest()[:24]}{SUFFIX}"

    def load(self, name: str, signature: str):
        """The executable stored for `signature`, loaded onto this process's devices; None (with a line in the
        log saying why, unless there is no entry) when there is none it may use."""
        with self._lock:
            pending = self._pending.pop(signature, None)
        compiled, seconds = pending.result() if pending is not None else self._load(name, signature)
        if compiled is not None:  # counted on the caller's thread, where the engine's statistics look for it
            jax.monitoring.record_event_duration_secs(LOAD_DURATION_EVENT, seconds)
            jax.monitoring.record_event(LOADED_EVENT)
            with self._lock:
                self.loaded += 1
        return compiled

    def prefetch(self, group: str, workers: int = min(4, os.cpu_count() or 1)) -> int:
        """Starts loading, in `workers` threads, the programs `group`'s manifest lists (those it used at an
        earlier start); returns how many. `load` then waits for each instead of loading it."""
        with self._lock:
            listed = list(self._manifest(group))
        if not listed or self.target is not None:
            return 0
        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="executables")
        with self._lock:
            for name, signature in listed:
                if signature not in self._pending:
                    self._pending[signature] = pool.submit(self._load, name, signature)
        pool.shutdown(wait=False)  # its threads end when the queue is empty
        return len(listed)

    def note(self, group: str, name: str, signature: str) -> None:
        """Lists (name, signature) in `group`'s manifest (written whole and renamed into place when it grows)."""
        with self._lock:
            listed = self._manifest(group)
            if [name, signature] in listed:
                return
            listed.append([name, signature])
            path = self._manifest_path(group)
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(f".{os.getpid()}.partial")
                partial.write_text(json.dumps(listed))
                os.replace(partial, path)
            except OSError as e:
                log.warning("executables: the manifest %s not written: %s", path, e)

    def _manifest_path(self, group: str) -> Path:
        return self.root / f"manifest-{hashlib.sha256(group.encode()).hexdigest()[:24]}.json"

    def _manifest(self, group: str) -> list:
        if group not in self._listed:
            try:
                listed = json.loads(self._manifest_path(group).read_text())
                ok = isinstance(listed, list) and all(isinstance(x, list) and len(x) == 2 for x in listed)
            except (OSError, ValueError):
                listed, ok = [], True
            self._listed[group] = listed if ok else []
        return self._listed[group]

    def _load(self, name: str, signature: str):
        """(the executable, seconds its load took), or (None, 0) as `load` says; any thread."""
        path = self.path(name, signature)
        if self.target is not None:
            return None, 0.0
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None, 0.0
        except OSError as e:
            return _refused(name, path, f"it could not be read ({e})")
        head, _, payload = raw.partition(b"\n")
        try:
            header = json.loads(head)
        except ValueError:
            return _refused(name, path, "it is damaged (no header)")
        if header.get("sha256") != hashlib.sha256(payload).hexdigest():
            return _refused(name, path, "it is damaged (its checksum does not match)")
        if header.get("signature") != signature:
            return _refused(name, path, "it was built for another signature (a foreign file)")
        now = fingerprint()
        changed = [f"{k}: {header.get('fingerprint', {}).get(k)!r} -> {v!r}" for k, v in now.items()
                   if header.get("fingerprint", {}).get(k) != v]  # fmt: skip
        if changed:
            return _refused(name, path, "it is stale (" + "; ".join(changed) + ")")
        from jax.experimental.serialize_executable import deserialize_and_load

        by_id = {d.id: d for d in jax.devices()}
        if not set(header.get("devices", [-1])) <= set(by_id):
            return _refused(name, path, f"it runs on devices {header.get('devices')}, not all of them here")
        t0 = time.perf_counter()
        try:
            serialized, in_tree, out_tree = pickle.loads(payload)
            # on the devices it was compiled for, in their order (jax's default: every device of the backend)
            devices = [by_id[i] for i in header["devices"]]
            compiled = deserialize_and_load(serialized, in_tree, out_tree, execution_devices=devices)
        except Exception as e:  # an executable this jax, or these devices, cannot load
            return _refused(name, path, f"it did not load ({type(e).__name__}: {str(e)[:200]})")
        return compiled, time.perf_counter() - t0

    def save(self, name: str, signature: str, compiled) -> None:
        """Stores `compiled` for `signature` (a failure to write is logged, never raised: it only costs a compile
        at the next start)."""
        from jax.experimental.serialize_executable import serialize

        path = self.path(name, signature)
        try:
            payload = pickle.dumps(serialize(compiled))
            devices = [d.id for d in compiled._executable._unloaded_executable.device_list]  # no public name
            header = {"program": name, "signature": signature, "fingerprint": fingerprint(self.target),
                      "devices": devices, "sha256": hashlib.sha256(payload).hexdigest()}  # fmt: skip
            self.root.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(json.dumps(header).encode() + b"\n" + payload)
            os.replace(partial, path)
            with self._lock:
                self.saved += 1
        except Exception as e:  # a full disk, a read-only folder, an executable jax cannot serialize
            log.warning("executables: %s not stored in %s: %s: %s", name, self.root, type(e).__name__, e)


def _refused(name: str, path: Path, why: str) -> tuple[None, float]:
    log.warning("executables: compiling %s again: the stored %s is not used: %s", name, path.name, why)
    return None, 0.0


class Program:
    """`jax.jit(fn, **jit_kwargs)` whose executables are loaded from the current store, or compiled and stored
    there (see the module docstring). `name` names the program in the store and the log; `key` is text that
    names what `fn` closes over (a partial's config, say), since the store cannot see it; None when nothing can
    (it is then never stored); `group`: the manifest its signatures are listed in (`Store.prefetch`). Called
    like `fn`; `compile(*args, **kwargs)` compiles (or loads) without running."""

    def __init__(self, fn: Callable, name: str, key: str | None = "", group: str | None = None, **jit_kwargs):
        # A program with no array argument (or a replicated output) takes its devices from the mesh it is
        # traced under, which the signature does not see: its `key` names that mesh (`describe_mesh`).
        self.jitted = jax.jit(fn, **jit_kwargs)
        self.name, self.key, self.group = name, key, group  # group: see `Store.prefetch`
        nums = jit_kwargs.get("static_argnums", ())
        names = jit_kwargs.get("static_argnames", ())
        self.static_nums = frozenset((nums,) if isinstance(nums, int) else nums)
        self.static_names = frozenset((names,) if isinstance(names, str) else names)
        self._compiled: dict = {}  # in-memory key (cheap: the arrays' abstract values and shardings) -> executable
        self._by_signature: dict = {}  # the store's key (equivalent shardings read alike) -> executable

    def __call__(self, *args, **kwargs):
        if not self._stored():
            return self.jitted(*args, **kwargs)
        try:
            dynamic, dynamic_kw, memory_key = self._split(args, kwargs)
        except _Traced:  # called inside another function being traced: part of that program
            return self.jitted(*args, **kwargs)
        compiled = self._compiled.get(memory_key)
        if compiled is None:
            compiled = self._executable(memory_key, args, kwargs)
        return compiled(*dynamic, **dynamic_kw)

    def compile(self, *args, **kwargs) -> None:
        """The executable for these arguments made ready (from the store, or compiled and stored), not run."""
        if not self._stored():
            self.jitted.lower(*args, **kwargs).compile()
            return
        _, _, memory_key = self._split(args, kwargs)
        if memory_key not in self._compiled:
            self._executable(memory_key, args, kwargs)

    def _stored(self) -> bool:
        return self.key is not None and in_use()

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forgets the executables held in memory (the store's files stay)."""
        self.jitted.clear_cache()
        self._compiled.clear()
        self._by_signature.clear()

    def _split(self, args, kwargs):
        """(dynamic positional arguments, dynamic keyword arguments, the in-memory key of this call)."""
        dynamic = [a for i, a in enumerate(args) if i not in self.static_nums]
        dynamic_kw = {k: v for k, v in kwargs.items() if k not in self.static_names}
        static = tuple(a for i, a in enumerate(args) if i in self.static_nums)
        static += tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_names))
        leaves, treedef = jax.tree.flatten((dynamic, dynamic_kw))
        return dynamic, dynamic_kw, (treedef, static, tuple(map(_memory_key, leaves)))

    def _executable(self, memory_key, args, kwargs):
        treedef, static, _ = memory_key
        dynamic, dynamic_kw, _ = self._split(args, kwargs)
        leaves = tuple(map(_leaf_key, jax.tree.leaves((dynamic, dynamic_kw))))
        signature = f"{self.name}|{self.key}|{static!r}|{treedef}|{leaves!r}"
        if signature in self._by_signature:  # the same program, reached with equivalent shardings
            self._compiled[memory_key] = self._by_signature[signature]
            return self._by_signature[signature]
        stable = " at 0x" not in signature  # an object's address in a repr: a key no other process can match
        compiled = _store.load(self.name, signature) if stable else None
        if compiled is None:
            log.info("executables: compiling %s (%s)", self.name, "not stored yet" if stable else "not storable")
            lowered = self.jitted.lower(*args, **kwargs)
            if stable:
                compiled, fresh = _compile_fresh(lowered)
                if fresh and signature not in _unstorable:
                    _store.save(self.name, signature, compiled)
                else:  # jax's in-memory cache hands the same executable back later: never stored in this process
                    _unstorable.add(signature)
                    log.warning(
                        "executables: %s not stored: jax's persistent cache had this compile (written by "
                        "another version of jaxgen?), and such an executable cannot be stored",
                        self.name,
                    )
            else:
                compiled = lowered.compile()
                log.info("executables: %s not stored: a static argument's repr holds an address", self.name)
        if stable and self.group is not None:
            _store.note(self.group, self.name, signature)
        self._compiled[memory_key] = self._by_signature[signature] = compiled
        return compiled


def _compile_fresh(lowered):
    """`lowered` compiled by XLA now, never an executable from a cache: XLA:CPU serializes an executable that
    jax's persistent cache loaded without its kernels (it loads, then fails to run: "Function ... not found"),
    and jax's in-memory cache may hand back such an executable compiled earlier in the process. So the store's
    programs are compiled with an option at its default value, which gives them cache keys of their own, and
    not written to jax's persistent cache (so that no later compile of them can be a hit there). Returns
    (the executable, whether XLA compiled it: False when that cache had it anyway, from another writer)."""
    _hits.seen = False
    _listen_for_cache_hits()
    with _no_persistent_cache_writes():
        compiled = lowered.compile(compiler_options={"xla_embed_ir_in_executable": False})
    return compiled, not _hits.seen


_hits = threading.local()  # .seen: jax reported a persistent-cache hit on this thread since it was cleared
_unstorable: set[str] = set()  # signatures whose executable came from jax's persistent cache in this process


@functools.cache
def _listen_for_cache_hits() -> None:
    def on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _hits.seen = True

    jax.monitoring.register_event_listener(on_event)


_writes_lock = threading.Lock()
_writes_off = [0, None]  # (compiles in progress with writes off, the setting they replaced)


@contextlib.contextmanager
def _no_persistent_cache_writes():
    """jax's persistent cache writes nothing while any thread is inside (a process-wide setting: counted)."""
    with _writes_lock:
        if _writes_off[0] == 0:
            _writes_off[1] = jax.config.jax_persistent_cache_min_compile_time_secs
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e12)
        _writes_off[0] += 1
    try:
        yield
    finally:
        with _writes_lock:
            _writes_off[0] -= 1
            if _writes_off[0] == 0:
                jax.config.update("jax_persistent_cache_min_compile_time_secs", _writes_off[1])


def describe_mesh(mesh) -> str:
    """A mesh as text that names its devices (a Mesh's repr names only its axes); "" for None."""
    return "" if mesh is None else f"mesh {dict(mesh.shape)} on devices {mesh.device_ids.tolist()}"


@functools.lru_cache(maxsize=4096)
def _placement(sharding, ndim: int) -> str:
    """Where an array of `ndim` dimensions with `sharding` lives, as text: its devices in order, XLA's sharding
    of it and the memory kind. Equivalent shardings read alike (on one device, P() and P('tensor') are both
    "replicated"): a compiled program returns them either way, and the next call must find the same program."""
    devices = [d.id for d in sharding._device_assignment]  # no public name for the order
    return f"devices {devices} {sharding._to_xla_hlo_sharding(ndim)} {sharding.memory_kind}"


def _memory_key(x):
    """An argument leaf's key within this process: its abstract value and its sharding object (a few times
    cheaper than `_leaf_key`, which the store needs; this runs on every call)."""
    if type(x) in _ARRAY_TYPES:
        return (x.aval, x.sharding)
    if isinstance(x, jax.core.Tracer):
        raise _Traced
    if isinstance(x, jax.Array):
        _ARRAY_TYPES.add(type(x))
        return (x.aval, x.sharding)
    return _leaf_key(x)  # a ShapeDtypeStruct (`compile` for abstract arguments) reads as the array it stands for


_ARRAY_TYPES: set[type] = set()  # the concrete jax.Array types seen (an ABC's isinstance is slow per call)


class _Traced(Exception):
    """An argument is a tracer: the call is being traced into another program."""


def _leaf_key(x):
    """What of an argument leaf its executable depends on."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        weak = getattr(x, "weak_type", False)  # a key array has none
        where = "the default device" if x.sharding is None else _placement(x.sharding, len(x.shape))
        return (x.shape, str(x.dtype), weak, where)
    if isinstance(x, np.ndarray | np.generic):
        return (x.shape, x.dtype.name)
    return type(x).__name__  # a Python scalar: weakly typed
