"""Start N local processes of one jaxgen command, joined by jax.distributed (for trying and for tests).

    python launch.py -n 2 --cpu-devices 4 -- python train.py --config configs/tiny.yaml

Each process gets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port), JAX_NUM_PROCESSES and
JAX_PROCESS_ID, which train.py and serve.py read; its output lines are prefixed with "[i] ". When one
process fails, the others get --grace seconds to notice and stop on their own (jax.distributed's
heartbeat), then are terminated; the exit status is the first failure's. Ctrl-C or SIGTERM is passed
on to every process (a training run saves a checkpoint and stops); those still running --grace seconds
later, or at a second Ctrl-C or SIGTERM, are killed. Each process runs in a process group of its own, and
the whole group is ended with it (what it started too); on Linux each dies with the launcher, even a
launcher killed with SIGKILL (PR_SET_PDEATHSIG). On real clusters use the cluster's own launcher instead
(docs/multiprocess.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from jaxgen.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, free_port

MAX_PROCESSES = 64  # local processes; beyond, a typo (-n 400) would start hundreds of interpreters
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run N processes of a command on this machine as one jax.distributed job.",
        epilog="example: python launch.py -n 2 --cpu-devices 4 -- python train.py --config configs/tiny.yaml",
    )
    parser.add_argument(
        "-n", "--num-processes", type=int, default=2, help=f"processes to start, 1 to {MAX_PROCESSES} (default 2)"
    )
    parser.add_argument(
        "--cpu-devices", type=int, metavar="K",
        help="run on the CPU with K devices per process (JAX_NUM_CPU_DEVICES); without it every process sees all "
        "of this machine's accelerators, so on a GPU or TPU host use one process (or the cluster's launcher)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=0, help="the coordinator's port (default: a free one)")
    parser.add_argument(
        "--grace", type=float, default=90.0,
        help="seconds the others get to stop on their own after one process fails, and all of them after Ctrl-C "
        "or SIGTERM, before they are killed (default 90)",
    )  # fmt: skip
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    return parser


_write_lock = threading.Lock()


def _pipe(stream, index: int, out) -> None:
    """Copies a process's output whole line by line (a progress-bar redraw ends at "\r"), each prefixed "[i] "."""
    pending = b""
    for chunk in iter(lambda: stream.read1(1 << 16), b""):
        pending += chunk
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut:
            _emit(pending[:cut], index, out)
            pending = pending[cut:]
    if pending:
        _emit(pending + b"\n", index, out)


def _emit(data: bytes, index: int, out) -> None:
    text = data.decode(errors="replace")
    lines = text.replace("\r", "\r\0").replace("\n", "\n\0").split("\0")
    with _write_lock:
        out.write("".join(f"[{index}] {line}" for line in lines if line))
        out.flush()


def _start(command: list[str], n: int, port: int, cpu_devices: int | None):
    """(processes, the threads copying their output)."""
    procs, pipes = [], []
    for i in range(n):
        env = dict(os.environ)
        if n > 1:
            env |= {ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(n), ENV_PROCESS_ID: str(i)}
        if cpu_devices:
            env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(cpu_devices)}
        try:
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with(os.getpid()) if sys.platform == "linux" else None,
            )  # fmt: skip
        except OSError:
            _end(procs)  # none left behind
            raise
        pipes.append(threading.Thread(target=_pipe, args=(proc.stdout, i, sys.stdout), daemon=True))
        pipes[-1].start()
        procs.append(proc)
    return procs, pipes


def _die_with(parent: int):
    """The child's last step before it runs the command: SIGKILL when `parent` (the launcher) dies, however it
    dies (a launcher killed with SIGKILL cannot end its processes itself). What the child starts later is
    ended with its process group while the launcher lives."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child runs as little as it can

    def arm():
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before prctl: the signal will never come
            os._exit(1)

    return arm


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """`sig` to the process and everything it started (its own process group); a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def _ended(p: subprocess.Popen) -> bool:
    """True once `p` exited. What it left behind in its group is killed first, while its pid is still held (a
    zombie until reaped), so that the group id is no one else's."""
    if p.returncode is not None:
        return True
    try:
        if os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return False
    except ChildProcessError:  # reaped elsewhere
        return p.poll() is not None
    _signal_group(p, signal.SIGKILL)
    p.wait()
    return True


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal s: 128 + s, as a shell reports it


class Stop:
    """Ctrl-C and SIGTERM: the first is passed on to every process (SIGTERM to its group), a second kills them."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs, self.at = procs, None

    def __call__(self, signum, frame) -> None:
        again = self.at is not None
        self.at = self.at or time.monotonic()
        for p in self.procs:
            if p.returncode is None:
                _signal_group(p, signal.SIGKILL if again else signal.SIGTERM)


def supervise(procs: list[subprocess.Popen], grace: float, stop: Stop | None = None) -> int:
    """Waits for every process; after the first failure, or a stop signal, the rest get `grace` seconds, then
    are killed."""
    failed_at, status = None, 0
    while not all([_ended(p) for p in procs]):  # a list: every process looked at, each pass
        for i, p in enumerate(procs):
            if p.returncode not in (None, 0) and failed_at is None:
                failed_at, status = time.monotonic(), _status(p.returncode)
                print(f"launch: process {i} exited with status {status}", file=sys.stderr, flush=True)
        stopped = stop is not None and stop.at is not None
        since = [t for t in (failed_at, stop.at if stopped else None) if t is not None]
        if since and time.monotonic() - min(since) > grace:
            print(f"launch: ending the other processes after {grace:.0f} s", file=sys.stderr, flush=True)
            _end([p for p in procs if p.returncode is None], wait_s=0.0 if stopped else 10.0)  # stopped: had SIGTERM
        time.sleep(0.1)
    codes = [_status(p.returncode) for p in procs]
    return status or next((c for c in codes if c), 0)


def _end(procs: list[subprocess.Popen], wait_s: float = 10.0) -> None:
    """SIGTERM to each process group (none when `wait_s` is 0), SIGKILL to those still there `wait_s` s later."""
    deadline = time.monotonic() + wait_s
    for p in procs if wait_s else ():
        _signal_group(p, signal.SIGTERM)
    while not all([_ended(p) for p in procs]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        if p.returncode is None:
            _signal_group(p, signal.SIGKILL)
    while not all([_ended(p) for p in procs]):
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _parser().error("no command given; put it after --, e.g. -- python train.py")
    if not 1 <= args.num_processes <= MAX_PROCESSES:
        _parser().error(f"--num-processes={args.num_processes} is not allowed: an integer from 1 to {MAX_PROCESSES}")
    if not 0 <= args.grace < float("inf"):
        _parser().error(f"--grace={args.grace} is not allowed: a number of seconds >= 0")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        _parser().error(f"--cpu-devices={args.cpu_devices} is not allowed: an integer >= 1")
    try:
        procs, pipes = _start(command, args.num_processes, args.port or free_port(), args.cpu_devices)
    except OSError as e:
        print(f"launch: cannot start {command[0]!r}: {e}", file=sys.stderr)
        return 127

    stop = Stop(procs)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = supervise(procs, args.grace, stop)
    for t in pipes:  # the last lines (often the error that matters) are still on their way
        t.join(timeout=10)
    return status


if __name__ == "__main__":
    sys.exit(main())
