"""The grading kernel: ipykernel with the memory limit, and for chapters still marked ``in-kernel`` the old judge.

Chapters are graded by the trusted tester (``autograder.tester``), outside this process. The
judge below is kept only for the chapters whose source notebook still says
``"autograder": {"judge": "in-kernel"}`` in its metadata (their tests launch ranks from the
student's process and are being moved to the tester); it is removed with the last of them.

Started by the grader's kernelspec (``python -m autograder.kernel -f CONNECTION_FILE``, inside
bubblewrap; see ``autograder.sandbox``). Before the first cell it:

1. reads its settings from the file named by ``AUTOGRADER_JUDGE`` (then deletes the file and the
   variable) and drops ``NBGRADER_EXECUTION``, so student code cannot tell it is being graded;
2. on a CPU, sets ``RLIMIT_AS`` (a memory bomb gets ``MemoryError``; never with CUDA, which
   reserves huge virtual ranges: there the grader's memory cgroup holds);
3. imports the trusted modules and takes a snapshot of what a test relies on (see ``Judge``);
4. puts the judge in ``builtins`` under a random name and starts ipykernel.

The grader sends each test cell with a first line ``# autograder-judge <nonce>``; an input
transformer installed here turns it into ``<judge>(nonce, source)``. The judge restores the snapshot,
runs the instructor's test source in the notebook's namespace, checks that nothing in the
snapshot changed while it ran, and appends its verdict for ``nonce`` to a file the grader reads.
The grader scores the cell from that verdict and from the cell's error outputs: a test passes only
when both say so (``autograder.execute``).
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import resource
import sys
import types
from typing import Any

CONFIG_VARIABLE = "AUTOGRADER_JUDGE"
# First line of a test cell as the grader sends it: "# autograder-judge <nonce>".
TEST_MARKER = "# autograder-judge "
# Modules whose attributes a test may use; their namespaces are put back before each test.
TRUSTED_MODULES = ("builtins", "math", "operator", "numpy", "numpy.testing", "torch", "torch.testing",
                   "course_lib.testing")
TRUSTED_CLASSES = (("torch", "Tensor"),)
# How IPython runs a cell and reports its errors.
SHELL_ATTRIBUTES = ("run_cell", "run_cell_async", "run_ast_nodes", "run_code", "showtraceback", "showsyntaxerror",
                    "_showtraceback", "set_custom_exc", "transform_cell", "should_run_async", "get_exception_only",
                    "custom_exceptions", "CustomTB", "InteractiveTB", "SyntaxTB", "excepthook", "user_ns")
# In torch, numpy, math, operator and torch.Tensor, the attributes whose change *during* a test fails it.
# (Libraries change others legitimately when a test imports them: torch._dynamo wraps torch.manual_seed.)
COMPARISONS = frozenset({"allclose", "isclose", "equal", "eq", "ne", "__eq__", "__ne__", "array_equal", "array_equiv",
                         "all", "any", "abs", "isnan", "isinf", "isfinite", "item", "tolist", "__bool__", "__float__",
                         "__int__", "truth", "not_", "testing"})
KERNEL_ATTRIBUTES = ("do_execute", "execute_request", "dispatch_shell", "shell_handlers", "session", "iopub_socket")
SYS_ATTRIBUTES = ("excepthook", "displayhook", "stdout", "stderr", "modules", "meta_path", "path_hooks", "settrace",
                  "gettrace", "setprofile", "getprofile")
_MISSING = object()


class Judge:
    """The trusted state of the kernel, taken before student code runs, and the runner of test cells."""

    def __init__(self, shell: Any, kernel: Any, imports: list[str], verdict_path: str):
        self.shell, self.kernel = shell, kernel
        self.entries: list[tuple[Any, str, Any]] = []
        for name in TRUSTED_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            self._keep_namespace(module)
            self.entries.append((sys.modules, name, module))
            for value in list(vars(module).values()):
                if isinstance(value, types.FunctionType) and value.__module__ == name:
                    for attr in ("__code__", "__defaults__", "__kwdefaults__"):
                        self.entries.append((value, attr, getattr(value, attr)))
        for module_name, class_name in TRUSTED_CLASSES:
            cls = getattr(sys.modules.get(module_name), class_name, None)
            if cls is not None:
                self._keep_namespace(cls)
        for owner, names in ((shell, SHELL_ATTRIBUTES), (kernel, KERNEL_ATTRIBUTES), (sys, SYS_ATTRIBUTES)):
            for name in names:
                self.entries.append((owner, name, vars(owner).get(name, _MISSING)))
            for cls in type(owner).__mro__ if owner is not sys else ():
                self._keep_namespace(cls, names)
        self.handlers = dict(kernel.shell_handlers)
        self.bindings = _trusted_bindings(imports)
        self.user_ns = shell.user_ns
        self.verdicts = os.open(verdict_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._write, self._compile, self._exec = os.write, compile, exec
        self._dumps, self._settrace = json.dumps, sys.settrace

    def _keep_namespace(self, owner: Any, names: tuple[str, ...] | None = None) -> None:
        """Remember ``names`` of ``owner``, or (without names) its functions, classes and modules, as they are now."""
        namespace = vars(owner)
        for name in names if names is not None else list(namespace):
            value = namespace.get(name, _MISSING)
            if names is not None or callable(value) or isinstance(value, types.ModuleType):
                self.entries.append((owner, name, value))

    def restore(self) -> list[str]:
        """Put back every remembered attribute that changed; return those of them that a test must be able to trust."""
        changed = []
        for owner, name, value in self.entries:
            current = _current(owner, name)
            if current is value:
                continue
            if _critical(owner, name):
                changed.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
            try:
                if isinstance(owner, dict):
                    owner[name] = value
                elif value is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, value)
            except (AttributeError, TypeError):
                continue
        if self.kernel.shell_handlers != self.handlers:
            changed.append("kernel.shell_handlers")
            self.kernel.shell_handlers.clear()
            self.kernel.shell_handlers.update(self.handlers)
        if sys.gettrace() is not None or sys.getprofile() is not None:
            changed.append("sys.settrace")
            self._settrace(None)
            sys.setprofile(None)
        for name, value in self.bindings.items():
            if self.user_ns.get(name, _MISSING) is not value:
                self.user_ns[name] = value
        self.user_ns["__builtins__"] = builtins
        return changed

    def transformer(self, name: str) -> Any:
        """An IPython input transformer that turns a marked test cell into a call of the judge, named ``name``."""
        def to_judge_call(lines: list[str]) -> list[str]:
            if not lines or not lines[0].startswith(TEST_MARKER):
                return lines
            nonce = lines[0][len(TEST_MARKER):].strip()
            return [f"{name}({nonce!r}, {''.join(lines[1:])!r})\n"]
        return to_judge_call

    def run_test(self, nonce: str, source: str) -> None:
        """Run a test cell's source with the trusted state in place; record the verdict for ``nonce``."""
        self.restore()
        try:
            code = self._compile(self.shell.transform_cell(source), "<test cell>", "exec")
            self._exec(code, self.user_ns)
        except BaseException as exc:
            self._record(nonce, False, f"{type(exc).__name__}: {exc}")
            raise
        changed = self.restore()
        if changed:
            message = f"the notebook changed what the tests rely on while they ran: {', '.join(changed[:5])}"
            self._record(nonce, False, message)
            raise AssertionError(message)
        self._record(nonce, True, "")

    def _record(self, nonce: str, passed: bool, message: str) -> None:
        """Append one verdict line for the grader."""
        self._write(self.verdicts, (self._dumps({"nonce": nonce, "passed": passed, "message": message[:500]}) +
                                    "\n").encode())


def _critical(owner: Any, name: str) -> bool:
    """Whether a change of ``name`` on ``owner`` while a test runs fails the test (see COMPARISONS)."""
    if isinstance(owner, types.ModuleType) and owner.__name__ not in ("builtins", "sys", "course_lib.testing"):
        return name in COMPARISONS or owner.__name__.endswith(".testing")
    if isinstance(owner, type) and owner.__module__.split(".")[0] == "torch":
        return name in COMPARISONS
    return True


def _current(owner: Any, name: str) -> Any:
    """The value of ``name`` on ``owner`` as stored: a function's attribute, a dict's item, or an entry of its ``vars``."""
    if isinstance(owner, types.FunctionType):
        return getattr(owner, name)
    if isinstance(owner, dict):
        return owner.get(name, _MISSING)
    return vars(owner).get(name, _MISSING)


def _trusted_bindings(imports: list[str]) -> dict[str, Any]:
    """The names that the instructor's import statements bind, evaluated now, before student code."""
    namespace: dict[str, Any] = {}
    for statement in imports:
        try:
            exec(statement, namespace)
        except Exception:  # an import that needs the notebook's folder, say: the notebook's own cells bind it
            continue
    namespace.pop("__builtins__", None)
    return namespace


def _read_settings() -> dict[str, Any]:
    """The judge's settings from the grader, read once and then deleted with their variable."""
    os.environ.pop("NBGRADER_EXECUTION", None)
    path = os.environ.pop(CONFIG_VARIABLE, None)
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        settings = json.load(f)
    os.unlink(path)
    return settings


def main() -> None:
    """Start an ipykernel with the judge in place."""
    from ipykernel.kernelapp import IPKernelApp

    settings = _read_settings()
    if settings.get("memory_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (settings["memory_bytes"], settings["memory_bytes"]))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)  # as ipykernel_launcher does: the notebook's folder is not a package root
    app = IPKernelApp.instance()
    app.initialize(sys.argv[1:])
    if settings.get("name"):  # a chapter marked in-kernel: install the old judge
        judge = Judge(app.shell, app.kernel, settings["imports"], settings["verdicts"])
        setattr(builtins, settings["name"], judge.run_test)
        judge.entries.append((builtins, settings["name"], judge.run_test))
        app.shell.input_transformers_cleanup.insert(0, judge.transformer(settings["name"]))
    app.start()


if __name__ == "__main__":
    main()
