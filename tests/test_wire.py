"""The grader's channel: the safe loader accepts plain data of exact types only, and the reference guard.

What the student's kernel sends is rebuilt by ``autograder.wire.decode``; everything here is a
payload a hostile kernel could send. The guard of ``autograder.agent`` makes the reference of the
exercise under test raise by whatever name or copy it is reached, and puts everything back after.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import struct
import sys
import types

import numpy as np
import pytest
import torch

from autograder import wire
from autograder.agent import REFERENCE_MESSAGE, _Tripwires
from course_lib import floating_point as fp
from course_lib import memory_math as mm
from course_lib.exercises import checks as testing


def roundtrip(value: object) -> object:
    return wire.decode(wire.encode(value))


@pytest.mark.parametrize("value", [
    None, True, 0, -(10**40), 2.5, -0.0, math.inf, 1 + 2j, "text", b"\x00\xff", [1, [2.0]], (1, "a"),
    {"k": (1, 2), 3: None}, {1, 2}, frozenset({"a"}), torch.Size([2, 3]), torch.bfloat16, torch.device("cpu"),
])
def test_plain_values_come_back_equal_and_of_the_same_exact_type(value: object) -> None:
    back = roundtrip(value)
    assert type(back) is type(value) and back == value


def test_nan_and_the_sign_of_zero_survive() -> None:
    assert math.isnan(roundtrip(math.nan)) and math.copysign(1.0, roundtrip(-0.0)) == -1.0


@pytest.mark.parametrize("tensor", [
    torch.arange(12.0).reshape(3, 4), torch.arange(12.0).reshape(3, 4).t(), torch.zeros(0, 5), torch.tensor(2.5),
    torch.arange(6, dtype=torch.int16), torch.randn(4, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bool),
    torch.randn(2, 3, dtype=torch.complex64),
])
def test_tensors_keep_dtype_shape_values_and_dense_strides(tensor: torch.Tensor) -> None:
    back = roundtrip(tensor)
    assert type(back) is torch.Tensor and back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor) and back.stride() == tensor.stride()


def test_a_strided_view_comes_back_with_its_values() -> None:
    view = torch.arange(30.0).reshape(5, 6)[:, ::2]
    back = roundtrip(view)
    assert torch.equal(back, view) and back.is_contiguous()


def test_arrays_scalars_and_course_dataclasses() -> None:
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert (roundtrip(arr) == arr).all() and roundtrip(arr).dtype == np.int32
    assert type(roundtrip(np.int64(5))) is np.int64
    fmt = fp.FORMATS["fp16"]
    back = roundtrip(fmt)
    assert type(back) is type(fmt) and dataclasses.asdict(back) == dataclasses.asdict(fmt)
    breakdown = mm.MemoryBreakdown(1.0, 2.0, 3.0, 4.0)
    assert roundtrip(breakdown) == breakdown


def test_subclasses_travel_as_their_plain_value() -> None:
    class Liar(float):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = float.__hash__

    class Yes(torch.Tensor):
        pass

    back = roundtrip([Liar(1.5), torch.zeros(2).as_subclass(Yes)])
    assert type(back[0]) is float and back[0] != 2.0
    assert type(back[1]) is torch.Tensor


def test_other_objects_become_handles_or_are_refused() -> None:
    kept = []
    payload = wire.encode([object()], lambda obj: kept.append(obj) or wire.Handle(7, type(obj).__name__))
    assert kept and wire.decode(payload, lambda h: ("handle", h.id)) == [("handle", 7)]
    with pytest.raises(wire.WireError):
        wire.decode(payload)  # no handle builder: a handle is not data
    with pytest.raises(wire.WireError):
        wire.encode(object())
    with pytest.raises(wire.WireError):
        wire.encode(np.array([object()], dtype=object))


def payload(tree: object, buffers: tuple[bytes, ...] = ()) -> bytes:
    head = json.dumps({"v": tree, "b": [len(b) for b in buffers]}).encode()
    return struct.pack(">Q", len(head)) + head + b"".join(buffers)


@pytest.mark.parametrize("bad", [
    b"", b"\x00" * 7, struct.pack(">Q", 10**9) + b"{}", payload(["x"]), payload(["i", "12a"]), payload(["i", "9" * 6000]),
    payload(["l", "not a list"]), payload(["T", "float32", [4], None, [0], "cpu", False, 0], (b"\x00" * 3,)),
    payload(["A", "|O", [1], 0], (b"\x00" * 8,)), payload(["A", "<f8", [2], 0], (b"\x00" * 8,)),
    payload(["C", "os", "path", []]), payload(["C", "course_lib.memory_math", "MemoryBreakdown", [["params", ["f", "0x1p0"]]]]),
    payload(["D", "not_a_dtype"]), payload(["y", 3]), payload(["n"]) + b"trailing", payload(["S", [-1]]),
    payload(["d", [["s", "a"]]]),
])
def test_malformed_or_forbidden_payloads_are_refused(bad: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(bad)


def test_deep_nesting_is_refused_not_a_crash() -> None:
    tree: list = ["n"]
    for _ in range(200):
        tree = ["l", [tree]]
    with pytest.raises(wire.WireError):
        wire.decode(payload(tree))


def test_the_reference_raises_by_any_name_or_copy_while_armed_and_works_after() -> None:
    alias = fp.tensor_nbytes
    copy = types.FunctionType(fp.tensor_nbytes.__code__, fp.tensor_nbytes.__globals__)
    spec = importlib.util.spec_from_file_location("_floating_point_again", fp.__file__)
    again = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = again  # dataclasses look their module up while it runs
    try:
        spec.loader.exec_module(again)  # the module's source run a second time: new functions, equal code
    finally:
        del sys.modules[spec.name]
    reloaded = again.tensor_nbytes
    guard = _Tripwires(["course_lib.floating_point:tensor_nbytes"])
    guard.arm()
    try:
        for fn in (fp.tensor_nbytes, alias, copy, reloaded):
            with pytest.raises(RuntimeError, match=REFERENCE_MESSAGE):
                fn(torch.zeros(3))
        assert fp.round_to_format(1.0, fp.FORMATS["fp16"]) == 1.0  # other course_lib functions still run
    finally:
        guard.disarm()
    assert alias(torch.zeros(3)) == copy(torch.zeros(3)) == 12


def test_hidden_seed_is_the_seed_in_a_notebook_and_secret_under_the_grader() -> None:
    assert testing.hidden_seed(101) == 101
    with testing.secret_seed(12345):
        first = testing.hidden_seed(101)
        assert first != 101 and testing.hidden_seed(101) == first and testing.hidden_seed(102) != first
    with testing.secret_seed(54321):
        assert testing.hidden_seed(101) != first
    assert testing.hidden_seed(101) == 101
