"""The sandbox of a grading kernel: bubblewrap for the file system and network, a cgroup for processes and memory.

A submission's kernel runs as ``bwrap ... python -m autograder.kernel -f CONNECTION_FILE``:

- file system: read-only binds of the system (``/usr``, ``/lib*``, a few ``/etc`` files), the
  Python environment and the installed ``course_lib`` and ``autograder`` packages, nothing else;
  writable: the notebook's own folder (a private copy in the scratch course) and the folder of
  the kernel's IPC sockets; ``/tmp`` is an empty private tmpfs. solutions/, the gradebook, other
  submissions and the grader's outputs are not in the sandbox at all.
- network: ``--unshare-net`` (only the sandbox's own loopback, which gloo ranks use);
- processes: ``--unshare-pid`` and ``--die-with-parent``: when the grader kills bwrap, every
  process of the submission dies with it; environment cleared (``NBGRADER_EXECUTION`` never
  reaches the kernel);
- limits: a pids cgroup (process and thread count) and, where a GPU is used, a memory cgroup;
  on a CPU the kernel also sets ``RLIMIT_AS`` on itself (see ``autograder.kernel``).
  ``RLIMIT_NPROC`` is no help here: it is not enforced for root, nor across a user namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KERNEL_NAME = "autograder-sandbox"
# The kernel and what it starts: 4 gloo ranks with their threads fit easily; a fork bomb does not.
DEFAULT_MAX_PROCESSES = 512
DEFAULT_MEMORY_BYTES = 8 * 2**30
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


def uses_gpu() -> bool:
    """True when an NVIDIA device is present: then memory is limited by a cgroup, never by RLIMIT_AS."""
    return Path("/dev/nvidiactl").exists()


def _python_roots() -> list[Path]:
    """The folders the kernel's Python needs: the environment, its base interpreter, the installed packages."""
    import autograder
    import course_lib

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

    def argv(self) -> list[str]:
        """The kernelspec argv (``{connection_file}`` is filled in by jupyter_client)."""
        kernel = [sys.executable, "-m", "autograder.kernel", "-f", "{connection_file}"]
        if not self.sandboxed:
            return kernel
        args = [bwrap_path() or "bwrap", "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts", "--new-session", "--clearenv", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for folder in _SYSTEM_DIRS:
            args += ["--ro-bind-try", folder, folder]
        for name in _ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for root in _python_roots():
            args += ["--ro-bind", str(root), str(root)]
        if uses_gpu():
            for device in (*_NVIDIA_DEVICES, *sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))):
                args += ["--dev-bind-try", device, device]
        for folder in (self.notebook_dir, self.ipc_dir):
            args += ["--bind", str(folder), str(folder)]
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
    """A cgroup (v2, or v1 pids/memory controllers) that limits a submission's processes and, optionally, memory."""

    def __init__(self, name: str, max_processes: int, memory_bytes: int | None):
        self.dirs: list[Path] = []
        unified = CGROUP_ROOT / "cgroup.controllers"
        if unified.is_file():
            self._make(CGROUP_ROOT / _own_v2_path() / name, {"pids.max": max_processes, "memory.max": memory_bytes})
        else:
            self._make(CGROUP_ROOT / "pids" / _own_v1_path("pids") / name, {"pids.max": max_processes})
            if memory_bytes:
                self._make(CGROUP_ROOT / "memory" / _own_v1_path("memory") / name,
                           {"memory.limit_in_bytes": memory_bytes})

    def _make(self, folder: Path, limits: dict[str, int | None]) -> None:
        """Create ``folder`` and write its limits; silently skip what the machine does not allow."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return
        self.dirs.append(folder)
        for key, value in limits.items():
            if value is not None and (folder / key).exists():
                (folder / key).write_text(str(value))

    @property
    def limits_processes(self) -> bool:
        """Whether a pids limit is in place."""
        return any((d / "pids.max").exists() for d in self.dirs)

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
        """Kill every process in the cgroup, then remove it."""
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
