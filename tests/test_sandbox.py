"""The sandbox's kernel command and the grader's refusal to grade without bubblewrap (no notebook runs here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autograder import limits as limits_module
from autograder.cli import main
from autograder.contracts import WorkerArgs
from autograder.limits import Limits
from autograder.sandbox import KernelSandbox, bwrap_supports_size
from autograder.worker import trusted_config

ROOT = Path(__file__).resolve().parents[1]


def test_grade_refuses_without_bubblewrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "subs" / "alice" / "00_orientation").mkdir(parents=True)
    (tmp_path / "subs" / "alice" / "00_orientation" / "00_orientation.ipynb").write_text("{}")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    status = main(["grade", str(tmp_path / "subs"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and "bubblewrap" in err and "--no-sandbox" in err
    assert not (tmp_path / "out").exists(), "nothing should be graded or written"


def test_kernel_command_binds_only_what_the_kernel_needs(tmp_path: Path) -> None:
    notebook_dir, ipc_dir = tmp_path / "autograded" / "alice" / "00_orientation", tmp_path / "ipc"
    argv = KernelSandbox(notebook_dir, ipc_dir, {"HOME": "/tmp"}).argv()
    for flag in ("--unshare-net", "--unshare-pid", "--die-with-parent", "--clearenv"):
        assert flag in argv
    writable = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert writable == [str(ipc_dir)], "only the IPC folder is bound writable: nothing else reaches the host's disk"
    tmpfs = [argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"]
    assert tmpfs == ["/tmp", str(notebook_dir)] and argv[argv.index("--chdir") + 1] == str(notebook_dir)
    if bwrap_supports_size():
        assert all(argv[i - 2] == "--size" for i, a in enumerate(argv) if a == "--tmpfs"), "each tmpfs has a size"
    bound = [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--ro-bind-try", "--bind")]
    assert "/" not in bound and str(ROOT) not in bound
    assert not any(Path(b).is_relative_to(ROOT / "solutions") or Path(b) == ROOT / "notebooks" for b in bound)
    assert argv[argv.index("--") + 1:][-3:] == ["autograder.kernel", "-f", "{connection_file}"]
    records = str(ROOT / "benchmarks" / "results")
    assert any(argv[i:i + 3] == ["--ro-bind-try", records, records] for i in range(len(argv))), \
        "the committed GPU records the notebooks render are readable, read-only"


def test_grading_keeps_folders_already_on_jupyter_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # nbconvert finds its feedback templates through JUPYTER_PATH where a package was installed to a
    # prefix of its own; the sandbox kernelspec goes first and those folders stay after it.
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("JUPYTER_PATH", "/opt/templates")
    (tmp_path / "autograded" / "alice" / "00_orientation").mkdir(parents=True)
    trusted_config(WorkerArgs(tmp_path, root / "solutions", "00_orientation", "alice", 60, tmp_path / "result.json",
                              2**20, sandboxed=False))
    assert os.environ["JUPYTER_PATH"].split(os.pathsep) == [str(tmp_path / "jupyter"), "/opt/templates"]


def test_each_memory_limit_has_one_mechanism_on_each_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = Limits(memory_bytes=3 * 2**30, jobs=2)
    monkeypatch.setattr(limits_module, "uses_gpu", lambda: False)
    assert (limits.kernel_address_space, limits.cgroup_memory) == (3 * 2**30, None), "CPU: RLIMIT_AS on the kernel"
    monkeypatch.setattr(limits_module, "uses_gpu", lambda: True)
    assert (limits.kernel_address_space, limits.cgroup_memory) == (None, 3 * 2**30), "GPU: the memory cgroup only"
    assert limits.kernel_threads == max(1, (os.cpu_count() or 1) // 2)


@pytest.mark.parametrize("field", ["max_processes", "memory_bytes", "disk_bytes", "jobs"])
def test_limits_refuse_what_cannot_be_a_limit(field: str) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=field):
            Limits(**{field: bad})


def test_the_kernel_sandbox_gets_the_disk_size_it_is_given(tmp_path: Path) -> None:
    argv = KernelSandbox(tmp_path / "nb", tmp_path / "ipc", {}, disk_bytes=12345).argv()
    if bwrap_supports_size():
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--size"] == ["12345", "12345"]
    else:
        assert "--size" not in argv
