"""course_lib.graphs: the simulated graph replays a captured training step exactly, and refuses what CUDA refuses."""

import pytest
import torch

from course_lib import graphs, models

CFG = models.GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def _trainer(seed: int = 0, device: str = "cpu"):
    model = models.GPT(CFG, seed=seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, calls


def _batches(n: int, device: str = "cpu") -> list:
    return [models.random_batch(CFG, 4, seed=i, device=device) for i in range(n)]


def _check_replays_equal_eager(backend: object, device: str) -> None:
    batches = _batches(5, device)
    model, step, calls = _trainer(device=device)
    graphed = graphs.graph_step(step, batches[0], backend, warmup=2)
    got = [graphed(*b).clone() for b in batches[1:]]
    assert len(calls) == 3, "two warm-up calls and one capture; replays do not call the step"
    twin, eager, _ = _trainer(device=device)
    for _ in range(2):
        eager(*batches[0])
    want = [eager(*b) for b in batches[1:]]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    (graph,) = backend.graphs
    assert (graph.captures, graph.replays) == (1, 4)


def test_simulated_graph_replays_a_training_step_exactly() -> None:
    _check_replays_equal_eager(graphs.SimulatedGraphs(), "cpu")


@pytest.mark.gpu
def test_cuda_graph_replays_a_training_step() -> None:
    _check_replays_equal_eager(graphs.CudaGraphs(), "cuda")


def test_capture_leaves_earlier_memory_unchanged_and_outputs_are_static() -> None:
    backend = graphs.SimulatedGraphs()
    w = torch.ones(3)
    x = torch.zeros(3)
    graph = backend.new_graph()
    with backend.capture(graph):
        w.add_(x)
        out = w * 2
    assert torch.equal(w, torch.ones(3)), "a capture records work; it does not leave its effects"
    x.fill_(1.0)
    graph.replay()
    assert torch.equal(w, torch.full((3,), 2.0)) and torch.equal(out, torch.full((3,), 4.0))
    graph.replay()
    assert torch.equal(out, torch.full((3,), 6.0)), "replays write into the tensors of the capture"


def test_capture_refuses_host_syncs_and_reuse() -> None:
    backend = graphs.SimulatedGraphs()
    graph = backend.new_graph()
    with pytest.raises(RuntimeError, match="host"), backend.capture(graph):
        torch.ones(2).sum().item()
    with pytest.raises(RuntimeError, match="never captured"):
        graph.replay()
    with backend.capture(graph):
        torch.ones(2) * 2
    with pytest.raises(RuntimeError, match="already"), backend.capture(graph):
        pass


def test_graph_step_rejects_other_shapes() -> None:
    _, step, _ = _trainer()
    x, y = _batches(1)[0]
    graphed = graphs.graph_step(step, (x, y), graphs.SimulatedGraphs(), warmup=1)
    with pytest.raises(ValueError, match="captured with"):
        graphed(x[:1], y[:1])
    with pytest.raises(ValueError):
        graphed(x)


def test_graphs_for() -> None:
    assert isinstance(graphs.graphs_for("cpu"), graphs.SimulatedGraphs)
    assert isinstance(graphs.graphs_for(torch.device("cuda", 0)), graphs.CudaGraphs)


def test_the_committed_gpu_record_holds_what_chapter_03_renders() -> None:
    from course_lib.support.records import load_record

    try:
        record = load_record("step_graphs_h200.json")
    except FileNotFoundError:
        pytest.skip("python -m benchmarks.step_graphs has not been run on the H200 yet")
    models_measured = record.section("step_modes")["models"]
    assert len(models_measured) == 2
    for entry in models_measured.values():
        rows = {row["mode"]: row for row in entry["rows"]}
        assert set(rows) == {"eager", "compile", "graph", "compile + graph"}
        assert "step_ms" in rows["eager"] and "step_ms" in rows["graph"], "eager and the graph must have run"
        for row in rows.values():
            if "step_ms" in row:
                assert row["p10_ms"] <= row["step_ms"] <= row["p90_ms"] and 0 < row["mfu"] < 1
