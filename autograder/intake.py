"""What the grader reads that a student or a kernel could have made: folder names, plain files, notebooks.

Nothing under SUBMISSIONS or in a submission's scratch folder is trusted:

- a file is read only when it is a regular file, opened without following a link
  (``O_NOFOLLOW``; the folders on the way are opened one at a time the same way), up to a size
  cap, whatever size its metadata claims (a sparse file is refused, never read densely);
- a folder name is a student id only when it is printable UTF-8 text that does not start with
  a dot nor start or end with a space (``id_problem``); the grader never puts it on a command
  line or in a path of its own: ``grade`` works under internal names such as ``s00042``;
- a notebook is parsed and validated in a child process with a memory and a time limit
  (``check_notebook``), never in the grader's own process.

``python -m autograder.intake NOTEBOOK`` is that child: it prints why the notebook cannot be
graded and exits 1, or exits 0.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "MAX_NOTEBOOK_BYTES", "RefusedFile", "TooLarge", "check_notebook", "copy_regular", "id_problem", "main", "open_folder",
    "read_regular", "shown", "write_whole",
]

# A submitted notebook larger than this is not read (the course's solution notebooks are under 100 kB).
MAX_NOTEBOOK_BYTES = 20 * 2**20
# The child that parses a notebook: at most this long, and this much address space.
CHECK_SECONDS = 60
CHECK_MEMORY_BYTES = 2 * 2**30
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 2**20


class RefusedFile(ValueError):
    """A path that is not read: a symbolic link, not a regular file or folder, or changed while it was opened."""


class TooLarge(RefusedFile):
    """A regular file larger than the cap of what is read."""


def open_folder(name: str | Path, dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``name`` (relative to ``dir_fd``), never opened through a link; close it after use."""
    try:
        return os.open(name, _FOLDER_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RefusedFile(f"{shown(str(name))} is a symbolic link or not a folder") from exc
        raise


def read_regular(name: str | Path, max_bytes: int, *, dir_fd: int | None = None, tail: bool = False) -> bytes:
    """The bytes of the regular file ``name`` (relative to ``dir_fd``), opened without following a link.

    Raises RefusedFile for a link or anything but a regular file (which is then never opened),
    and TooLarge for a file over ``max_bytes``; with ``tail``, a larger file is not refused but
    only its last ``max_bytes`` are read. The messages start with ``name``.
    """
    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    what = shown(str(name))
    if stat.S_ISLNK(info.st_mode):
        raise RefusedFile(f"{what} is a symbolic link")
    if not stat.S_ISREG(info.st_mode):
        raise RefusedFile(f"{what} is not a regular file")
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino) or not stat.S_ISREG(opened.st_mode):
            raise RefusedFile(f"{what} changed while it was opened")
        if opened.st_size > max_bytes and not tail:
            raise TooLarge(f"{what} is larger than {max_bytes / 2**20:g} MB")
        data = _read_at_most(fd, max(0, opened.st_size - max_bytes) if tail else 0, max_bytes)
    finally:
        os.close(fd)
    if data is None:
        raise TooLarge(f"{what} is larger than {max_bytes / 2**20:g} MB")
    return data


def _read_at_most(fd: int, start: int, max_bytes: int) -> bytes | None:
    """Up to ``max_bytes`` of ``fd`` from ``start``, or None when there is more (the file grew while it was read)."""
    chunks, size = [], 0
    while size <= max_bytes:
        chunk = os.pread(fd, min(_CHUNK, max_bytes + 1 - size), start + size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return None if size > max_bytes else b"".join(chunks)


def copy_regular(source: Path, target: Path, max_bytes: int) -> None:
    """Copy the regular file ``source`` (read as ``read_regular`` reads it) to ``target``, replacing it whole."""
    write_whole(target, read_regular(source, max_bytes))


def write_whole(path: Path, data: bytes) -> None:
    """Write ``path`` (mode 644) through a fresh temporary file in its folder, renamed over it: never half a file."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:50]}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def shown(name: str) -> str:
    """A folder name as the tables show it: bytes that are not UTF-8 and invisible characters as backslash escapes."""
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def id_problem(name: str) -> str | None:
    """Why a student folder's name cannot be a student id, or None when it can."""
    try:
        os.fsencode(name).decode("utf-8")
    except UnicodeDecodeError:
        return "the folder name is not valid UTF-8"
    if name.startswith("."):
        return "the folder name starts with a dot (a hidden folder)"
    if name != name.strip():
        return "the folder name starts or ends with a space"
    if not name.isprintable():
        return "the folder name holds a control or invisible character"
    return None


def notebook_problem(data: bytes) -> str | None:
    """Why ``data`` is not a notebook the grader can run (JSON, nbformat 4, valid against its schema), or None."""
    import nbformat

    try:
        version = json.loads(data).get("nbformat")
        if version != 4:
            raise ValueError(f"nbformat {version!r} is not supported (the course's notebooks are nbformat 4)")
        nbformat.validate(nbformat.reads(data.decode("utf-8"), as_version=4))
    except Exception as exc:  # any way of not being a notebook: bad encoding, bad JSON, bad schema, too deep, too big
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"not a readable notebook: {type(exc).__name__}: {reason}"
    return None


def check_notebook(path: Path, env: dict[str, str]) -> str | None:
    """``notebook_problem`` of the file ``path``, worked out in a child within CHECK_SECONDS and CHECK_MEMORY_BYTES."""
    command = [sys.executable, "-m", "autograder.intake", str(path)]
    try:
        child = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        return f"not a readable notebook: checking it took longer than {CHECK_SECONDS} s"
    if child.returncode == 0:
        return None
    said = child.stdout.decode("utf-8", "replace").strip().splitlines()
    if child.returncode == 1 and said:
        return said[-1]
    last = (child.stderr.decode("utf-8", "replace").strip().splitlines() or ["no output"])[-1][:200]
    return f"not a readable notebook: its check stopped with status {child.returncode} ({last})"


def main(argv: list[str] | None = None) -> int:
    """The child of ``check_notebook``: print why the notebook cannot be graded and return 1, else return 0."""
    resource.setrlimit(resource.RLIMIT_AS, (CHECK_MEMORY_BYTES, CHECK_MEMORY_BYTES))
    (path,) = sys.argv[1:] if argv is None else argv
    try:
        problem = notebook_problem(read_regular(path, MAX_NOTEBOOK_BYTES))
    except (OSError, RefusedFile) as exc:
        problem = f"not a readable notebook: {exc}"  # the grader checked it: only a change since then gets here
    if problem:
        print(problem)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
