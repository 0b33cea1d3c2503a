"""CUDA graphs for a whole training step, and a CPU stand-in that behaves like one (chapter 03).

A CUDA graph records the kernels of a region once (capture) and launches all of them again with
one call (replay), on the same memory: what changes between replays must be *copied into* the
tensors the graph was captured with. A training step becomes a graph in four moves
(``graph_step``): static copies of the inputs, a few warm-up steps (on a side stream on a GPU),
one capture, then per call: copy the new inputs in, replay, return the static outputs.

Two backends with the same three methods, ``new_graph()``, ``warmup()`` and ``capture(graph)``:

- ``CudaGraphs``: ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph``, the real thing;
- ``SimulatedGraphs``: for the CPU. Its graph records, under a ``TorchDispatchMode``, every ATen
  operator the captured region runs, with the very tensors it ran on, and replays that list: the
  same operators on the same memory, Python not involved. Like a CUDA capture, it leaves the
  tensors that existed before the capture as they were (it runs the work, then restores what the
  work overwrote), and it refuses what a CUDA capture refuses: an operator that needs a value
  on the host (``.item()``, ``nonzero``, a data-dependent ``if``).

Both count their captures and replays, so a test can see that a step was replayed, not re-run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["SimulatedGraph", "SimulatedGraphs", "CudaGraphs", "graphs_for", "graph_step"]

aten = torch.ops.aten

# Operators whose result the host must read before it can go on: a CUDA capture cannot contain them.
HOST_SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.equal, aten.is_nonzero}


class SimulatedGraph:
    """A recorded list of operators on fixed tensors; ``replay()`` runs it again (the CPU's CUDAGraph)."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list]] = []  # (operator, args, kwargs, results at capture)
        self.captures = 0
        self.replays = 0

    def replay(self) -> None:
        """Run every recorded operator again, writing each result into the tensor it produced at capture."""
        if not self.captures:
            raise RuntimeError("replay() of a graph that was never captured")
        with torch.no_grad():
            for func, args, kwargs, results in self.ops:
                for old, new in zip(results, tree_leaves(func(*args, **kwargs))):
                    # In-place operators and views write where they wrote at capture; others get copied there.
                    if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                        old.copy_(new)
        self.replays += 1


class _Recorder(TorchDispatchMode):
    """Records the operators of a capture; remembers what they overwrite of the memory that existed before it."""

    def __init__(self, graph: SimulatedGraph) -> None:
        super().__init__()
        self.graph = graph
        self.made: set[int] = set()  # storages allocated during the capture
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen: set[tuple] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function's markers: no work to replay
            return func(*args, **kwargs)
        if func.overloadpacket in HOST_SYNCS:
            raise RuntimeError(f"{func._schema.name} needs a value on the host: not allowed while a graph is being "
                               "captured (a CUDA capture fails the same way)")
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                self._keep(args[i] if i < len(args) else kwargs.get(arg.name))
        out = func(*args, **kwargs)
        results = tree_leaves(out)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        # New memory: results that are neither views of an input nor an input written in place.
        self.made.update(p for t in results if isinstance(t, torch.Tensor)
                         and (p := t.untyped_storage().data_ptr()) not in inputs)
        self.graph.ops.append((func, args, kwargs, results))
        return out

    def _keep(self, written: Any) -> None:
        """Save the values of tensors that existed before the capture and are about to be overwritten."""
        for t in tree_leaves(written):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in self.made:
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if key not in self.seen:
                self.seen.add(key)
                self.saved.append((t, t.detach().clone()))

    def restore(self) -> None:
        """Put back what the capture overwrote, last write first."""
        with torch.no_grad():
            for t, value in reversed(self.saved):
                t.copy_(value)


class SimulatedGraphs:
    """Graphs for the CPU: ``new_graph()``, ``warmup()`` (nothing to do) and ``capture(graph)``."""

    def __init__(self) -> None:
        self.graphs: list[SimulatedGraph] = []

    def new_graph(self) -> SimulatedGraph:
        """An empty graph, to be captured once."""
        self.graphs.append(SimulatedGraph())
        return self.graphs[-1]

    def warmup(self) -> contextlib.AbstractContextManager[None]:
        """Where warm-up runs: on a CPU, nowhere special."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def capture(self, graph: SimulatedGraph) -> Iterator[SimulatedGraph]:
        """Record the operators run inside the block into ``graph``; memory from before it is left unchanged."""
        if graph.captures:
            raise RuntimeError("this graph was already captured")
        recorder = _Recorder(graph)
        try:
            with recorder:
                yield graph
        finally:
            recorder.restore()
        graph.captures += 1


class _CountedCudaGraph(torch.cuda.CUDAGraph):
    """A CUDA graph that counts its replays (and, through ``CudaGraphs.capture``, its captures)."""

    captures = 0
    replays = 0

    def replay(self) -> None:
        self.replays += 1
        super().replay()


class CudaGraphs:
    """Real CUDA graphs: ``new_graph()`` (a counting ``CUDAGraph``), ``warmup()`` (a side stream), ``capture(graph)``."""

    def __init__(self) -> None:
        self.graphs: list[Any] = []

    def new_graph(self) -> Any:
        """A ``torch.cuda.CUDAGraph`` that also counts its captures and replays."""
        self.graphs.append(_CountedCudaGraph())
        return self.graphs[-1]

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        """Run the block on a side stream, as warm-up before a capture must (the allocator and the libraries settle there)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    @contextlib.contextmanager
    def capture(self, graph: Any) -> Iterator[Any]:
        """``torch.cuda.graph(graph)``: the kernels launched in the block are recorded, not run."""
        with torch.cuda.graph(graph):
            yield graph
        graph.captures += 1


def graphs_for(device: torch.device | str) -> SimulatedGraphs | CudaGraphs:
    """Real CUDA graphs on a CUDA device, the simulated ones elsewhere."""
    return CudaGraphs() if torch.device(device).type == "cuda" else SimulatedGraphs()


def graph_step(step: Callable[..., Any], example_inputs: Sequence[torch.Tensor], backend: Any,
               warmup: int = 3) -> Callable[..., Any]:
    """Capture ``step(*inputs)`` once in a graph of ``backend``; return a function that replays it on new inputs.

    Static copies of ``example_inputs`` are made; ``step`` runs ``warmup`` times on them inside
    ``backend.warmup()`` (lazy state such as optimizer buffers is created there, not in the graph),
    then once inside ``backend.capture(graph)``. The returned function copies its inputs into the
    static copies (ValueError if their number, shapes or dtypes differ: a graph replays fixed
    shapes), replays the graph and returns what ``step`` returned at capture: the same tensors
    every call, overwritten by the next replay.
    """
    static = [x.detach().clone() for x in example_inputs]
    with backend.warmup():
        for _ in range(warmup):
            step(*static)
    graph = backend.new_graph()
    with backend.capture(graph):
        outputs = step(*static)

    def replay(*inputs: torch.Tensor) -> Any:
        if len(inputs) != len(static):
            raise ValueError(f"the step was captured with {len(static)} inputs, got {len(inputs)}")
        for i, (buffer, x) in enumerate(zip(static, inputs)):
            if x.shape != buffer.shape or x.dtype != buffer.dtype:
                raise ValueError(f"input {i}: {tuple(x.shape)} {x.dtype}, but the graph was captured with "
                                 f"{tuple(buffer.shape)} {buffer.dtype}")
            buffer.copy_(x)
        graph.replay()
        return outputs

    return replay
