"""The sandbox's kernel command and the grader's refusal to grade without bubblewrap (no notebook runs here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autograder.cli import main
from autograder.sandbox import KernelSandbox, bwrap_supports_size

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


def test_grading_keeps_folders_already_on_jupyter_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # nbconvert finds its feedback templates through JUPYTER_PATH where a package was installed to a
    # prefix of its own; the sandbox kernelspec goes first and those folders stay after it.
    from autograder.worker import trusted_config

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("JUPYTER_PATH", "/opt/templates")
    (tmp_path / "autograded" / "alice" / "00_orientation").mkdir(parents=True)
    trusted_config(tmp_path, root / "solutions", "00_orientation", "alice", sandboxed=False, memory_bytes=None,
                   cell_timeout=60)
    assert os.environ["JUPYTER_PATH"].split(os.pathsep) == [str(tmp_path / "jupyter"), "/opt/templates"]
