"""nbgrader's Execute step, with each test cell judged by the trusted tester instead of the student's kernel.

The notebook's cells run in the sandboxed kernel as usual, except the test cells: for each one, the
tester (``autograder.tester``, a process of its own outside the sandbox) runs the instructor's test
source, and the kernel runs only ``autograder.agent.serve``, which answers the tester's calls of the
student's functions. The cell is then given, as outputs: what the student's code printed during
those calls (as plain text), what the test printed, and the tester's error when the test failed.
nbgrader scores the cell from those outputs, so the score is the tester's verdict and nothing the
kernel sends can change it.

Outputs are capped as they arrive (``max_output_bytes`` per notebook): a cell that prints
100 MB does not fill the grader's memory or the feedback.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from nbclient.util import run_sync
from nbformat import NotebookNode
from nbformat.v4 import new_output
from nbgrader.preprocessors import Execute
from traitlets import Dict, Float, Integer, Unicode

from .contracts import TESTER_READY, CellRequest, ContractError, TesterArgs, Verdict
from .course import is_test_cell

__all__ = ["HIDDEN_FAILURE", "VISIBLE_FAILURE", "TesterProcess", "TrustedExecute"]

TRUNCATED = "\n[output truncated by the grader: the notebook printed more than {} MB]\n"
# A line of output that the grader adds before the student's own printing in a test cell.
STUDENT_OUTPUT_LABEL = "[printed by the notebook's code during the test]\n"
# Said before a failing test's message: was the failing check one the student can read?
HIDDEN_FAILURE = "[a hidden test case failed; its code is not shown] "
VISIBLE_FAILURE = "[a visible test failed] "


class TesterProcess:
    """The trusted tester of one submission: a child process fed one ``CellRequest`` per line, answering ``Verdict`` lines."""

    def __init__(self, args: TesterArgs, env: dict[str, str], cwd: Path):
        self.cell_timeout = args.cell_timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autograder.tester", *args.argv()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=cwd, text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.grade_id = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line)
        self.lines.put(None)

    def _next(self, timeout: float) -> str:
        """The tester's next line; ContractError when it stopped or did not answer in time."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise ContractError("the grader's tester did not answer in time") from None
        if line is None:
            raise ContractError(f"the grader's tester stopped (exit status {self.proc.poll()})")
        return line

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until the tester has imported the tests' modules and listens."""
        line = self._next(timeout)
        if line.strip() != TESTER_READY:
            raise RuntimeError(f"the grader's tester did not start: {line.strip()[:200]}")

    def start(self, grade_id: str, token: str) -> None:
        """Ask for one test cell; the kernel must connect with ``token``."""
        self.grade_id = grade_id
        self.proc.stdin.write(CellRequest(grade_id, token).to_line())  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def verdict(self) -> Verdict:
        """The verdict of the cell asked for last (a failure when the tester gave none)."""
        try:
            verdict = Verdict.from_line(self._next(self.cell_timeout + 60))
        except ContractError as exc:
            return Verdict.failure(self.grade_id, str(exc))
        if verdict.grade_id != self.grade_id:
            return Verdict.failure(self.grade_id, f"the grader's tester answered for {verdict.grade_id!r:.80}")
        return verdict

    def stop(self) -> None:
        """End the tester."""
        self.proc.kill()
        self.proc.wait()


class TrustedExecute(Execute):
    """Execute, with test cells judged by the tester and outputs capped."""

    source_notebook = Unicode("", help="the chapter's source notebook (its test cells are the ones run)").tag(config=True)
    tester_socket = Unicode("", help="where the tester listens for the kernel").tag(config=True)
    tester_env = Dict({}, help="environment of the tester process").tag(config=True)
    tester_timeout = Float(0.0, help="seconds a test cell may take in the tester (default: the cell timeout)").tag(
        config=True)
    max_output_bytes = Integer(8 * 2**20, help="outputs kept per notebook, in bytes").tag(config=True)

    def preprocess(self, nb: NotebookNode, resources: Any = None, km: Any = None) -> Any:
        """Start the tester next to the kernel, run the notebook, end the tester."""
        args = TesterArgs(Path(self.source_notebook), Path(self.tester_socket),
                          self.tester_timeout or float(self.timeout or 120))
        self.tester = TesterProcess(args, self.tester_env or dict(os.environ), args.socket.parent)
        try:
            return super().preprocess(nb, resources, km)
        finally:
            self.tester.stop()

    async def async_execute_cell(self, cell: NotebookNode, cell_index: int, execution_count: int | None = None,
                                 store_history: bool = True) -> NotebookNode:
        """Run a cell; a test cell is run by the tester, with the kernel answering its calls."""
        if not is_test_cell(cell):
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        if not getattr(self, "_tester_ready", False):
            self.tester.wait_ready()
            self._tester_ready = True
        token, source = secrets.token_hex(16), cell.source
        self.tester.start(cell.metadata.nbgrader["grade_id"], token)
        cell.source = f"import autograder.agent\nautograder.agent.serve({self.tester_socket!r}, {token!r})"
        try:
            await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        finally:
            cell.source = source
        _judge(cell, self.tester.verdict())
        return cell

    # nbconvert's preprocess_cell calls execute_cell, which nbclient binds to its own async_execute_cell.
    execute_cell = run_sync(async_execute_cell)

    def output(self, outs: list[NotebookNode], msg: dict[str, Any], display_id: str | None,
               cell_index: int) -> NotebookNode | None:
        """Keep an output while the notebook's outputs stay under ``max_output_bytes``; then say they were cut."""
        size = len(json.dumps(msg.get("content", {}), default=str))
        self._output_bytes = getattr(self, "_output_bytes", 0) + size
        if self._output_bytes <= self.max_output_bytes or msg["msg_type"] == "error":
            return super().output(outs, msg, display_id, cell_index)
        if not getattr(self, "_truncated", False):
            self._truncated = True
            outs.append(new_output("stream", name="stdout", text=TRUNCATED.format(self.max_output_bytes // 2**20)))
        return None


def _judge(cell: NotebookNode, verdict: Verdict) -> None:
    """Give a test cell its outputs: the student's printing as text, the test's printing, the tester's error."""
    printed = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.get("name") != "stderr")
    errors = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.get("name") == "stderr")
    cell.outputs = []
    if printed:
        cell.outputs.append(new_output("stream", name="stdout", text=STUDENT_OUTPUT_LABEL + printed[-100_000:]))
    if errors:  # a test cell that writes to stderr fails, as nbgrader scores it (harmless library noise is dropped)
        cell.outputs.append(new_output("stream", name="stderr", text=errors[-100_000:]))
    if verdict.output:
        cell.outputs.append(new_output("stream", name="stdout", text=verdict.output))
    if verdict.passed and verdict.error is None:
        return
    name, value = verdict.error or ("TestFailed", "the test failed")
    value = (HIDDEN_FAILURE if verdict.hidden else VISIBLE_FAILURE) + value
    cell.outputs.append(new_output("error", ename=str(name), evalue=str(value), traceback=[f"{name}: {value}"]))
