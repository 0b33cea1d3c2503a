"""The channel between the trusted tester and the student's kernel: frames, and the safe loader of plain data.

Two directions, two rules:

- tester -> kernel: requests are pickled (cloudpickle, so functions and classes defined in a test
  cell travel by value). The kernel runs student code anyway; what it unpickles cannot hurt the tester.
- kernel -> tester: only *plain data*, in a tagged JSON tree with raw buffers for arrays, rebuilt
  by ``decode`` from exact types only: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
  ``bytes``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``torch.Tensor``,
  ``numpy.ndarray`` and NumPy scalars of numeric dtypes, ``torch.dtype``, ``torch.Size``,
  ``torch.device``, and instances of the dataclasses of ``course_lib`` (rebuilt from their fields
  by the tester's own class). Anything else the student's code returns stays in the kernel and
  comes back as a handle (``Handle``), which the tester can only call, iterate or ask attributes of.
  No subclass, no pickle, no object that runs code when compared or printed reaches the tester.

A frame is an 8-byte big-endian length, then the payload; a frame longer than ``MAX_FRAME`` is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["MAX_FRAME", "Handle", "WireError", "decode", "encode", "recv_frame", "send_frame", "view_as_dtype"]

MAX_FRAME = 1 << 31
MAX_DEPTH = 64
MAX_NODES = 5_000_000
MAX_INT_DIGITS = 5000
_HEADER = struct.Struct(">Q")
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: never object, str or void
_COLLECTION_TAGS: dict[type, str] = {list: "l", tuple: "t", set: "e", frozenset: "z"}


class WireError(ValueError):
    """A frame or a value that breaks the channel's rules (too big, malformed, a type that is not plain data)."""


@dataclass(frozen=True)
class Handle:
    """An object that stayed in the kernel: its number there and its type's name (for messages only)."""

    id: int
    type_name: str


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Write one frame."""
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> bytes:
    """Read one frame; raise EOFError when the peer closed, WireError when it announces more than ``limit`` bytes."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise WireError(f"a frame of {size} bytes is larger than the limit of {limit}")
    return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``."""
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 22))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def view_as_dtype(data: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """``data`` (uint8) viewed as the 1-byte dtype named (how fp8 tensors travel: torch cannot pickle them)."""
    return data.view(_dtype(dtype_name))


# ---------------------------------------------------------------------------------------------- encode
def encode(value: Any, keep: Any = None) -> bytes:
    """Plain data as a payload; ``keep(obj) -> Handle`` is called for anything that is not plain data."""
    buffers: list[bytes] = []
    tree = _encode(value, keep, buffers, 0)
    head = json.dumps({"v": tree, "b": [len(b) for b in buffers]}, separators=(",", ":")).encode()
    return _HEADER.pack(len(head)) + head + b"".join(buffers)


def _encode(x: Any, keep: Any, buffers: list[bytes], depth: int) -> Any:
    """One node of the tagged tree."""
    if depth > MAX_DEPTH:
        raise WireError(f"data nested deeper than {MAX_DEPTH} levels")
    t, down = type(x), depth + 1
    if x is None:
        return ["n"]
    if t is bool:
        return ["b", x]
    if t is int:
        return ["i", str(x)]
    if t is float:
        return ["f", x.hex()]
    if t is complex:
        return ["c", x.real.hex(), x.imag.hex()]
    if t is str:
        return ["s", x]
    if t is bytes:
        buffers.append(x)
        return ["y", len(buffers) - 1]
    if t in (list, tuple, set, frozenset):
        items = sorted(x, key=repr) if t in (set, frozenset) else x
        return [_COLLECTION_TAGS[t], [_encode(v, keep, buffers, down) for v in items]]
    if t is dict:
        return ["d", [[_encode(k, keep, buffers, down), _encode(v, keep, buffers, down)] for k, v in x.items()]]
    if t is torch.Size:
        return ["S", [int(n) for n in x]]
    plain = _base_value(x)
    if plain is not None:  # a subclass of a plain type: sent as its plain value, so that no override travels
        return _encode(plain, keep, buffers, depth)
    if t is torch.dtype:
        return ["D", str(x).removeprefix("torch.")]
    if t is torch.device:
        return ["V", str(x)]
    if isinstance(x, torch.Tensor):
        return _encode_tensor(x if t in (torch.Tensor, torch.nn.Parameter) else x.as_subclass(torch.Tensor), buffers)
    if t is np.ndarray and x.dtype.kind in _NUMPY_KINDS:
        buffers.append(np.ascontiguousarray(x).tobytes())
        return ["A", x.dtype.str, list(x.shape), len(buffers) - 1]
    if isinstance(x, np.generic) and type(x).__module__ == "numpy" and np.dtype(t).kind in _NUMPY_KINDS:
        buffers.append(np.asarray(x).tobytes())
        return ["a", np.dtype(t).str, len(buffers) - 1]
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and t.__module__.startswith("course_lib."):
        fields = [[f.name, _encode(getattr(x, f.name), keep, buffers, down)] for f in dataclasses.fields(x)]
        return ["C", t.__module__, t.__qualname__, fields]
    if keep is None:
        raise WireError(f"a {t.__name__} is not plain data")
    handle = keep(x)
    return ["H", handle.id, handle.type_name]


def _base_value(x: Any) -> Any:
    """The plain value of an instance of a subclass of str, int, float, list, tuple or dict (else None)."""
    bases: tuple[tuple[type, Callable[[Any], Any]], ...] = (
        (str, str.__str__), (int, int.__int__), (float, float.__float__), (complex, complex.__complex__),
        (tuple, tuple), (list, list), (dict, lambda d: dict(dict.items(d))),
    )
    for base, plain in bases:
        if isinstance(x, base) and type(x) is not base:
            value = plain(x)
            return value if type(value) is base else base.__new__(base, value)
    return None


def _encode_tensor(x: torch.Tensor, buffers: list[bytes]) -> list:
    """A tensor: dtype, shape, strides (when they are a permutation of a dense layout), device, the bytes."""
    if x.is_sparse or x.layout != torch.strided or x.is_quantized or x.is_meta:
        if x.is_meta:
            return ["M", str(x.dtype).removeprefix("torch."), list(x.shape)]
        raise WireError(f"a {x.layout} tensor is not plain data")
    data = x.detach()
    strides = list(data.stride()) if _dense_permutation(data) else None

    def largest_stride_first(i: int) -> int:
        return -data.stride(i)

    order = sorted(range(data.dim()), key=largest_stride_first) if strides else list(range(data.dim()))
    dense = data.permute(*order).contiguous().cpu() if data.dim() else data.contiguous().cpu()
    raw = dense.reshape(-1).view(torch.uint8) if dense.numel() and dense.element_size() else torch.empty(0, dtype=torch.uint8)
    buffers.append(raw.numpy().tobytes())
    return ["T", str(x.dtype).removeprefix("torch."), list(x.shape), strides, order, str(x.device), bool(x.requires_grad),
            len(buffers) - 1]


def _dense_permutation(x: torch.Tensor) -> bool:
    """Whether ``x``'s strides lay its elements out densely in some order of its dimensions (no gaps, no overlap)."""
    if x.dim() == 0 or x.numel() <= 1:
        return True
    expected = 1
    for i in sorted(range(x.dim()), key=lambda i: (x.stride(i), x.shape[i])):
        if x.shape[i] == 1:
            continue
        if x.stride(i) != expected:
            return False
        expected *= x.shape[i]
    return True


# ---------------------------------------------------------------------------------------------- decode
def decode(payload: bytes, handle: Any = None) -> Any:
    """Rebuild plain data from a payload sent by the kernel; ``handle(Handle) -> object`` builds what a handle becomes."""
    if len(payload) < _HEADER.size:
        raise WireError("a truncated payload")
    (head_size,) = _HEADER.unpack_from(payload)
    if head_size > len(payload) - _HEADER.size:
        raise WireError("a payload whose header is longer than the payload")
    try:
        head = json.loads(payload[_HEADER.size:_HEADER.size + head_size])
    except (ValueError, RecursionError) as exc:
        raise WireError(f"an unreadable payload header: {type(exc).__name__}") from None
    if type(head) is not dict or type(head.get("b")) is not list or "v" not in head:
        raise WireError("a payload header without its value and buffer table")
    sizes, offset, buffers = head["b"], _HEADER.size + head_size, []
    for size in sizes:
        if type(size) is not int or size < 0 or offset + size > len(payload):
            raise WireError("a buffer table that does not match the payload")
        buffers.append(memoryview(payload)[offset:offset + size])
        offset += size
    if offset != len(payload):
        raise WireError("bytes after the last buffer")
    return _Decoder(buffers, handle).node(head["v"], 0)


class _Decoder:
    """Rebuilds one tree, counting nodes; every check raises WireError."""

    def __init__(self, buffers: list[memoryview], handle: Any):
        self.buffers, self.handle, self.nodes = buffers, handle, 0

    def node(self, n: Any, depth: int) -> Any:
        """One node: its tag decides the exact type that is built."""
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            raise WireError("data too large or nested too deep")
        if type(n) is not list or not n or type(n[0]) is not str:
            raise WireError("a malformed node")
        tag, args, down = n[0], n[1:], depth + 1
        if tag == "n" and not args:
            return None
        if tag == "b":
            return self._typed(args, bool)
        if tag == "i":
            text = self._typed(args, str)
            if len(text) > MAX_INT_DIGITS or not text.lstrip("-").isdigit():
                raise WireError("a malformed integer")
            return int(text)
        if tag == "f":
            return _float(self._typed(args, str))
        if tag == "c" and len(args) == 2:
            return complex(_float(_str(args[0])), _float(_str(args[1])))
        if tag == "s":
            return self._typed(args, str)
        if tag == "y":
            return bytes(self._buffer(args[0] if len(args) == 1 else None))
        if tag in ("l", "t", "e", "z"):
            items = [self.node(v, down) for v in self._typed(args, list)]
            return {"l": list, "t": tuple, "e": set, "z": frozenset}[tag](items)
        if tag == "d":
            pairs = self._typed(args, list)
            if any(type(p) is not list or len(p) != 2 for p in pairs):
                raise WireError("a malformed dict")
            return {self.node(k, down): self.node(v, down) for k, v in pairs}
        if tag == "S":
            return torch.Size(_ints(self._typed(args, list)))
        if tag == "D":
            return _dtype(self._typed(args, str))
        if tag == "V":
            return torch.device(self._typed(args, str))
        if tag == "T" and len(args) == 7:
            return self._tensor(*args)
        if tag == "M" and len(args) == 2:
            return torch.empty(_ints(args[1]), dtype=_dtype(_str(args[0])), device="meta")
        if tag == "A" and len(args) == 3:
            dtype = _numpy_dtype(args[0])
            shape = _ints(args[1])
            data = self._buffer(args[2])
            if len(data) != math.prod(shape) * dtype.itemsize:
                raise WireError("an array whose bytes do not match its shape")
            return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
        if tag == "a" and len(args) == 2:
            dtype, data = _numpy_dtype(args[0]), self._buffer(args[1])
            if len(data) != dtype.itemsize:
                raise WireError("a NumPy scalar of the wrong size")
            return np.frombuffer(data, dtype=dtype)[0]
        if tag == "C" and len(args) == 3:
            return self._dataclass(_str(args[0]), _str(args[1]), self._typed([args[2]], list), down)
        if tag == "H" and len(args) == 2 and type(args[0]) is int and self.handle is not None:
            return self.handle(Handle(args[0], _str(args[1])[:200]))
        raise WireError(f"a node tagged {tag[:20]!r} is not plain data")

    def _typed(self, args: list, kind: type) -> Any:
        if len(args) != 1 or type(args[0]) is not kind:
            raise WireError(f"a malformed {kind.__name__} node")
        return args[0]

    def _buffer(self, index: Any) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise WireError("a reference to a missing buffer")
        return self.buffers[index]

    def _tensor(self, dtype_name: Any, shape: Any, strides: Any, order: Any, device: Any, grad: Any, index: Any) -> torch.Tensor:
        dtype, shape = _dtype(_str(dtype_name)), _ints(shape)
        order = _ints(order)
        if sorted(order) != list(range(len(shape))) or type(grad) is not bool:
            raise WireError("a malformed tensor")
        data = self._buffer(index)
        numel = math.prod(shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if len(data) != numel * itemsize:
            raise WireError("a tensor whose bytes do not match its shape and dtype")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if numel and itemsize else torch.empty(0, dtype=torch.uint8)
        permuted = [shape[i] for i in order]
        dense = flat.view(dtype).reshape(permuted) if numel else torch.empty(permuted, dtype=dtype)
        inverse = sorted(range(len(order)), key=lambda i: order[i])
        out = dense.permute(*inverse) if shape else dense.reshape(())
        if strides is None:
            out = out.contiguous()
        target = torch.device(_str(device))
        if target.type == "cuda" and torch.cuda.is_available():
            out = out.to(target)
        return out.requires_grad_(grad) if grad and (dtype.is_floating_point or dtype.is_complex) else out

    def _dataclass(self, module: str, qualname: str, fields: list, depth: int) -> Any:
        if not module.startswith("course_lib.") or "." in qualname or not module.replace(".", "").replace("_", "").isalnum():
            raise WireError(f"{module}.{qualname} is not a course_lib dataclass")
        try:
            cls = getattr(importlib.import_module(module), qualname)
        except (ImportError, AttributeError):
            raise WireError(f"no dataclass {module}.{qualname}") from None
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise WireError(f"{module}.{qualname} is not a dataclass")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for pair in fields:
            if type(pair) is not list or len(pair) != 2 or _str(pair[0]) not in names:
                raise WireError(f"a malformed field of {qualname}")
            values[pair[0]] = self.node(pair[1], depth)
        if set(values) != names:
            raise WireError(f"{qualname} without all of its fields")
        obj = object.__new__(cls)  # fields set as they are: no __init__ or __post_init__ of the student's choosing
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        return obj


def _str(x: Any) -> str:
    if type(x) is not str:
        raise WireError("a malformed string")
    return x


def _float(text: str) -> float:
    try:
        return float.fromhex(text) if text not in ("nan", "inf", "-inf") else float(text)
    except (ValueError, OverflowError):
        raise WireError("a malformed float") from None


def _ints(xs: Any) -> list[int]:
    if type(xs) is not list or len(xs) > 64 or any(type(v) is not int or v < 0 or v > 1 << 48 for v in xs):
        raise WireError("a malformed shape")
    return xs


def _dtype(name: str) -> torch.dtype:
    if name not in _TORCH_DTYPES:
        raise WireError(f"unknown dtype {name[:40]!r}")
    return _TORCH_DTYPES[name]


def _numpy_dtype(name: Any) -> np.dtype:
    try:
        dtype = np.dtype(_str(name))
    except TypeError:
        raise WireError("a malformed NumPy dtype") from None
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError(f"NumPy dtype {name[:40]!r} is not plain data")
    return dtype
