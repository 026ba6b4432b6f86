"""Several processes, one program: start-up on `jax.distributed`, and what only one process should do.

A TPU pod slice or a GPU cluster runs one jaxgen process per host; all of them execute the same
jitted programs over one global mesh of every process's devices (JAX's multi-controller runtime).
`initialize` joins this process to the others when it is one of several, found in this order:
    1. the config's `distributed` section (train.py / serve.py: --coordinator, --num-processes, --process-id);
       `--coordinator auto` leaves everything to JAX's own cluster detection (a Cloud TPU VM slice, whose
       workers JAX finds through the metadata server);
    2. JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (set by `launch.py`; on Kubernetes an
       Indexed Job's JOB_COMPLETION_INDEX stands in for JAX_PROCESS_ID);
    3. a cluster JAX detects itself: a Slurm job step of several tasks (srun), Open MPI (mpirun), a GKE TPU
       slice of several hosts (TPU_WORKER_HOSTNAMES).
A single process needs nothing and gets nothing new.

When a process dies (kill -9, a lost host), the others stop within `heartbeat_timeout_s`: JAX's
coordination service misses its heartbeats and ends every process with an error naming the lost task.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping

import numpy as np

from jaxgen.config import ConfigError, DistributedConfig

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


_CONFIG_NAMES = ("distributed.coordinator", "distributed.num_processes", "distributed.process_id")
_ENV_NAMES = ("$" + ENV_COORDINATOR, "$" + ENV_NUM_PROCESSES, "$" + ENV_PROCESS_ID)


def detect(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> tuple[str, dict] | None:
    """(where the setting came from, keyword arguments for jax.distributed.initialize), or None for one process.

    Checked before JAX starts, so a wrong value is an error that names it, not a hang.
    """
    if cfg.coordinator == "auto":
        if cfg.num_processes != 1 or cfg.process_id != 0:
            raise ConfigError(
                "distributed.coordinator='auto' is not allowed with distributed.num_processes or process_id: "
                "auto leaves all three to JAX's cluster detection; give all three, or only auto"
            )
        return "cluster detection", _timeouts(cfg)
    if cfg.coordinator is not None or cfg.num_processes > 1 or cfg.process_id != 0:
        return "config", _explicit((cfg.coordinator, cfg.num_processes, cfg.process_id), _CONFIG_NAMES, cfg)
    if environ.get(ENV_COORDINATOR):
        pid = environ.get(ENV_PROCESS_ID, environ.get("JOB_COMPLETION_INDEX"))  # Kubernetes Indexed Job
        given = (environ[ENV_COORDINATOR], environ.get(ENV_NUM_PROCESSES), pid)
        return "environment", _explicit(given, _ENV_NAMES, cfg)
    if _int(environ.get("SLURM_STEP_NUM_TASKS", "1"), "$SLURM_STEP_NUM_TASKS") > 1:  # inside srun, not salloc
        return "slurm", _timeouts(cfg)
    if _int(environ.get("OMPI_COMM_WORLD_SIZE", "1"), "$OMPI_COMM_WORLD_SIZE") > 1:
        if not environ.get("OMPI_MCA_orte_hnp_uri"):  # what JAX's Open MPI detection reads (Open MPI < 5)
            raise ConfigError(
                "started by Open MPI with $OMPI_COMM_WORLD_SIZE > 1, but without $OMPI_MCA_orte_hnp_uri, which "
                "JAX needs to find process 0: pass --coordinator HOST:PORT --num-processes $OMPI_COMM_WORLD_SIZE "
                "--process-id $OMPI_COMM_WORLD_RANK (or set the JAX_* variables)"
            )
        return "open mpi", _timeouts(cfg)
    hosts = environ.get("TPU_WORKER_HOSTNAMES") or environ.get("TPU_PROCESS_ADDRESSES") or ""
    if len([h for h in hosts.split(",") if h]) > 1:
        return "cloud tpu", _timeouts(cfg)
    return None


def _int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not allowed: an integer") from None


def _explicit(given: tuple, names: tuple[str, str, str], cfg: DistributedConfig) -> dict:
    coordinator, num_processes, process_id = given
    host, _, port = (coordinator or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{names[0]}={coordinator!r} is not allowed: HOST:PORT of process 0 (e.g. 10.0.0.1:8476), "
            f"with {names[1]} >= 2 and {names[2]}; or auto, to leave all three to JAX's cluster detection"
        )
    num_processes = _int(num_processes, names[1])
    if num_processes < 2:
        raise ConfigError(f"{names[1]}={num_processes!r} is not allowed: an integer >= 2 with a coordinator")
    process_id = _int(process_id, names[2])
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"{names[2]}={process_id!r} is not allowed: an integer in [0, {num_processes - 1}], "
            "different on every process"
        )
    return dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id) | _timeouts(cfg)


def add_distributed_flags(parser) -> None:
    """--coordinator, --num-processes, --process-id: shortcuts for the config's `distributed` section."""
    group = parser.add_argument_group(
        "several processes", "one process per host, all running this same command (see docs/multiprocess.md); "
        "without these, the environment is read (JAX_COORDINATOR_ADDRESS, an srun step, mpirun, a GKE TPU slice)",
    )  # fmt: skip
    group.add_argument(
        "--coordinator", metavar="HOST:PORT",
        help="sets distributed.coordinator: process 0's address; auto = JAX's own detection (Cloud TPU VM slices)",
    )  # fmt: skip
    group.add_argument("--num-processes", type=int, metavar="N", help="sets distributed.num_processes")
    group.add_argument("--process-id", type=int, metavar="I", help="sets distributed.process_id (0 .. N-1)")


def distributed_overrides(args) -> list[str]:
    """The dotted overrides that the flags of `add_distributed_flags` stand for."""
    flags = {"coordinator": args.coordinator, "num_processes": args.num_processes, "process_id": args.process_id}
    return [f"distributed.{k}={v}" for k, v in flags.items() if v is not None]


def _timeouts(cfg: DistributedConfig) -> dict:
    """A lost process ends the others after heartbeat_timeout_s; so does one that exits on an error while they
    wait at JAX's shutdown barrier (its default, 300 s, would keep them that long)."""
    return dict(
        initialization_timeout=cfg.init_timeout_s, heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        shutdown_timeout_seconds=cfg.heartbeat_timeout_s,
    )  # fmt: skip


def initialize(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """Joins the other processes when this is one of several (see the module docstring); returns how that was
    found, or None for a single process. Must run before anything else uses JAX."""
    found = detect(cfg, environ)
    if found is None:
        return None
    source, kwargs = found
    import jax

    try:
        jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:
        if source != "cluster detection":
            raise
        raise ConfigError(
            f"--coordinator auto: JAX found no cluster to join ({e}); it detects Cloud TPU VM slices, Slurm, "
            "Open MPI and Kubernetes; elsewhere give --coordinator HOST:PORT --num-processes N --process-id I"
        ) from None
    return source


def describe(source: str) -> str:
    """One line on where this process stands, e.g. for the start of a log."""
    import jax

    return (
        f"process {jax.process_index()} of {jax.process_count()} (joined via {source}): "
        f"{jax.local_device_count()} of {jax.device_count()} devices here"
    )


def is_main() -> bool:
    """Whether this process writes what only one should: metrics, plots, progress bars, merged outputs."""
    import jax

    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process (a small all-gather; no communication for a single process)."""
    import jax

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.int32(flag)).any())


_barriers: dict[str, int] = {}


def barrier(name: str, timeout_s: float = 3600.0) -> None:
    """Waits until every process reached the barrier `name` (no-op for a single process). Every process must
    pass the same barriers in the same order; each use of a name gets its own id."""
    import jax

    if jax.process_count() == 1:
        return
    _barriers[name] = _barriers.get(name, 0) + 1
    unique = f"{name}-{_barriers[name]}"
    from jax._src import distributed  # the coordination service's barrier: no device collective, a timeout

    client = distributed.global_state.client
    if client is None:  # processes joined without jax.distributed (a TPU slice that libtpu formed alone)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(unique)
        return
    client.wait_at_barrier(unique, int(timeout_s * 1000))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for a local coordinator)."""
    with contextlib.closing(socket.socket()) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
