"""Run distributed code from a notebook or a test: ``launch(fn, world_size)`` starts the ranks.

``launch`` starts ``world_size`` processes, initialises the default process group in each
(gloo on CPU, NCCL when there is a GPU per rank), calls ``fn`` in every rank and returns the
results ordered by rank:

    from course_lib.support import dist as cdist
    import torch.distributed as dist

    def total(x):
        t = torch.tensor([float(dist.get_rank() + x)])
        dist.all_reduce(t)
        return t

    cdist.launch(total, 4, 1.0)   # [tensor([10.]), tensor([10.]), tensor([10.]), tensor([10.])]

The same rank function runs on a multi-GPU host under ``torchrun``: see ``course_lib.support.torchrun``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from course_lib.exercises.checks import student_side

T = TypeVar("T")

__all__ = ["RankError", "backend_for", "free_then_destroy_group", "launch", "pick_for", "rank_device"]

# After SIGTERM, how long a rank may take to exit before it is killed.
_TERMINATE_GRACE_S = 2.0
# After the first rank fails, how long to wait for the others' reports (to list them too).
_FAILURE_GRACE_S = 0.5
# How far past the launch's deadline the ranks' own store and collective timeouts lie. The launch stops
# a rank stuck in a collective at its deadline and names it (TimeoutError); a group timeout at the same
# moment would race with that and, on a loaded machine, sometimes turn a deadlock into a rank's error.
_GROUP_TIMEOUT_MARGIN_S = 60.0


class _MeshSetupFailed(Exception):
    """gloo's connection set-up between the ranks failed before any user code ran; the launch may be retried."""


class RankError(RuntimeError):
    """One or more ranks failed; ``ranks`` lists them, the first to fail first, and the message carries its traceback."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def backend_for(world_size: int) -> str:
    """``"nccl"`` when there is a CUDA device for every rank, else ``"gloo"`` (saying why, once, when a GPU exists)."""
    global _said_gloo
    if torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
        if n_gpus >= world_size:
            return "nccl"
        if not _said_gloo:
            print(f"launch: {n_gpus} GPU(s) here: launches of more ranks than that use gloo on the CPU")
            _said_gloo = True
    return "gloo"


_said_gloo = False


def pick_for(world_size: int, cpu: T, gpu: T) -> T:
    """The size preset for a ``world_size``-rank launch: ``gpu`` when every rank gets a GPU (NCCL), else ``cpu``."""
    return gpu if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else cpu


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL (``cuda:rank`` with one process per GPU), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor inside (lists, tuples, dicts) moved to the CPU and detached."""
    if isinstance(obj, torch.Tensor):
        # A copy, not .cpu(): that returns a CPU tensor as it is, and a tensor subclass such as the
        # result of a functional collective or a DTensor layer may still hold an unfinished
        # reduction; a real operation on it waits for the result and yields a plain tensor.
        if type(obj) is not torch.Tensor:
            obj = obj.detach().to("cpu", copy=True).as_subclass(torch.Tensor)
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: rebuild field by field
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class _RankStream(io.TextIOBase):
    """A rank's stdout or stderr: whole lines go to the parent, which prints them prefixed with the rank."""

    def __init__(self, conn: mpc.Connection, lock: threading.Lock, name: str, fd: int) -> None:
        super().__init__()
        self._conn, self._lock, self._name, self._fd = conn, lock, name, fd
        self._partial = ""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd  # subprocesses and C code write to the real descriptor, as before

    def write(self, text: str) -> int:
        lines, newline, self._partial = (self._partial + text).rpartition("\n")
        if newline:
            self._send(lines + newline)
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._send(self._partial + "\n")
            self._partial = ""

    def _send(self, text: str) -> None:
        with self._lock:  # ranks may print from several threads; one message at a time on the pipe
            self._conn.send(("out", self._name, text))


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the parent dies, so no rank outlives a crashed notebook."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the parent's cleanup is all there is
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    listener: socket.socket | None,
    timeout: float,
    payload: Any,
    conn: mpc.Connection,
) -> None:
    """The body of one rank: join the group, run the function, send back ("ok", result) or ("err", ...)."""
    _die_with_parent()
    lock = threading.Lock()
    # Whole lines through the pipe: forked ranks writing straight to the shared stdout interleave
    # mid-line, and a notebook shows them out of order with the parent's own output.
    sys.stdout = _RankStream(conn, lock, "stdout", 1)
    sys.stderr = _RankStream(conn, lock, "stderr", 2)
    # Code that reads torchrun's variables (or calls init with env://) sees the same world.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    phase = "init"
    try:
        # From the forkserver the function arrives as bytes (serialised by value); under fork it is the object itself.
        fn, args, kwargs = pickle.loads(payload) if isinstance(payload, bytes) else payload
        # A rank from the forkserver starts with Python's default warning filters; the notebook's are the course's.
        from course_lib.env import quiet_warnings
        quiet_warnings()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # One intra-op thread per rank. A forked child whose parent has already used the OpenMP
        # thread pool hangs in its first parallel region (seen in layer_norm) when it asks for
        # more than one thread; and ranks share the cores anyway, so extra threads oversubscribe.
        torch.set_num_threads(1)
        # Rank 0 serves the rendezvous store on the socket the parent bound (see _listening_socket).
        group_timeout = timedelta(seconds=timeout + _GROUP_TIMEOUT_MARGIN_S)
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=rank == 0, timeout=group_timeout,
            master_listen_fd=listener.fileno() if listener is not None else None,
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=group_timeout)
        phase = "run"
        result = pickle.dumps(_to_cpu(fn(*args, **kwargs)))
        phase = "destroy"
        free_then_destroy_group()
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - everything, KeyboardInterrupt included, goes to the parent
        sys.stdout.flush()
        sys.stderr.flush()
        # Drop this function's own frame: the student's code is what the traceback should show.
        tb = exc.__traceback__.tb_next if phase == "run" and exc.__traceback__ else exc.__traceback__
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        # Report before destroying the group: the parent then stops the other ranks at once.
        conn.send(("err", phase, f"raised {type(exc).__name__}: {exc}", text))
        if dist.is_initialized():
            free_then_destroy_group()
    finally:
        conn.close()


def free_then_destroy_group() -> None:
    """Collect garbage, then destroy the default process group and its subgroups.

    A DistributedDataParallel module and its reducer form reference cycles that only the garbage
    collector frees, and the reducer holds the process group. Left for the interpreter's exit, the
    group is then torn down after ``destroy_process_group`` with gloo's threads still running, and
    the rank aborts ("terminate called without an active exception"): 4 runs in 10 of a script that
    trains three DDP modules in a function, none once the garbage is collected first.
    """
    gc.collect()
    dist.destroy_process_group()


def _context_and_payload(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """Fork without a GPU (keeps notebook-defined functions working); else forkserver with ``fn`` pickled by value."""
    if not torch.cuda.is_available():
        return mp.get_context("fork"), (fn, args, kwargs)
    # Where there is a GPU, a rank forked from the caller breaks as soon as the caller has
    # initialised CUDA ("CUDA error: initialization error") or run a backward pass (autograd then
    # starts a thread per GPU, and a forked child's autograd refuses to run). So ranks fork from a
    # forkserver: a clean process, started on the first launch, that has imported torch and this
    # module but never touched CUDA or autograd. Each rank then starts in milliseconds instead of
    # the seconds a spawned interpreter takes to import torch. The function reaches it by pickle,
    # which fails for functions defined in a notebook cell, hence cloudpickle (by value).
    try:
        import cloudpickle
    except ImportError:
        raise RuntimeError(
            "launch: on a machine with a GPU ranks start from a forkserver, which needs the function "
            "pickled by value, which needs cloudpickle (pip install cloudpickle). Otherwise define "
            "the function in a module (a .py file)."
        ) from None
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["course_lib.env", "course_lib.support.dist"])
    return ctx, cloudpickle.dumps((fn, args, kwargs))


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` ranks of a fresh process group; return the results by rank.

    ``backend`` None picks with ``backend_for``. Under NCCL rank r uses ``cuda:r``.
    On a machine without a GPU ranks are forked, so functions defined in a notebook cell,
    lambdas and closures work. Where there is a GPU, forking is unsafe once the parent has
    used CUDA or autograd: ranks fork from multiprocessing's forkserver instead (it starts with
    the first launch and keeps the environment of that moment) and ``fn`` is pickled by value
    with cloudpickle (without it, a RuntimeError asks to define ``fn`` in a module). Tensors in
    the results come back on the CPU.

    Raises ``RankError`` (naming the rank(s), with the remote traceback) as soon as a rank
    raises, after stopping the others, and ``TimeoutError`` naming the ranks still running
    when the run takes longer than ``timeout`` seconds. Ranks never outlive the call.
    When the grader's tester calls it, the ranks start in the student's kernel, where the
    student's functions are, and only their results come back (``exercises.checks.student_side``).
    """
    return student_side(_launch_here)(fn, world_size, *args, backend=backend, timeout=timeout, **kwargs)


def _launch_here(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None, timeout: float,
                 **kwargs: Any) -> list[Any]:
    """``launch``, in this process."""
    if world_size < 1:
        raise ValueError(f"launch: world_size must be at least 1, got {world_size}")
    backend = backend or backend_for(world_size)
    ctx, payload = _context_and_payload(fn, args, kwargs)
    try:
        return _run_ranks(ctx, payload, world_size, backend, timeout)
    except _MeshSetupFailed:
        # Seen about once in a few thousand launches on a loaded 2-core machine: gloo's full-mesh
        # set-up reports "Connection closed by peer". Nothing of fn has run yet, so start afresh once.
        return _run_ranks(ctx, payload, world_size, backend, timeout)


def _listening_socket() -> socket.socket:
    """A socket bound to a port the OS picks, already listening: rank 0 serves the rendezvous store on it.

    Binding here, before any rank starts, leaves no window in which a concurrent launch (another
    notebook, a parallel test) could take the same port and have the two runs' ranks join each
    other's group.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _run_ranks(ctx: Any, payload: Any, world_size: int, backend: str, timeout: float) -> list[Any]:
    """Start the ranks, collect their reports, and always clean up."""
    procs: list[Any] = []
    readers: list[mpc.Connection] = []
    listener = _listening_socket()
    port = listener.getsockname()[1]
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, backend, port, listener if rank == 0 else None, timeout, payload, writer),
                name=f"course_lib.support.dist rank {rank}",
            )
            readers.append(reader)
            try:
                proc.start()
            finally:
                writer.close()  # the child holds its own copy; ours would only keep the pipe open
            procs.append(proc)
        listener.close()  # rank 0 holds its own copy now
        return _collect(procs, readers, timeout)
    finally:
        listener.close()
        _stop(procs)
        for reader in readers:
            reader.close()


def _collect(procs: list[Any], readers: list[mpc.Connection], timeout: float) -> list[Any]:
    """Replay the ranks' output and wait for their reports; raise on the first failure or at the deadline."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, str, str]] = {}  # rank -> (phase, summary, traceback), in arrival order
    pending = set(range(world_size))
    give_up_at = deadline
    while pending:
        remaining = give_up_at - time.monotonic()
        if remaining <= 0:
            break
        ready = mpc.wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending], remaining)
        for rank in sorted(pending):
            message = _drain(rank, readers[rank])
            if message is None and procs[rank].sentinel in ready:
                procs[rank].join()
                code = procs[rank].exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                message = ("err", "run", f"{how} without reporting a result", "")
            if message is None:
                continue
            pending.discard(rank)
            if message[0] == "ok":
                results[rank] = pickle.loads(message[1])
            else:
                failures[rank] = message[1:]
                # The others are likely blocked in a collective: give them a moment to report, then stop them.
                give_up_at = min(give_up_at, time.monotonic() + _FAILURE_GRACE_S)
    if failures:
        _raise_failures(failures, sorted(pending))
    if pending:
        raise TimeoutError(
            f"launch: rank(s) {sorted(pending)} still running after {timeout:g} s (timeout={timeout:g}); "
            "a rank may be waiting in a collective that another rank never called"
        )
    return [results[r] for r in range(world_size)]


def _drain(rank: int, reader: mpc.Connection) -> tuple | None:
    """Print the rank's pending output lines; return its final report if it has arrived."""
    while reader.poll():
        try:
            message = reader.recv()
        except EOFError:  # the rank exited; its sentinel tells how
            return None
        if message[0] != "out":
            return message
        stream = sys.stdout if message[1] == "stdout" else sys.stderr
        stream.write("".join(f"[rank {rank}] {line}\n" for line in message[2].splitlines()))
        stream.flush()
    return None


def _raise_failures(failures: dict[int, tuple[str, str, str]], still_running: list[int]) -> None:
    """Raise ``RankError`` for the first failing rank, listing the others (``_MeshSetupFailed`` when gloo's set-up broke)."""
    if all(phase == "init" for phase, _, _ in failures.values()) and any(
        "connectFullMesh" in summary for _, summary, _ in failures.values()
    ):
        raise _MeshSetupFailed()
    first = next(iter(failures))
    _, summary, tb = failures[first]
    lines = [f"rank {first} {summary}"]
    others = [r for r in failures if r != first]
    if others:
        # Usually a consequence of the first (a peer's connection closed): one short line each.
        lines.append("also failed: " + "; ".join(f"rank {r} {_shorten(failures[r][1])}" for r in others))
    if still_running:
        lines.append(f"stopped while still running: rank(s) {still_running}")
    if tb:
        lines.append(f"\n--- traceback from rank {first} ---\n{tb.rstrip()}")
    raise RankError("\n".join(lines), list(failures))


def _shorten(text: str, limit: int = 160) -> str:
    """The first line of ``text``, cut to ``limit`` characters."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _stop(procs: list[Any]) -> None:
    """Terminate, then kill, every rank still alive; join and release them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
