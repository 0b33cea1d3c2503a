"""The confinement policy of a submission, decided in one place: how much memory, how many processes, how much disk.

What each limit is and which mechanism enforces it:

- processes and threads (``max_processes``): a pids cgroup per submission (``autograder.sandbox.Cgroup``);
  ``RLIMIT_NPROC`` is no help, since it holds neither for root nor across a user namespace;
- memory (``memory_bytes``): on a CPU machine ``RLIMIT_AS`` on the kernel (a memory bomb gets
  ``MemoryError`` in its own cell); on a GPU machine a memory cgroup, since CUDA reserves huge virtual
  ranges that ``RLIMIT_AS`` would refuse. Never both, never neither (where the machine has the controller);
- disk (``disk_bytes``): the kernel's ``/tmp`` and its working folder are tmpfs of this size each;
  its IPC folder a private tmpfs of ``IPC_BYTES`` (``private_ipc``);
- CPU: every submission's cgroup gets the same weight, and its kernel ``kernel_threads`` threads.

``autograder.sandbox.unenforced_limits`` says which of these a machine cannot enforce.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_DISK_BYTES", "DEFAULT_MAX_PROCESSES", "DEFAULT_MEMORY_BYTES", "IPC_BYTES", "Limits", "uses_gpu"]

# The kernel and what it starts: 4 gloo ranks with their threads fit easily; a fork bomb does not.
DEFAULT_MAX_PROCESSES = 512
DEFAULT_MEMORY_BYTES = 8 * 2**30
# The size of the kernel's /tmp and of its working folder, each (tmpfs: it is memory when used).
DEFAULT_DISK_BYTES = 2**30
# The tmpfs of the kernel's IPC folder: sockets, the connection file and small records only.
IPC_BYTES = 64 * 2**20


def uses_gpu() -> bool:
    """True when an NVIDIA device is present: then memory is limited by a cgroup, never by RLIMIT_AS."""
    return Path("/dev/nvidiactl").exists()


@dataclass(frozen=True)
class Limits:
    """How each submission's kernel is confined, for a run that grades ``jobs`` submissions at once."""

    sandbox: bool = True
    max_processes: int = DEFAULT_MAX_PROCESSES
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    disk_bytes: int = DEFAULT_DISK_BYTES
    jobs: int = 1
    # Whether the kernel's IPC folder is a private tmpfs (``autograder.sandbox.in_private_tmpfs``).
    private_ipc: bool = False

    def __post_init__(self) -> None:
        for name in ("max_processes", "memory_bytes", "disk_bytes", "jobs"):
            if type(getattr(self, name)) is not int or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def kernel_address_space(self) -> int | None:
        """The kernel's ``RLIMIT_AS``: the memory limit on a CPU machine, None on a GPU machine."""
        return None if uses_gpu() else self.memory_bytes

    @property
    def cgroup_memory(self) -> int | None:
        """The memory cgroup's limit: the memory limit on a GPU machine, None on a CPU machine."""
        return self.memory_bytes if uses_gpu() else None

    @property
    def kernel_threads(self) -> int:
        """Threads per kernel (``OMP_NUM_THREADS``): the machine's cores shared among the jobs."""
        return max(1, (os.cpu_count() or 1) // self.jobs)
