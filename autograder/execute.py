"""nbgrader's Execute step, with each test cell run by the kernel's judge and scored from its verdict.

For a test cell the kernel receives the source after a first line ``# autograder-judge <nonce>``,
which the kernel's input transformer turns into a call of its judge (see ``autograder.kernel``);
the notebook keeps the instructor's source. A kernel without the judge runs the cell as it is
and records no verdict, so the test fails. After the cell, the
verdict file must hold exactly one verdict for that cell's nonce, and it must say "passed":
otherwise the cell gets an error output (when it has none yet) and nbgrader scores it 0.
A verdict that is missing, doubled or contradicted (student code writing to the file, or
silencing the error the test raised) fails the cell.

Outputs are capped as they arrive (``max_output_bytes`` per notebook): a cell that prints
100 MB does not fill the grader's memory or the feedback.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from nbclient.util import run_sync
from nbformat import NotebookNode
from nbformat.v4 import new_output
from nbgrader.preprocessors import Execute
from traitlets import Integer, Unicode

from .course import is_test_cell
from .kernel import TEST_MARKER

TRUNCATED = "\n[output truncated by the grader: the notebook printed more than {} MB]\n"


class JudgedExecute(Execute):
    """Execute, with test cells judged by the kernel's judge and outputs capped."""

    judge_name = Unicode("", help="the judge's name in the kernel's builtins ('' runs cells as they are)").tag(config=True)
    verdict_file = Unicode("", help="file the judge appends its verdicts to").tag(config=True)
    max_output_bytes = Integer(8 * 2**20, help="outputs kept per notebook, in bytes").tag(config=True)

    async def async_execute_cell(self, cell: NotebookNode, cell_index: int, execution_count: int | None = None,
                                 store_history: bool = True) -> NotebookNode:
        """Run a cell; a test cell runs through the judge and is failed unless its verdict says passed."""
        if not (self.judge_name and is_test_cell(cell)):
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        nonce, source = secrets.token_hex(16), cell.source
        cell.source = f"{TEST_MARKER}{nonce}\n{source}"
        try:
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        finally:
            cell.source = source
            self._apply_verdict(cell, nonce)

    # nbconvert's preprocess_cell calls execute_cell, which nbclient binds to its own async_execute_cell.
    execute_cell = run_sync(async_execute_cell)

    def _apply_verdict(self, cell: NotebookNode, nonce: str) -> None:
        """Add an error output to ``cell`` unless the judge recorded exactly one passing verdict for ``nonce``."""
        verdicts = [v for v in _read_verdicts(Path(self.verdict_file)) if v.get("nonce") == nonce]
        if len(verdicts) == 1 and verdicts[0].get("passed") is True:
            return
        if any(o.output_type == "error" for o in cell.outputs):
            return
        if not verdicts:
            reason = "the test did not finish (no verdict from the judge)"
        elif len(verdicts) > 1:
            reason = "more than one verdict for this test: the notebook wrote to the judge's record"
        else:
            reason = str(verdicts[0].get("message") or "the test failed")
        name, sep, value = reason.partition(": ")
        if not sep or " " in name:
            name, value = "TestFailed", reason
        cell.outputs.append(new_output("error", ename=name, evalue=value, traceback=[f"{name}: {value}"]))

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


def _read_verdicts(path: Path) -> list[dict]:
    """The verdict lines of the judge's file (unreadable lines are skipped)."""
    if not path.is_file():
        return []
    verdicts = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            verdicts.append(json.loads(line))
        except ValueError:
            continue
    return verdicts
