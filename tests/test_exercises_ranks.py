"""course_lib.exercises.ranks: what a test that runs student code in gloo ranks reports, plainly, by rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.exercises.checks import NotDoneYet, call
from course_lib.exercises.ranks import launch_checked, launch_on_cpu
from course_lib.support.dist import RankError


def _unfinished() -> None:
    raise NotImplementedError()


class Unfinished(torch.autograd.Function):
    """An exercise whose backward is still the stub."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError()


def _unfinished_backward() -> None:
    Unfinished.apply(torch.ones(2, requires_grad=True)).sum().backward()


def _called_unfinished() -> None:
    call(_unfinished)


def _wrong() -> None:
    assert dist.get_rank() == 0, "only rank 0 is right"


def _crash() -> None:
    raise ValueError("boom")


def _torch_says_why() -> None:
    raise NotImplementedError("this op has no gloo kernel")


def test_launch_checked_reports_plainly() -> None:
    with pytest.raises(NotDoneYet, match=r"^_unfinished is not implemented yet: .* \(raised in rank 0\)$"):
        launch_checked(_unfinished, 2)
    with pytest.raises(NotDoneYet, match=r"^Unfinished.backward is not implemented yet"):
        launch_checked(_unfinished_backward, 2)
    with pytest.raises(NotDoneYet, match=r"^_unfinished is not implemented yet: .* \(raised in rank 0\)$"):
        launch_checked(_called_unfinished, 2)
    with pytest.raises(NotDoneYet, match=r"^this op has no gloo kernel \(raised in rank 0\)$"):
        launch_checked(_torch_says_why, 2)
    with pytest.raises(AssertionError, match="rank 1 of 2: only rank 0 is right"):
        launch_checked(_wrong, 2)
    with pytest.raises(RankError, match="boom"):
        launch_checked(_crash, 2)
    assert launch_checked(dist.get_rank, 2) == [0, 1]


def _backend_and_size(module: nn.Module) -> tuple[str, int]:
    return dist.get_backend(), sum(p.numel() for p in module.parameters())


def test_launch_on_cpu_uses_gloo_and_reports_the_same_way() -> None:
    assert launch_on_cpu(_backend_and_size, 2, nn.Linear(3, 2)) == [("gloo", 8), ("gloo", 8)]
    with pytest.raises(NotDoneYet, match="raised in rank 0"):
        launch_on_cpu(_unfinished, 2)
    with pytest.raises(AssertionError, match="rank 1 of 2"):
        launch_on_cpu(_wrong, 2)
