"""Tests of course_lib.support.launches (watching Triton launches and PyTorch operators) and of the
Triton exercises' judge in course_lib.exercises.kernels, on the interpreter (CPU) and compiled (GPU)."""

import math

import pytest
import torch

from course_lib import env  # first: without a GPU it selects Triton's interpreter before triton is imported

# isort: split
import triton
import triton.language as tl

from course_lib.exercises.kernels import check_kernel_work, launch_evidence
from course_lib.kernels import fusion
from course_lib.support.launches import watch_launches, watch_torch

DEV = env.DEVICE


@triton.jit
def _add_no_mask(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


@triton.jit
def _add_before_start(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK) - 1  # off by one, downwards
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets >= 0, other=0.0), mask=offsets < n)


@triton.jit
def _scale_in_place(x_ptr, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


def _vectors(n=100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(DEV), torch.randn(n, generator=gen).to(DEV)


# ---- watch_launches -------------------------------------------------------------------------------

def test_launches_are_recorded_with_grid_scalars_and_storages():
    x, y = _vectors()
    with watch_launches() as launches:
        out = fusion.add(x, y, block_size=32)
        fusion.softmax(x.reshape(4, 25))
    assert [launch.name for launch in launches] == ["_add_kernel", "_softmax_fwd_rows_kernel"]
    add = launches[0]
    assert add.grid == (4,) and add.scalars["n"] == 100 and add.scalars["BLOCK"] == 32
    assert add.storages == tuple(t.untyped_storage().data_ptr() for t in (x, y, out))
    assert add.wrote_past_end == ()
    torch.testing.assert_close(out, x + y)


def test_a_callable_grid_is_evaluated_with_the_launch_arguments():
    x, y = _vectors(50)
    out = torch.empty_like(x)
    with watch_launches() as launches:
        fusion._add_kernel[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, y, out, 50, BLOCK=16)
    assert launches[0].grid == (4,)


def test_the_launch_path_is_restored_after_the_block_even_on_an_error():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    before = (JITFunction.__dict__.get("run"), InterpretedFunction.__dict__.get("run"))
    with pytest.raises(RuntimeError), watch_launches():
        raise RuntimeError("boom")
    assert (JITFunction.__dict__.get("run"), InterpretedFunction.__dict__.get("run")) == before
    x, y = _vectors(10)
    with watch_launches() as launches:
        pass
    fusion.add(x, y)
    assert launches == []


def test_guard_bytes_catch_a_missing_mask_and_keep_the_results():
    x, y = _vectors()
    out = torch.empty_like(x)
    with watch_launches(guard=True) as launches:
        _add_no_mask[(2,)](x, y, out, 100, BLOCK=64)
    assert launches[0].wrote_past_end == ("out_ptr",)
    torch.testing.assert_close(out, x + y)  # the 100 elements were copied back


def test_guard_bytes_catch_a_write_before_the_start():
    x, _ = _vectors(64)
    out = torch.empty_like(x)
    with watch_launches(guard=True) as launches:
        _add_before_start[(1,)](x, out, 64, BLOCK=64)
    assert launches[0].wrote_past_end == ("out_ptr",)


def test_guarded_in_place_updates_and_aliases_survive():
    x, _ = _vectors(70)
    expected = x * 3
    view = x[10:]  # an argument that is a view with an offset into its storage
    with watch_launches(guard=True) as launches:
        _scale_in_place[(triton.cdiv(60, 16),)](view, 60, 3.0, BLOCK=16)
    assert launches[0].wrote_past_end == ()
    torch.testing.assert_close(x[10:], expected[10:])
    torch.testing.assert_close(x[:10], expected[:10] / 3)


def test_skipped_launches_fill_their_outputs_with_nan_and_keep_the_inputs():
    x, y = _vectors()
    x0, y0 = x.clone(), y.clone()
    with watch_launches(run=False, keep=(x, y)) as launches:
        out = fusion.add(x, y)
    assert len(launches) == 1 and bool(torch.isnan(out).all())
    assert torch.equal(x, x0) and torch.equal(y, y0)


# ---- watch_torch ---------------------------------------------------------------------------------

def test_torch_work_counts_arithmetic_on_large_tensors_only():
    x, y = _vectors()
    with watch_torch(min_numel=100) as work:
        z = x + y
        (z.reshape(10, 10).t().contiguous() * 2).sum()  # a view, then a copy and arithmetic
        torch.empty_like(x)  # an allocation: free
        torch.zeros(3) + 1  # small
    assert work.ops == ["aten.add", "aten.clone", "aten.mul", "aten.sum"]
    assert work.calls["aten.add"] == 1 and work.largest["aten.add"] == 100


def test_torch_work_ignores_what_runs_inside_a_launch_and_poisons_allocations():
    x, y = _vectors()
    with watch_launches(), watch_torch(min_numel=1) as work:
        out = fusion.add(x, y)
        fresh = torch.empty(5, device=DEV)
        ints = torch.empty(5, dtype=torch.int64, device=DEV)
    assert work.ops == []
    torch.testing.assert_close(out, x + y)
    assert bool(torch.isnan(fresh).all()) and ints.dtype == torch.int64


# ---- launch_evidence and check_kernel_work ------------------------------------------------------

def _evidence_of_add(add_fn, n=100, **kwargs):
    x, y = _vectors(n)
    return launch_evidence(add_fn, x, y, kernels={"add_kernel": fusion._add_kernel}, **kwargs)


def test_the_reference_wrappers_pass():
    check_kernel_work(_evidence_of_add(fusion.add, block_size=64), "add", "add_kernel")
    x = torch.randn(3, 37, device=DEV)
    evidence = launch_evidence(fusion.softmax, x, kernels={"softmax": fusion._softmax_fwd_rows_kernel})
    check_kernel_work(evidence, "softmax", "softmax")
    torch.testing.assert_close(evidence["result"], torch.softmax(x, -1))
    p, g, m, v = (torch.randn(300, device=DEV) for _ in range(4))
    v = v.abs()

    def step(p, g, m, v):
        fusion.adam_step_(p, g, m, v, step=2, lr=1e-2, weight_decay=0.1, block_size=128)
        return p, m, v

    evidence = launch_evidence(step, p, g, m, v, kernels={"adam": fusion._adam_kernel})
    check_kernel_work(evidence, "adam", "adam", in_place=(0, 2, 3))


def _add_then(after):
    def add(x, y):
        out = torch.empty_like(x)
        fusion._add_kernel[(triton.cdiv(x.numel(), 64),)](x, y, out, x.numel(), BLOCK=64)
        return after(x, y, out)
    return add


@pytest.mark.parametrize("add_fn, message", [
    (_add_then(lambda x, y, out: x + y), "computed in PyTorch outside add_kernel: aten.add"),
    (lambda x, y: x + y, "never launched add_kernel"),
    (lambda x, y: (fusion.add(x, y), fusion.add(x, y))[1], "launched add_kernel 2 times"),
    (_add_then(lambda x, y, out: out.clone()), "computed in PyTorch outside add_kernel: aten.clone"),
    (_add_then(lambda x, y, out: x.add_(1)), "computed in PyTorch outside add_kernel: aten.add_"),
])
def test_wrappers_that_skip_the_kernel_fail(add_fn, message):
    with pytest.raises(AssertionError, match=message):
        check_kernel_work(_evidence_of_add(add_fn), "add", "add_kernel")


def test_a_missing_mask_fails_and_other_kernels_are_named():
    def add(x, y):
        out = torch.empty_like(x)
        _add_no_mask[(2,)](x, y, out, x.numel(), BLOCK=64)
        return out

    x, y = _vectors()
    evidence = launch_evidence(add, x, y, kernels={"add_kernel": _add_no_mask})
    with pytest.raises(AssertionError, match="add_kernel wrote past an end of out_ptr"):
        check_kernel_work(evidence, "add", "add_kernel")
    with pytest.raises(AssertionError, match="it launched _add_no_mask instead"):
        check_kernel_work(launch_evidence(add, x, y, kernels={}), "add", "add_kernel")


def test_a_result_not_written_by_the_kernel_fails():
    def add(x, y):  # the kernel writes a scratch buffer; the result is a small op on the inputs' sizes
        out = torch.empty_like(x)
        fusion._add_kernel[(2,)](x, y, out, x.numel(), BLOCK=64)
        return torch.full_like(x, 1.0)

    with pytest.raises(AssertionError, match="not a buffer add_kernel was launched with"):
        check_kernel_work(_evidence_of_add(add), "add", "add_kernel")


def test_a_mutated_input_and_an_unwritten_element_show():
    def add(x, y):
        out = torch.empty_like(x)
        fusion._add_kernel[(1,)](x, y, out, x.numel() - 1, BLOCK=128)  # the last element is never written
        return out

    evidence = _evidence_of_add(add)
    check_kernel_work(evidence, "add", "add_kernel")  # the launch itself is fine ...
    assert math.isnan(evidence["result"][-1].item())  # ... but the value check sees the NaN left there

    def in_place(x, y):
        fusion._add_kernel[(2,)](x, y, x, x.numel(), BLOCK=64)
        return x

    with pytest.raises(AssertionError, match="changed x in place"):
        check_kernel_work(_evidence_of_add(in_place), "add", "add_kernel", input_names=("x", "y"))


def test_a_not_implemented_exercise_is_reported_as_not_done():
    def add(x, y):
        raise NotImplementedError()

    with pytest.raises(AssertionError, match="add is not implemented yet"):
        _evidence_of_add(add)


def test_saved_tensors_are_recorded():
    logits, targets = torch.randn(4, 50, device=DEV), torch.tensor([1, 2, 3, -100], device=DEV)

    def loss_and_grad(logits, targets):
        logits.requires_grad_(True)
        loss = fusion.cross_entropy(logits, targets, block_size=32)
        return loss.detach(), torch.autograd.grad(loss, logits)[0]

    evidence = launch_evidence(loss_and_grad, logits, targets, saved=True,
                               kernels={"bwd": fusion._cross_entropy_bwd_kernel})
    check_kernel_work(evidence, "cross_entropy", "bwd", other_launches=1, from_launch=(1,))
    assert [200, True] in evidence["saved"]  # the logits, saved as they are
    assert max(numel for numel, is_input in evidence["saved"] if not is_input) == 4  # lse, not probabilities


@pytest.mark.gpu
def test_compiled_launches_are_watched_and_guarded():
    x, y = (torch.randn(1000, device="cuda") for _ in range(2))
    out = torch.empty_like(x)
    with watch_launches(guard=True) as launches:
        _add_no_mask[(8,)](x, y, out, 1000, BLOCK=128)
        fusion.add(x, y)
    assert [launch.name for launch in launches] == ["_add_no_mask", "_add_kernel"]
    assert launches[0].wrote_past_end == ("out_ptr",) and launches[1].wrote_past_end == ()
    torch.testing.assert_close(out, x + y)
    check_kernel_work(launch_evidence(fusion.add, x, y, kernels={"add": fusion._add_kernel}), "add", "add")
