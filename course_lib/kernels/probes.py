"""What a Triton kernel does, seen from outside: whether it is written, what it calls, which tiles it computes.

The chapter 10 tests (and its experiments) use these on the student's kernels:

- ``is_written(kernel)``: the kernel's source no longer holds the ``raise NotImplementedError()``
  of a blank exercise (a kernel cannot raise on a GPU, so the Python wrapper asks first);
- ``course_kernels_called(kernel)``: the course_lib Triton functions that the kernel's source
  reaches, directly or through the student's own ``@triton.jit`` helpers, read from the source
  and the names it resolves to (compiled or interpreted alike);
- ``tile_census(head_dim, tile)``: under Triton's CPU interpreter, for each program of the
  launches in the block, how many score tiles it computed (``tl.dot`` calls whose inner dimension
  is ``head_dim``) and in how many of them it applied an element-wise mask (a ``tl.where`` on a
  block of the tile's shape). A causal kernel that skips the tiles above the diagonal and masks
  only the diagonal ones shows it here, whatever the values it returns.

    with tile_census(head_dim=64, tile=(16, 16)) as programs:
        out, lse = flash_forward(q, k, v, causal=True)
    print(sum(p.tiles for p in programs), sum(p.masked for p in programs))
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from course_lib import env

__all__ = ["NOT_WRITTEN", "ProgramTiles", "is_written", "kernel_source", "course_kernels_called", "tile_census"]

NOT_WRITTEN = "raise NotImplementedError()"  # what a released exercise holds until the student writes it


def _python_function(kernel: Any) -> Any:
    """The plain Python function behind a @triton.jit object (autotuned or not), or None."""
    while kernel is not None and not inspect.isfunction(kernel):
        kernel = getattr(kernel, "fn", None)
    return kernel


def kernel_source(kernel: Any) -> str:
    """The source of a @triton.jit function (autotuned or not), dedented."""
    fn = _python_function(kernel)
    if fn is None:
        raise TypeError(f"{kernel!r} is not a @triton.jit function")
    return textwrap.dedent(inspect.getsource(fn))


def is_written(kernel: Any) -> bool:
    """False while the kernel still holds a blank exercise's ``raise NotImplementedError()``."""
    return NOT_WRITTEN not in kernel_source(kernel)


def _resolve(node: ast.AST, scope: dict[str, Any]) -> Any:
    """The object a name or a dotted attribute chain of the source refers to (None when unknown)."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return None if base is None else getattr(base, node.attr, None)
    return None


def course_kernels_called(kernel: Any) -> list[str]:
    """``module.name`` of each course_lib @triton.jit function that ``kernel``'s source refers to, following its own helpers."""
    found: set[str] = set()
    seen: set[int] = set()
    todo = [kernel]
    while todo:
        fn = _python_function(todo.pop())
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        closure = inspect.getclosurevars(fn)
        scope = {**fn.__globals__, **closure.nonlocals}
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if not isinstance(node, ast.Name | ast.Attribute):
                continue
            target = _resolve(node, scope)
            inner = _python_function(target) if target is not None and hasattr(target, "fn") else None
            if inner is None:
                continue
            if inner.__module__.startswith("course_lib."):
                found.add(f"{inner.__module__}.{inner.__name__}")
            else:
                todo.append(target)
    return sorted(found)


@dataclass
class ProgramTiles:
    """One program of a launch watched by ``tile_census``: its grid index and what it computed."""

    program: tuple[int, int, int]
    dots: int = 0  # tl.dot calls over head_dim
    masked_dots: set[int] = field(default_factory=set)  # indices of those dots after which a tile-shaped select ran
    dots_per_tile: int = 1

    @property
    def tiles(self) -> int:
        """Score tiles computed: dots over head_dim, divided by the dots each tile needs."""
        return -(-self.dots // self.dots_per_tile)

    @property
    def masked(self) -> int:
        """Tiles in which an element-wise mask (a select on a tile-shaped block) ran."""
        return len({i // self.dots_per_tile for i in self.masked_dots})


@contextlib.contextmanager
def tile_census(head_dim: int, tile: tuple[int, int], dots_per_tile: int = 1) -> Iterator[list[ProgramTiles]]:
    """Under the interpreter: one ``ProgramTiles`` per program launched in the block, in launch order.

    A tile is counted at each ``tl.dot`` whose inner dimension is ``head_dim`` (``dots_per_tile`` of
    them per tile: 1 for a forward's Q K^T, 2 for a backward that also forms dO V^T); it is masked
    when a ``tl.where`` on a block of shape ``tile`` (or its transpose) runs while it is the current
    tile. Pick a ``head_dim`` that differs from the inner dimension of the other products (BLOCK_N for
    the forward's P V, BLOCK_M for the backward's P^T dO and dS^T Q), so that they are not counted.
    """
    if not env.INTERPRET:
        raise RuntimeError("tile_census watches Triton's CPU interpreter; compiled kernels cannot be watched this way")
    from triton.runtime.interpreter import interpreter_builder as builder

    programs: list[ProgramTiles] = []
    shapes = {tuple(tile), tuple(tile)[::-1]}
    set_grid_idx, create_dot, create_select = builder.set_grid_idx, builder.create_dot, builder.create_select

    def on_program(x: int, y: int, z: int) -> None:
        programs.append(ProgramTiles((x, y, z), dots_per_tile=dots_per_tile))
        set_grid_idx(x, y, z)

    def on_dot(a: Any, b: Any, *rest: Any) -> Any:
        if programs and a.data.shape[-1] == head_dim:
            programs[-1].dots += 1
        return create_dot(a, b, *rest)

    def on_select(cond: Any, lhs: Any, rhs: Any) -> Any:
        if programs and programs[-1].dots and tuple(cond.data.shape) in shapes:
            programs[-1].masked_dots.add(programs[-1].dots - 1)
        return create_select(cond, lhs, rhs)

    builder.set_grid_idx, builder.create_dot, builder.create_select = on_program, on_dot, on_select
    try:
        yield programs
    finally:
        for name in ("set_grid_idx", "create_dot", "create_select"):
            builder.__dict__.pop(name, None)
