"""The trusted tester: runs a chapter's test cells in its own interpreter, calling the student's code across a channel.

One tester process runs per graded submission, outside the sandbox, started by the worker
(``autograder.execute``). It has the instructor's own copies of course_lib, torch and numpy and
the instructor's test cells, read from solutions/; the student's kernel cannot write to it or
signal it. For each test cell the worker asks for, it:

1. accepts the kernel's connection on its socket (the kernel runs ``autograder.agent.serve``);
2. binds, in the test namespace, each name the student defines (the top-level names of the
   source notebook's solution cells): plain data as itself, anything else as a ``RemoteObject``
   whose calls, iteration and attributes are forwarded to the kernel;
3. runs the unchanged test source there. Values come back through the safe loader of
   ``autograder.wire`` (exact types only), so comparisons, messages and points are computed here;
4. writes the verdict (``autograder.contracts.Verdict``), one JSON line, for the worker.

Test helpers that must run where the student's objects live (an autograd backward through the
student's module, a check that a builtin is not used) are sent to the kernel by value with
``course_lib.exercises.checks.student_side``; objects the tester must keep observing (a counting source, a
simulated clock) stay here with ``course_lib.exercises.checks.by_reference`` and are called back.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
import types
import weakref
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from course_lib.exercises import checks as testing
from course_lib.support import dist

from . import wire
from .agent import REFERENCE_MESSAGE
from .config import SECRET_VARIABLE
from .contracts import TESTER_READY, CellRequest, ContractError, TesterArgs, Verdict
from .course import HIDDEN_BEGIN, HIDDEN_END, is_test_cell, read_notebook

__all__ = ["RemoteObject", "Tester", "main"]

# Metadata of a non-solution cell whose definitions build on the student's code and so live in the kernel.
STUDENT_SIDE_KEY = "student_side"


class RemoteObject:
    """An object of the student's kernel: it can be called, iterated, entered, asked attributes; it never compares."""

    __slots__ = ("_channel", "_id", "_type_name", "__weakref__")

    def __init__(self, channel: Channel, number: int | str, type_name: str):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_id", number)
        object.__setattr__(self, "_type_name", type_name)

    def _op(self, op: str, *args: Any, back: str = "", **kwargs: Any) -> Any:
        if os.getpid() != self._channel.pid:  # a rank forked from the tester: the channel is not its to use
            raise RuntimeError(f"the student's {self.__name__} cannot be used in the reference run's ranks")
        return self._channel.request(self._id, op, args, kwargs, back)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._op("call", *args, back="args", **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._op("getattr", name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._op("setattr", name, value)

    def __iter__(self) -> Any:
        return self._op("iter")

    def __next__(self) -> Any:
        return self._op("next")

    def __len__(self) -> int:
        n = self._op("len")
        if type(n) is not int:
            raise TypeError(f"len() of the student's {self._type_name} is not an int")
        return n

    def __getitem__(self, key: Any) -> Any:
        return self._op("getitem", key)

    def __enter__(self) -> Any:
        return self._op("enter")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        result = self._op("exit", exc_type, None if exc is None else exc_type(*getattr(exc, "args", ())), None)
        return result is True

    def __repr__(self) -> str:
        return f"<the student's {self._type_name}>"

    @property
    def __name__(self) -> str:  # noqa: D401 - named like a function's, for messages
        """The name the student gave it (its notebook name, or its type's)."""
        return str(self._id) if isinstance(self._id, str) else self._type_name

    def __del__(self) -> None:
        if isinstance(self._id, int):
            self._channel.release(self._id)


class _Undefined:
    """A name the student was asked to define and did not: using it raises NameError, as in the notebook."""

    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NameError(f"name {self.__name__!r} is not defined: run its exercise cell")

    def __getattr__(self, attr: str) -> Any:
        raise NameError(f"name {self.__name__!r} is not defined: run its exercise cell")


class Channel:
    """The tester's end of one test cell's connection to the kernel."""

    def __init__(self, sock: socket.socket, deadline: float, tester: Tester):
        self.sock, self.deadline, self.tester = sock, deadline, tester
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.next_id = 1
        self.answers: dict[int, queue.Queue] = {}
        self.handles: weakref.WeakValueDictionary[int, RemoteObject] = weakref.WeakValueDictionary()
        self.refs: dict[int, Any] = {}
        self.released: list[int] = []
        self.broken: str = ""
        self.callbacks: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._serve_callbacks, daemon=True).start()

    # -- sending
    def _dumps(self, message: Any) -> bytes:
        """Pickle a request: the student's names and objects by reference, test functions by value."""
        buffer = io.BytesIO()
        _Pickler(buffer, self._persistent_id).dump(message)
        return buffer.getvalue()

    def _persistent_id(self, obj: Any) -> Any:
        if type(obj) is RemoteObject:
            return ("name", obj._id) if isinstance(obj._id, str) else ("handle", obj._id)
        if _kept_here(obj):
            ref = id(obj)
            self.refs[ref] = obj
            return ("ref", ref)
        return None

    def send(self, message: tuple) -> None:
        """Send one request (or an answer to a call-back)."""
        data = self._dumps(message)
        with self.lock:
            wire.send_frame(self.sock, data)

    def release(self, number: int) -> None:
        """Forget a kernel object once its proxy is gone (sent with the next request)."""
        self.released.append(number)

    # -- receiving
    def _read(self) -> None:
        """Route each frame from the kernel: results to the waiting request, call-backs to their thread."""
        try:
            while True:
                message = wire.decode(wire.recv_frame(self.sock), self._handle)
                if type(message) is not list or len(message) < 2 or type(message[1]) is not int:
                    raise wire.WireError("a message that is not a list with a number")
                if message[0] == "callback":
                    self.callbacks.put(message)
                elif message[1] in self.answers:
                    self.answers[message[1]].put(message)
        except Exception as exc:  # the kernel closed the channel, died, or sent something that is not plain data
            self.broken = "the notebook's kernel closed the channel" if isinstance(exc, EOFError) else \
                f"the notebook sent something that is not plain data ({exc})"
            for box in list(self.answers.values()):
                box.put(None)
            self.callbacks.put(None)

    def _handle(self, handle: wire.Handle) -> RemoteObject:
        proxy = self.handles.get(handle.id)
        if proxy is None:
            proxy = RemoteObject(self, handle.id, handle.type_name)
            self.handles[handle.id] = proxy
        return proxy

    def request(self, target: int | str, op: str, args: tuple, kwargs: dict, back: str = "") -> Any:
        """Ask the kernel to do ``op`` on ``target``; return its result (data or proxies), or raise what it raised."""
        if self.released:
            released, self.released = self.released, []
            self.send(("release", 0, released))
        with self.lock:
            number, self.next_id = self.next_id, self.next_id + 1
        box: queue.Queue = queue.Queue()
        self.answers[number] = box
        try:
            self.send(("call", number, (target, op, args, kwargs, back)))
            message = self._wait(box)
        finally:
            self.answers.pop(number, None)
        if message[0] == "raise":
            raise _student_exception(message)
        if message[0] != "result" or len(message) != 4:
            raise wire.WireError("a malformed answer")
        if back == "args":
            _write_back(args, kwargs, message[3])
        return message[2]

    def _wait(self, box: queue.Queue) -> list:
        """The answer in ``box``; a TimeoutError past the cell's deadline, a ChannelClosed when the kernel went away."""
        left = self.deadline - time.monotonic()
        try:
            message = box.get(timeout=max(left, 0.0))
        except queue.Empty:
            raise TimeoutError(f"the notebook did not answer within the cell's time limit "
                               f"({self.tester.cell_timeout:g} s)") from None
        if message is None:
            raise ChannelClosed(self.broken)
        return message

    def names(self, names: list[str]) -> dict[str, Any]:
        """The values of the student's names that exist in the kernel (data, or proxies)."""
        number = self.next_id
        self.next_id += 1
        box: queue.Queue = queue.Queue()
        self.answers[number] = box
        self.send(("names", number, names))
        message = self._wait(box)
        if message[0] != "result" or type(message[2]) is not dict:
            raise wire.WireError("a malformed answer to the names request")
        return {k: v for k, v in message[2].items() if type(k) is str and k in names}

    def reference_launch(self, fn: Any, world_size: int, args: tuple, kwargs: dict) -> list[Any]:
        """``fn`` in ranks forked from the tester, with the course's reference in place of each student name."""
        references = self.tester.reference_objects()
        namespace = self.tester.namespace
        saved = {name: namespace[name] for name in references if name in namespace}
        namespace.update(references)
        try:
            kwargs = dict(kwargs)
            backend, timeout = kwargs.pop("backend", None), kwargs.pop("timeout", 60.0)
            return dist._launch_here(fn, world_size, *_substitute(args, references), backend=backend, timeout=timeout,
                                     **{k: _substitute(v, references) for k, v in kwargs.items()})
        finally:
            namespace.update(saved)

    def _serve_callbacks(self) -> None:
        """Run the kernel's calls of objects kept here (by_reference), one at a time."""
        while True:
            message = self.callbacks.get()
            if message is None:
                return
            try:
                _, number, ref, op, args, kwargs = message
                result = _perform(self.refs[ref], op, args, kwargs)
                self.send(("answer", number, result))
            except BaseException as exc:  # an exception of the trusted object goes back to the student's code
                try:
                    self.send(("failure", message[1], (type(exc).__name__, str(exc))))
                except Exception:
                    return


def _perform(obj: Any, op: Any, args: Any, kwargs: Any) -> Any:
    """The kernel's operation ``op`` on an object kept here (KeyError for an unknown one)."""
    return {"call": lambda: obj(*args, **kwargs), "getattr": lambda: getattr(obj, args[0]),
            "iter": lambda: iter(obj), "next": lambda: next(obj), "len": lambda: len(obj)}[op]()


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, with references for the student's objects and the 1-byte dtypes torch cannot pickle (fp8)."""

    def __init__(self, buffer: io.BytesIO, persistent_id: Any):
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self._references = persistent_id

    def persistent_id(self, obj: Any) -> Any:
        return self._references(obj)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.dtype.itemsize == 1 and obj.dtype not in (torch.uint8, torch.int8, torch.bool) \
                and not obj.is_meta:
            return wire.view_as_dtype, (obj.view(torch.uint8), str(obj.dtype).removeprefix("torch."))
        return super().reducer_override(obj)


def _substitute(value: Any, references: dict[str, Any]) -> Any:
    """``value`` with each proxy of a student name replaced by that name's reference (in tuples and lists too)."""
    if type(value) is RemoteObject and isinstance(value._id, str):
        if value._id not in references:
            raise RuntimeError(f"no course_lib reference is named {value._id}: the reference run cannot stand in for it")
        return references[value._id]
    if type(value) in (tuple, list):
        return type(value)(_substitute(v, references) for v in value)
    return value


class ChannelClosed(RuntimeError):
    """The kernel went away in the middle of a test (it died, or the student's code closed the channel)."""


def _kept_here(obj: Any) -> bool:
    """Whether ``obj`` stays with the tester when sent: generators, and what a test marked ``by_reference``."""
    return isinstance(obj, types.GeneratorType) or testing.is_by_reference(obj)


def _student_exception(message: list) -> BaseException:
    """The exception the student's code raised, rebuilt as the nearest builtin class, with its message."""
    _, _, names, text = (message + [None, None])[:4]
    names = names if type(names) is list else []
    text = text if type(text) is str else ""
    if text.startswith(REFERENCE_MESSAGE):
        return ReferenceCalled(text)
    for name in names:
        cls = getattr(builtins, name, None) if type(name) is str else None
        if isinstance(cls, type) and issubclass(cls, BaseException):
            if not issubclass(cls, Exception):  # KeyboardInterrupt, SystemExit: the cell was interrupted or exited
                return RuntimeError(f"the student's code raised {name}: {text}")
            try:
                if cls is KeyError:
                    return KeyError(text)
                return cls(text)
            except TypeError:
                continue
    return RuntimeError(text)


class ReferenceCalled(AssertionError):
    """The student's code called the reference of the exercise under test."""


def _write_back(args: tuple, kwargs: dict, states: Any) -> None:
    """Update the tester's arguments with their state after the student's call (tensors changed in place, ...)."""
    if type(states) is not list or len(states) != len(args) + 1:
        return
    for value, state in zip(args, states):
        _apply(value, state)
    if type(states[-1]) is dict:
        for key, value in kwargs.items():
            _apply(value, states[-1].get(key))


def _apply(value: Any, state: Any) -> None:
    """Copy one argument's reported state into ``value`` where the shapes agree; ignore what does not fit."""
    if state is None:
        return
    if isinstance(value, torch.nn.Module) and type(state) is dict:
        with torch.no_grad():
            for name, p in value.named_parameters():
                data, grad = (state.get("parameters") or {}).get(name, (None, None))
                _copy_tensor(p, data)
                if isinstance(grad, torch.Tensor) and grad.shape == p.shape:
                    p.grad = grad.to(p.device, p.dtype)
                elif grad is None and name in (state.get("parameters") or {}):
                    p.grad = None
            for name, b in value.named_buffers():
                _copy_tensor(b, (state.get("buffers") or {}).get(name))
        if type(state.get("training")) is bool:
            value.train(state["training"])
    elif isinstance(value, torch.optim.Optimizer) and type(state) is dict and "optimizer_state" in state:
        with contextlib.suppress(Exception):
            value.load_state_dict(state["optimizer_state"])
    elif isinstance(value, torch.Tensor) and type(state) is tuple and len(state) == 2:
        with torch.no_grad():
            _copy_tensor(value, state[0])
        if isinstance(state[1], torch.Tensor) and state[1].shape == value.shape:
            value.grad = state[1].to(value.device, value.dtype)
    elif type(value) is list and type(state) is list:
        for i, item_state in enumerate(state[: len(value)]):
            if _is_container(value[i]):
                _apply(value[i], item_state)
            elif type(item_state) is tuple and len(item_state) == 2 and isinstance(item_state[0], torch.Tensor):
                value[i] = item_state[0]
        if len(state) > len(value):
            value.extend(s[0] if type(s) is tuple and len(s) == 2 else s for s in state[len(value):])
    elif type(value) is tuple and type(state) is list:
        for item, item_state in zip(value, state):
            _apply(item, item_state)
    elif type(value) is dict and type(state) is dict:
        for key in [k for k in value if k not in state]:
            del value[key]
        for key, item_state in state.items():
            if key in value and _is_container(value[key]):
                _apply(value[key], item_state)
            else:
                value[key] = item_state[0] if type(item_state) is tuple and len(item_state) == 2 else item_state
    elif type(state) is dict and "attributes" in state and type(value).__module__.startswith("course_lib."):
        for key, item_state in (state["attributes"] or {}).items():
            if type(key) is str and not key.startswith("__") and hasattr(value, key):
                current = getattr(value, key)
                if _is_container(current):
                    _apply(current, item_state)
                else:
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(value, key, item_state)


def _is_container(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, list, tuple, dict))


def _copy_tensor(target: Any, data: Any) -> None:
    if isinstance(data, torch.Tensor) and data.shape == target.shape and data.dtype == target.dtype:
        with torch.no_grad():
            target.copy_(data)


# ---------------------------------------------------------------------------------------------- the tester
class Tester:
    """The test namespace of one submission and the runner of its test cells."""

    def __init__(self, source_notebook: Path, socket_path: Path, cell_timeout: float, secret: int | None = None):
        self.cell_timeout, self.secret = cell_timeout, secret
        nb = read_notebook(source_notebook)
        self.tests: dict[str, str] = {}
        self.exercise_names: dict[str, list[str]] = {}  # grade_id of a test -> the student names its exercise defines
        self.student_names: list[str] = []
        imports: list[str] = []
        pending: list[str] = []
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            meta = cell.metadata.get("nbgrader", {})
            tree = _parse(cell.source)
            if meta.get("solution") or cell.metadata.get(STUDENT_SIDE_KEY):
                names = _top_level_names(tree)
                pending += names
                self.student_names += [n for n in names if n not in self.student_names]
                continue
            imports += [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            if is_test_cell(cell):
                self.tests[meta["grade_id"]] = cell.source
                self.exercise_names[meta["grade_id"]] = pending
                pending = []
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        for statement in dict.fromkeys(imports):
            with contextlib.suppress(Exception):  # an import of the notebook's own folder: not the tester's business
                exec(statement, self.namespace)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(socket_path))
        self.server.listen(4)

    def references(self, grade_id: str) -> list[str]:
        """``module:qualname`` of each course_lib object with the name of a function this exercise asks for."""
        found = []
        for value in list(self.namespace.values()):
            if isinstance(value, types.ModuleType) and value.__name__.startswith("course_lib"):
                for name in self.exercise_names.get(grade_id, []):
                    obj = getattr(value, name, None)
                    if obj is not None and getattr(obj, "__module__", "").startswith("course_lib"):
                        found.append(f"{obj.__module__}:{getattr(obj, '__qualname__', name)}")
        return sorted(set(found))

    def reference_objects(self) -> dict[str, Any]:
        """Each student name that a course_lib module imported by the notebook also defines, with that object."""
        found: dict[str, Any] = {}
        for value in list(self.namespace.values()):
            if isinstance(value, types.ModuleType) and value.__name__.startswith("course_lib"):
                for name in self.student_names:
                    obj = getattr(value, name, None)
                    if obj is not None and getattr(obj, "__module__", "").startswith("course_lib"):
                        found.setdefault(name, obj)
        return found

    def run(self, grade_id: str, token: str) -> Verdict:
        """Run one test cell against the kernel that connects with ``token``; return its verdict."""
        if grade_id not in self.tests:
            return Verdict.failure(grade_id, f"the source notebook has no test cell {grade_id!r:.80}")
        deadline = time.monotonic() + self.cell_timeout
        out = io.StringIO()
        passed, error, hidden, trace = False, None, False, ""
        channel = None
        try:
            sock = self._accept(token, deadline)
            channel = Channel(sock, deadline, self)
            channel.send(("begin", 0, self.references(grade_id)))
            for name in self.student_names:
                self.namespace[name] = _Undefined(name)
            for name, value in channel.names(self.student_names).items():
                self.namespace[name] = RemoteObject(channel, name, value._type_name) \
                    if type(value) is RemoteObject else value
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), testing.sending_to(channel), \
                    testing.secret_seed(self.secret) if self.secret is not None else contextlib.nullcontext():
                exec(compile(self.tests[grade_id], f"<test {grade_id}>", "exec"), self.namespace)
            passed = True
        except BaseException as exc:  # every way of failing is the verdict of this cell, never the tester's end
            error = (type(exc).__name__, str(exc)[:4000])
            hidden = _failed_in_hidden_part(exc, f"<test {grade_id}>", self.tests[grade_id])
            if not isinstance(exc, (AssertionError, TimeoutError, ChannelClosed, NameError, wire.WireError)):
                trace = traceback.format_exception_only(type(exc), exc)[-1][:4000]
        finally:
            if channel is not None:
                with contextlib.suppress(OSError):
                    channel.send(("done", 0, None))
                channel.sock.close()
        return Verdict(grade_id, passed, error, hidden, trace, out.getvalue()[-200_000:])

    def _accept(self, token: str, deadline: float) -> socket.socket:
        """The kernel's connection for this cell (the first one that says ``token``)."""
        while True:
            self.server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                raise ChannelClosed("the notebook never started the test (its kernel did not answer the grader)") from None
            sock.settimeout(None)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                hello = wire.decode(wire.recv_frame(sock, limit=4096))
                sock.settimeout(None)
            except Exception:
                sock.close()
                continue
            if hello == ["hello", token]:
                return sock
            sock.close()


def _hidden_lines(source: str) -> set[int]:
    """The 1-based line numbers of ``source`` between its BEGIN and END HIDDEN TESTS markers."""
    lines, inside = set(), False
    for number, line in enumerate(source.splitlines(), start=1):
        if HIDDEN_BEGIN in line:
            inside = True
        elif HIDDEN_END in line:
            inside = False
        elif inside:
            lines.add(number)
    return lines


def _failed_in_hidden_part(exc: BaseException, filename: str, source: str) -> bool:
    """Whether the test cell's statement that was running when ``exc`` was raised is a hidden test.

    The outermost frame of the cell's own code is the top-level statement that ran; a helper
    defined among the visible checks and called from a hidden one counts as hidden. Read from
    the tester's own traceback: nothing the student's kernel sends decides it.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    cell_lines = [f.lineno for f in frames if f.filename == filename and f.lineno is not None]
    return bool(cell_lines) and cell_lines[0] in _hidden_lines(source)


def _parse(source: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def _top_level_names(tree: ast.Module) -> list[str]:
    """Names a cell binds at top level: functions, classes, assignments."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    """Command line of the tester (started by the worker): one CellRequest per line in, one Verdict per line out."""
    args = TesterArgs.parse(argv)
    reply = sys.stdout
    sys.stdout = sys.stderr  # whatever else prints must not mix with the verdicts
    secret = os.environ.pop(SECRET_VARIABLE, None)
    tester = Tester(args.source, args.socket, args.cell_timeout, int(secret) if secret else None)
    print(TESTER_READY, file=reply, flush=True)
    for line in sys.stdin:
        try:
            request = CellRequest.from_line(line)
        except ContractError as exc:
            print(Verdict.failure("", str(exc)).to_line(), end="", file=reply, flush=True)
            continue
        print(tester.run(request.grade_id, request.token).to_line(), end="", file=reply, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
