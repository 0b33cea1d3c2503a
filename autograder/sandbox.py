"""The sandbox of a grading kernel: bubblewrap for the file system and network, a cgroup for processes, CPU and memory.

A submission's kernel runs as ``bwrap ... python -m autograder.kernel -f CONNECTION_FILE``:

- file system: read-only binds of the system (``/usr``, ``/lib*``, a few ``/etc`` files), the
  Python environment, the installed ``course_lib`` and ``autograder`` packages and the committed
  GPU records (``benchmarks/results``), nothing else.
  The working folder (the notebook's folder, as nbgrader expects) and ``/tmp`` are private
  tmpfs of ``--size`` bytes each: nothing the kernel writes there reaches the host's disk, and
  nothing is ever copied out. The one folder bound writable is the one of the kernel's IPC
  sockets, which the grader mounts as a small tmpfs of its own (``in_private_tmpfs``).
  solutions/, the gradebook, other submissions and the grader's outputs are not in the sandbox.
- network: ``--unshare-net`` (only the sandbox's own loopback, which gloo ranks use);
- processes: ``--unshare-pid`` and ``--die-with-parent``: when the grader kills bwrap, every
  process of the submission dies with it; environment cleared (``NBGRADER_EXECUTION`` never
  reaches the kernel);
- limits: a cgroup per submission with a pids limit (process and thread count), a CPU weight
  (the submission's processes share the CPU as one, however many they start or whichever
  session they move to) and, where a GPU is used, a memory limit. The policy (which limit, by
  which mechanism, on which machine) is ``autograder.limits``; ``unenforced_limits`` says which
  of these a machine cannot enforce.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import autograder
import course_lib
from course_lib.support.records import RESULTS

from .limits import DEFAULT_DISK_BYTES, Limits, uses_gpu

__all__ = [
    "KERNEL_NAME", "Cgroup", "KernelSandbox", "SandboxUnavailable", "bwrap_path", "bwrap_supports_size", "check_available",
    "in_private_tmpfs", "kernel_environment", "private_tmpfs_available", "unenforced_limits",
]

KERNEL_NAME = "autograder-sandbox"
# Every submission's cgroup gets the default weight: submissions share the CPU equally, each as one.
CPU_WEIGHT_V2, CPU_SHARES_V1 = 100, 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("ld.so.cache", "passwd", "group", "nsswitch.conf", "hosts", "localtime", "fonts", "ssl", "alternatives")
# What ``--dev`` provides is enough on a CPU; on a GPU these device files are passed through too.
_NVIDIA_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


class SandboxUnavailable(RuntimeError):
    """bubblewrap is not installed (or cannot create namespaces) and ``--no-sandbox`` was not given."""


def bwrap_path() -> str | None:
    """The bwrap executable, or None."""
    return shutil.which("bwrap")


def check_available() -> None:
    """Raise SandboxUnavailable, saying how to fix it, unless bwrap is installed."""
    if bwrap_path() is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed, so submissions cannot be sandboxed. Install it "
            "(Debian/Ubuntu: apt-get install bubblewrap) or, only for trusted notebooks, pass --no-sandbox."
        )


@lru_cache(maxsize=1)
def bwrap_supports_size() -> bool:
    """Whether this bwrap has ``--size`` (a size limit for ``--tmpfs``)."""
    path = bwrap_path()
    if path is None:
        return False
    result = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
    return "--size" in result.stdout + result.stderr


def in_private_tmpfs(folder: Path, size: int, command: list[str]) -> list[str]:
    """``command`` run in a mount namespace of its own, with a fresh tmpfs of ``size`` bytes on ``folder``.

    The tmpfs is seen by the command and what it starts, never by the host's disk, and it is
    gone when they have all exited.
    """
    script = 'mount -t tmpfs -o "size=$1,mode=0700,nosuid,nodev" tmpfs "$2" && shift 2 && exec "$@"'
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh", str(size), str(folder),
            *command]


@lru_cache(maxsize=1)
def private_tmpfs_available() -> bool:
    """Whether ``in_private_tmpfs`` works here (util-linux ``unshare`` and the right to mount)."""
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="autograder-probe-") as folder:
        try:
            probe = subprocess.run(in_private_tmpfs(Path(folder), 2**20, ["true"]), capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return probe.returncode == 0


def unenforced_limits(limits: Limits) -> list[str]:
    """The limits this machine cannot enforce, a sentence each (none when every limit holds)."""
    missing = []
    sandboxed = limits.sandbox
    probe = Cgroup(f"autograder-probe-{os.getpid()}", limits.max_processes, limits.cgroup_memory)
    try:
        if not probe.limits_processes:
            missing.append("no writable pids cgroup controller (cgroup v1 pids, or v2 with pids delegated): the "
                           "process limit (--max-processes) does not hold, so a fork bomb can exhaust the machine")
        if not probe.limits_cpu:
            missing.append("no writable cpu cgroup controller (cgroup v1 cpu, or v2 with cpu delegated): a "
                           "submission's processes are not held to one CPU share, so a CPU hog slows its neighbours")
        if uses_gpu() and not probe.limits_memory:
            missing.append("no writable memory cgroup controller on this GPU machine: the memory limit (--memory-gb) "
                           "does not hold")
    finally:
        probe.kill_and_remove()
    if sandboxed and not bwrap_supports_size():
        missing.append("this bubblewrap has no --size option: the kernel's /tmp and working folder are not "
                       "size-limited (--disk-gb does not hold; each may grow to half the memory)")
    if sandboxed and not private_tmpfs_available():
        missing.append("cannot mount a private tmpfs for the kernel's IPC folder (needs util-linux unshare and the "
                       "right to mount): that folder is on the scratch disk, and a submission can fill it")
    return missing


def _python_roots() -> list[Path]:
    """The folders the kernel's Python needs: the environment, its base interpreter, the installed packages."""
    roots = {Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent.parent}
    roots |= {Path(course_lib.__file__).resolve().parent, Path(autograder.__file__).resolve().parent}
    return sorted(roots)


@dataclass(frozen=True)
class KernelSandbox:
    """The kernel command of one submission: what it may write, and its limits."""

    notebook_dir: Path
    ipc_dir: Path
    env: dict[str, str]
    sandboxed: bool = True
    disk_bytes: int = DEFAULT_DISK_BYTES  # the size of its /tmp and of its working folder, each

    def argv(self) -> list[str]:
        """The kernelspec argv (``{connection_file}`` is filled in by jupyter_client)."""
        kernel = [sys.executable, "-m", "autograder.kernel", "-f", "{connection_file}"]
        if not self.sandboxed:
            return kernel
        size = ["--size", str(self.disk_bytes)] if bwrap_supports_size() else []
        args = [bwrap_path() or "bwrap", "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts", "--new-session", "--clearenv", "--proc", "/proc", "--dev", "/dev",
                *size, "--tmpfs", "/tmp"]
        for folder in _SYSTEM_DIRS:
            args += ["--ro-bind-try", folder, folder]
        for name in _ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for root in _python_roots():
            args += ["--ro-bind", str(root), str(root)]
        # The committed GPU records the notebooks render their "on a GPU" figures from: plain data.
        args += ["--ro-bind-try", str(RESULTS), str(RESULTS)]
        if uses_gpu():
            for device in (*_NVIDIA_DEVICES, *sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))):
                args += ["--dev-bind-try", device, device]
        # The working folder is an empty tmpfs over the notebook's folder: the kernel never sees or writes the host's.
        args += [*size, "--tmpfs", str(self.notebook_dir), "--bind", str(self.ipc_dir), str(self.ipc_dir)]
        for key, value in sorted(self.env.items()):
            args += ["--setenv", key, value]
        return [*args, "--chdir", str(self.notebook_dir), "--", *kernel]

    def write_kernelspec(self, jupyter_path: Path) -> None:
        """Write the kernelspec ``KERNEL_NAME`` under ``jupyter_path/kernels/``."""
        spec = jupyter_path / "kernels" / KERNEL_NAME
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": self.argv(), "display_name": "Python 3 (autograder sandbox)", "language": "python",
            # bwrap does not pass SIGINT on: interrupt a timed-out cell with a message the kernel handles itself.
            "interrupt_mode": "message",
            "env": {} if self.sandboxed else self.env,
        }, indent=1), encoding="utf-8")


def kernel_environment(base: dict[str, str]) -> dict[str, str]:
    """The variables a sandboxed kernel gets: paths, thread counts, locale; no grader or Jupyter variables."""
    keep = ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "TORCH_BUILD")
    env = {k: base[k] for k in keep if k in base}
    env.update(HOME="/tmp", MPLCONFIGDIR="/tmp/matplotlib", PYTHONDONTWRITEBYTECODE="1")
    return env


class Cgroup:
    """A cgroup (v2, or the v1 pids, cpu and memory controllers) that holds a submission's processes.

    It limits their number, gives them one CPU share together (a child that starts a session of
    its own stays in the cgroup) and, optionally, limits their memory; killing it kills them all.
    """

    def __init__(self, name: str, max_processes: int, memory_bytes: int | None):
        self.dirs: list[Path] = []
        if (CGROUP_ROOT / "cgroup.controllers").is_file():
            parent = CGROUP_ROOT / _own_v2_path()
            _delegate(parent, ["pids", "cpu"] + ["memory"] * bool(memory_bytes))
            self._make(parent / name,
                       {"pids.max": max_processes, "cpu.weight": CPU_WEIGHT_V2, "memory.max": memory_bytes})
        else:
            self._make(CGROUP_ROOT / "pids" / _own_v1_path("pids") / name, {"pids.max": max_processes})
            self._make(CGROUP_ROOT / "cpu" / _own_v1_path("cpu") / name, {"cpu.shares": CPU_SHARES_V1})
            if memory_bytes:
                self._make(CGROUP_ROOT / "memory" / _own_v1_path("memory") / name,
                           {"memory.limit_in_bytes": memory_bytes})

    def _make(self, folder: Path, limits: dict[str, int | None]) -> None:
        """Create ``folder`` in the cgroup above it and write its limits; silently skip what the machine refuses."""
        if not (folder.parent / "cgroup.procs").is_file():  # not a cgroup hierarchy: create nothing there
            return
        try:
            folder.mkdir(exist_ok=True)
        except OSError:
            return
        self.dirs.append(folder)
        for key, value in limits.items():
            if value is not None and (folder / key).exists():
                try:
                    (folder / key).write_text(str(value))
                except OSError:
                    continue

    def _has(self, *files: str) -> bool:
        """Whether one of the cgroup's folders has one of these control files (its controller is in place)."""
        return any((d / f).exists() for d in self.dirs for f in files)

    @property
    def limits_processes(self) -> bool:
        """Whether a pids limit is in place."""
        return self._has("pids.max")

    @property
    def limits_cpu(self) -> bool:
        """Whether the processes share the CPU as one (a cpu controller is in place)."""
        return self._has("cpu.weight", "cpu.shares")

    @property
    def limits_memory(self) -> bool:
        """Whether a memory limit is in place."""
        return self._has("memory.max", "memory.limit_in_bytes")

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and so what it starts later) into the cgroup."""
        for folder in self.dirs:
            try:
                (folder / "cgroup.procs").write_text(str(pid))
            except OSError:
                continue

    def pids(self) -> set[int]:
        """Every process in the cgroup."""
        found: set[int] = set()
        for folder in self.dirs:
            try:
                found |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
            except OSError:
                continue
        return found

    def kill_and_remove(self) -> None:
        """Kill every process in the cgroup (at once where cgroup v2 has ``cgroup.kill``), then remove it."""
        for folder in self.dirs:
            if (folder / "cgroup.kill").exists():
                try:
                    (folder / "cgroup.kill").write_text("1")
                except OSError:
                    continue
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
            time.sleep(0.05)
        for folder in self.dirs:
            try:
                folder.rmdir()
            except OSError:
                continue


def _delegate(parent: Path, controllers: list[str]) -> None:
    """Enable ``controllers`` for the children of the cgroup v2 ``parent``, where the machine lets this process."""
    for controller in controllers:
        try:
            (parent / "cgroup.subtree_control").write_text(f"+{controller}")
        except OSError:
            continue


def _own_v2_path() -> str:
    """This process's cgroup v2 path, relative to the root."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:].lstrip("/")
    return ""


def _own_v1_path(controller: str) -> str:
    """This process's cgroup v1 path for ``controller``, relative to that hierarchy's root."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path.lstrip("/")
    return ""
