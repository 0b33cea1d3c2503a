"""The student's side of a graded test cell: answers the trusted tester's calls inside the sandboxed kernel.

While a test cell is graded, the kernel runs ``serve(path, token)`` as that cell's code. It connects
to the tester's socket and carries out what the tester asks: call a name of the notebook (a
student's function or class), call, iterate or read an attribute of an object kept from an
earlier answer, release such objects. Results go back as plain data (``autograder.wire``); anything
else stays here and goes back as a handle. Arguments whose state the tester wants back (a tensor
updated in place, an optimizer's state dict) are sent back after the call.

Nothing here is trusted: the student's code can replace this module, and then it only answers
wrongly. Verdicts are computed by the tester from what arrives, never from what this side says
about it. One thing is checked here, for honest mistakes: while a cell is graded, the course_lib
reference of its exercise refuses to run (it raises a RuntimeError that says so), by whatever name
or copy of its function object it is reached.
"""

from __future__ import annotations

import builtins
import gc
import importlib
import inspect
import io
import os
import pickle
import queue
import socket
import sys
import threading
import types
from typing import Any

import torch

import course_lib

from . import wire

__all__ = ["REFERENCE_MESSAGE", "serve"]


# How the message of a call of the graded exercise's reference begins (the tester scores it 0 with this message).
REFERENCE_MESSAGE = "the solution calls the course's reference"


class _TesterObject:
    """An object that stayed with the tester (an observer, a generator): every use is a call back to it."""

    def __init__(self, link: _Link, ref: int):
        self._link, self._ref = link, ref

    def _op(self, op: str, *args: Any, **kwargs: Any) -> Any:
        return self._link.callback(self._ref, op, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._op("call", *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._op("getattr", name)

    def __iter__(self) -> Any:
        return self._op("iter")

    def __next__(self) -> Any:
        return self._op("next")

    def __len__(self) -> int:
        return self._op("len")


class _Link:
    """One test cell's connection: requests from the tester run on the kernel's main thread; call-backs from any."""

    def __init__(self, sock: socket.socket, user_ns: dict[str, Any]):
        self.sock, self.user_ns = sock, user_ns
        self.handles: dict[int, Any] = {}
        self.next_id = 1
        self.lock = threading.Lock()
        self.requests: queue.Queue = queue.Queue()
        self.answers: dict[int, queue.Queue] = {}
        self.main = threading.get_ident()
        self.closed = False
        self.tripwires = _Tripwires([])
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Route each frame: answers to call-backs to their waiting thread, requests to the main thread."""
        try:
            while True:
                message = _Unpickler(io.BytesIO(wire.recv_frame(self.sock)), self).load()
                kind, number = message[0], message[1]
                if kind in ("answer", "failure") and number in self.answers:
                    self.answers[number].put(message)
                else:
                    self.requests.put(message)
        except Exception:  # the tester closed the channel (the cell is over) or sent something unreadable
            self.closed = True
            self.requests.put(("done", 0, None))
            for box in list(self.answers.values()):
                box.put(("failure", 0, ("EOFError", "the tester closed the channel")))

    def send(self, message: list) -> None:
        """Send plain data to the tester; objects that are not plain data become handles."""
        with self.lock:
            wire.send_frame(self.sock, wire.encode(message, self.keep))

    def keep(self, obj: Any) -> wire.Handle:
        """Keep ``obj`` here and name it by a number."""
        for number, kept in self.handles.items():
            if kept is obj:
                return wire.Handle(number, type(obj).__name__)
        number, self.next_id = self.next_id, self.next_id + 1
        self.handles[number] = obj
        return wire.Handle(number, type(obj).__name__)

    def serve(self) -> None:
        """Carry out the tester's requests until it says the cell is over."""
        while True:
            message = self.requests.get()
            if message[0] == "done":
                return
            if message[0] == "begin":  # the references of the exercise under test, by "module:qualname"
                self.tripwires = _Tripwires(list(message[2]))
                self.tripwires.arm()
                continue
            self._carry_out(message)

    def _carry_out(self, message: tuple) -> None:
        kind, number, body = message
        if kind == "release":
            for handle in body:
                self.handles.pop(handle, None)
            return
        try:
            result, after = self._do(kind, body)
            self.send(["result", number, result, after])
        except BaseException as exc:  # the student's exception goes back as its class names and message
            names = [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]
            self.send(["raise", number, names, str(exc)[:4000]])
            if isinstance(exc, KeyboardInterrupt):
                raise

    def _do(self, kind: str, body: tuple) -> tuple[Any, list]:
        """One request: the result, and the state of the arguments asked back."""
        if kind == "names":
            return {name: self.user_ns[name] for name in body if name in self.user_ns}, []
        target, op, args, kwargs, back = body
        if isinstance(target, int):
            obj = self.handles[target]
        elif isinstance(target, str):
            obj = self.user_ns[target]
        else:  # a test helper sent by value (course_lib.exercises.checks.student_side)
            obj = target
        if op == "call":
            result = obj(*args, **kwargs)
        elif op == "getattr":
            result = getattr(obj, args[0])
        elif op == "setattr":
            setattr(obj, args[0], args[1])
            result = None
        elif op == "iter":
            result = iter(obj)
        elif op == "next":
            result = next(obj)
        elif op == "len":
            result = len(obj)
        elif op == "getitem":
            result = obj[args[0]]
        elif op == "enter":
            result = obj.__enter__()
        elif op == "exit":
            result = obj.__exit__(*args)
        else:
            raise ValueError(f"unknown request {op!r}")
        return result, [state_of(v) for v in (args if back == "args" else ())] + (
            [{k: state_of(v) for k, v in kwargs.items()}] if back == "args" else [])

    def callback(self, ref: int, op: str, args: tuple, kwargs: dict) -> Any:
        """Use an object that stayed with the tester; wait for its answer (the main thread serves requests meanwhile)."""
        if self.closed:
            raise EOFError("the test cell is over: its objects are gone")
        with self.lock:
            number, self.next_id = self.next_id, self.next_id + 1
        box: queue.Queue = queue.Queue()
        self.answers[number] = box
        self.send(["callback", number, ref, op, list(args), kwargs])
        try:
            while True:
                try:
                    kind, _, body = box.get(timeout=0.005 if threading.get_ident() == self.main else None)
                    break
                except queue.Empty:
                    try:
                        self._carry_out(self.requests.get_nowait())
                    except queue.Empty:
                        continue
        finally:
            self.answers.pop(number, None)
        if kind == "failure":
            raise _exception(*body)
        return body


def state_of(value: Any) -> Any:
    """What the tester needs to update its copy of an argument: tensors, containers, modules, optimizers."""
    if isinstance(value, torch.nn.Module):
        return {"parameters": {n: (p.detach(), None if p.grad is None else p.grad.detach())
                               for n, p in value.named_parameters()},
                "buffers": {n: b.detach() for n, b in value.named_buffers()}, "training": value.training}
    if isinstance(value, torch.optim.Optimizer):
        return {"optimizer_state": value.state_dict()}
    if isinstance(value, torch.Tensor):
        return (value.detach(), None if value.grad is None else value.grad.detach())
    if isinstance(value, (list, tuple)):
        return [state_of(v) for v in value]
    if isinstance(value, dict):
        return {k: state_of(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and type(value).__module__.startswith("course_lib."):
        return {"attributes": {k: state_of(v) for k, v in vars(value).items() if not callable(v)}}
    return value


def _exception(name: str, message: str) -> BaseException:
    """An exception of a builtin class named ``name`` (RuntimeError when there is none)."""
    cls = getattr(builtins, name, None)
    return cls(message) if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError(f"{name}: {message}")


class _Unpickler(pickle.Unpickler):
    """Unpickles the tester's requests, turning its references into the objects they name here."""

    def __init__(self, data: io.BytesIO, link: _Link):
        super().__init__(data)
        self.link = link

    def persistent_load(self, pid: Any) -> Any:
        kind, value = pid
        if kind == "name":
            if value not in self.link.user_ns:
                raise NameError(f"name {value!r} is not defined in the notebook")
            return self.link.user_ns[value]
        if kind == "handle":
            return self.link.handles[value]
        if kind == "ref":
            return _TesterObject(self.link, value)
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")


# ---------------------------------------------------------------------------------------------- references
class _Tripwires:
    """While armed, every function whose code is a reference's raises instead of running."""

    def __init__(self, qualnames: list[str]):
        self.codes: dict[types.CodeType, str] = {}
        for qualname in qualnames:
            for code in _codes_of(_resolve(qualname)):
                self.codes[code] = qualname
        self.swapped: list[tuple[types.FunctionType, types.CodeType]] = []

    def arm(self) -> None:
        """Swap the code of every function object that runs a reference's code (aliases and copies included)."""
        if not self.codes:
            return
        for obj in gc.get_objects():
            if type(obj) is types.FunctionType and obj.__code__ in self.codes:
                original = obj.__code__
                obj.__code__ = _tripwire_code(original, self.codes[original])
                self.swapped.append((obj, original))

    def disarm(self) -> None:
        """Put every swapped code back."""
        for function, code in reversed(self.swapped):
            function.__code__ = code
        self.swapped.clear()


def _resolve(qualname: str) -> Any:
    """The object named ``module:attr.attr``."""
    module, _, path = qualname.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _codes_of(obj: Any) -> list[types.CodeType]:
    """The code objects a reference runs: a function's, or every method's of a class, written in course_lib.

    Decorators are looked through (``__wrapped__``). Only code defined by the reference itself is
    guarded: a decorator's wrapper (contextlib's, torch's no_grad) or a method the class borrows from
    another course_lib class (``forward = CausalSelfAttention.forward``) is shared with code that
    is no answer.
    """
    home = os.path.dirname(os.path.realpath(course_lib.__file__)) + os.sep
    own = getattr(inspect.unwrap(obj) if callable(obj) else obj, "__qualname__", "")
    candidates = [obj]
    if isinstance(obj, type):
        for value in vars(obj).values():
            candidates += [value, getattr(value, "__func__", None), getattr(value, "fget", None)]
    codes = []
    for candidate in candidates:
        if candidate is None:
            continue
        function = inspect.unwrap(candidate) if callable(candidate) else candidate
        code = getattr(function, "__code__", None)
        if isinstance(code, types.CodeType) and os.path.realpath(code.co_filename).startswith(home) and \
                (code.co_qualname == own or code.co_qualname.startswith(own + ".")):
            codes.append(code)
    return codes


def _tripwire_code(original: types.CodeType, qualname: str) -> types.CodeType:
    """A code object with ``original``'s free variables whose only effect is to raise ReferenceUsed's message.

    It runs with the reference module's globals, so it names nothing but a builtin and constants.
    """
    names = original.co_freevars
    message = f"{REFERENCE_MESSAGE} {qualname.replace(':', '.')}, which is the answer to this exercise: write it " \
              "yourself (the reference is fine in the chapter's other cells, not in the graded function)"
    uses = "; ".join(names) + "; " if names else ""
    source = "def outer():\n" + "".join(f"    {n} = None\n" for n in names) + \
        f"    def tripwire(*args, **kwargs):\n        {uses}raise RuntimeError({message!r})\n    return tripwire\n"
    space: dict[str, Any] = {}
    exec(compile(source, "<reference tripwire>", "exec"), space)
    code = space["outer"]().__code__
    if code.co_freevars != names:
        raise RuntimeError(f"cannot guard {qualname}: its free variables {names} are not reproduced")
    return code.replace(co_name=original.co_name)


# ---------------------------------------------------------------------------------------------- entry point
def serve(path: str, token: str) -> None:
    """Connect to the tester at ``path`` and answer its calls for one test cell."""
    user_ns = sys.modules["__main__"].__dict__
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            user_ns = shell.user_ns
    except ImportError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    wire.send_frame(sock, wire.encode(["hello", token]))
    link = _Link(sock, user_ns)
    try:
        link.serve()
    finally:
        link.tripwires.disarm()
        sock.close()
