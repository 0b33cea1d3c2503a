"""course_lib.dist: launching gloo ranks, failures and timeouts, no leftover processes, torchrun and notebooks."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.support import dist as cdist
from course_lib.support import torchrun

ROOT = Path(__file__).resolve().parents[1]


def _is_helper(proc: psutil.Process) -> bool:
    """multiprocessing's forkserver and resource tracker: they outlive a launch by design (GPU hosts only)."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd


def _children() -> set[int]:
    """Our descendants, ranks included, without multiprocessing's long-lived helper processes."""
    return {p.pid for p in psutil.Process().children(recursive=True) if not _is_helper(p)}


@pytest.fixture
def no_leftovers():
    """Fail the test if launch leaves a child process behind (whatever way the run ended)."""
    before = _children()
    yield
    left = _children() - before
    assert not left, f"launch left child processes behind: {sorted(left)}"


def _rank_times_ten() -> int:
    # Later ranks finish first: the results must still come back ordered by rank.
    time.sleep(0.05 * (dist.get_world_size() - dist.get_rank()))
    return dist.get_rank() * 10


def test_results_are_ordered_by_rank(no_leftovers) -> None:
    assert cdist.launch(_rank_times_ten, 4) == [0, 10, 20, 30]


def test_all_reduce_matches_single_process_sum(no_leftovers) -> None:
    def partial_sum() -> torch.Tensor:
        t = torch.randn(5, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
        dist.all_reduce(t)
        return t

    expected = sum(torch.randn(5, 3, generator=torch.Generator().manual_seed(r)) for r in range(3))
    results = cdist.launch(partial_sum, 3)
    for r, got in enumerate(results):
        torchrun.assert_matches_reference(got, expected, name=f"rank {r} all_reduce")


def test_nested_functions_lambdas_and_closures_work(no_leftovers) -> None:
    offset = 7

    def nested(x: int) -> int:
        return dist.get_rank() + x + offset  # a closure over a local: spawn could not pickle this

    assert cdist.launch(nested, 2, 1) == [8, 9]
    assert cdist.launch(lambda: dist.get_world_size(), 2) == [2, 2]


def test_kwargs_reach_the_function(no_leftovers) -> None:
    def scaled(x: int, *, scale: int = 1) -> tuple[int, str]:
        return x * scale, dist.get_backend()

    assert cdist.launch(scaled, 2, 3, scale=5) == [(15, "gloo"), (15, "gloo")]


def test_tensors_come_back_on_cpu_inside_containers(no_leftovers) -> None:
    def nested_result() -> dict:
        t = torch.ones(2, requires_grad=True) * 2
        return {"t": t, "pair": (t, [t + dist.get_rank()])}

    out = cdist.launch(nested_result, 2)
    assert out[1]["pair"][1][0].tolist() == [3.0, 3.0]
    assert out[0]["t"].device.type == "cpu" and not out[0]["t"].requires_grad
    assert cdist.launch(lambda: str(cdist.rank_device()), 2) == ["cpu", "cpu"]


def test_two_launches_in_a_row_get_free_ports(no_leftovers) -> None:
    assert cdist.launch(lambda: 1, 2) == [1, 1]
    assert cdist.launch(lambda: 2, 2) == [2, 2]


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad shard size 17")
    dist.barrier()  # rank 0 waits here for a rank that will never come


def test_a_rank_error_names_the_rank_and_comes_back_promptly(no_leftovers) -> None:
    start = time.monotonic()
    with pytest.raises(cdist.RankError) as info:
        cdist.launch(_fail_on_rank_one, 2, timeout=300)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 1 raised ValueError: bad shard size 17"), message
    assert "Traceback" in message and "_fail_on_rank_one" in message and 'raise ValueError("bad shard size 17")' in message
    assert info.value.ranks[0] == 1
    # Promptly means long before the timeout, whatever the load: the error does not wait for the barrier to time out.
    assert elapsed < 100, f"launch took {elapsed:.1f} s to report a failing rank (timeout was 300 s)"


def test_a_rank_that_dies_without_reporting_is_an_error(no_leftovers) -> None:
    with pytest.raises(cdist.RankError, match="rank 0 exited with code 3 without reporting a result"):
        cdist.launch(lambda: os._exit(3) if dist.get_rank() == 0 else dist.barrier(), 2, timeout=300)


def test_an_unpicklable_result_is_a_rank_error(no_leftovers) -> None:
    with pytest.raises(cdist.RankError, match="rank 0 raised"):
        cdist.launch(lambda: (lambda: None), 1)


def test_a_hung_rank_times_out_naming_it(no_leftovers) -> None:
    def hang() -> None:
        dist.barrier()  # both ranks are up; only rank 1 then hangs
        if dist.get_rank() == 1:
            time.sleep(120)

    # Long enough for rank 0 to start, finish and report on a loaded 2-core machine (a hang only: the
    # hung rank sleeps far longer).
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] still running after 30 s"):
        cdist.launch(hang, 2, timeout=30)
    assert time.monotonic() - start < 30 + 20


def test_ctrl_c_while_waiting_stops_the_ranks(no_leftovers) -> None:
    # pytest-xdist workers ignore SIGINT (Ctrl-C is the controller's); a notebook kernel does not.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            cdist.launch(time.sleep, 2, 600, timeout=900)
        # Stopped by the interrupt, not by the ranks' end or the timeout (a loaded machine may take seconds).
        assert time.monotonic() - start < 120
    finally:
        signal.signal(signal.SIGINT, previous)


def test_rank_output_is_replayed_with_the_rank(capfd, no_leftovers) -> None:
    def chatty() -> None:
        print("partial", end="")
        print(" line", dist.get_rank())
        print("to stderr", file=sys.stderr)

    cdist.launch(chatty, 2)
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] partial line 0", "[rank 1] partial line 1"]
    assert sorted(err.splitlines()) == ["[rank 0] to stderr", "[rank 1] to stderr"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice")
def test_backend_for_is_gloo_without_gpus() -> None:
    assert cdist.backend_for(1) == "gloo" and cdist.backend_for(4) == "gloo"


def test_forkserver_without_cloudpickle_asks_for_a_module(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # makes `import cloudpickle` fail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="define the function in a module"):
        cdist.launch(lambda: 0, 2)


def test_forkserver_path_sends_a_closure_by_value(monkeypatch) -> None:
    # Where there is a GPU, ranks fork from a clean forkserver and fn travels pickled by value.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _children()
    factor = 3
    assert cdist.launch(lambda: dist.get_rank() * factor, 2, backend="gloo", timeout=120) == [0, 3]
    # A second launch reuses the server; output, failures and results work as under fork.
    with pytest.raises(cdist.RankError, match="rank 1 raised ValueError"):
        cdist.launch(
            lambda: (_ for _ in ()).throw(ValueError("boom")) if dist.get_rank() == 1 else 0, 2, backend="gloo", timeout=120
        )
    # The forkserver outlives a launch by design; no rank may.
    left = _children() - before
    assert not left, f"ranks left behind: {sorted(left)}"


def test_pick_for_and_backend_for_without_enough_gpus(monkeypatch, capsys) -> None:
    assert cdist.pick_for(2, cpu=64, gpu=4096) == (4096 if torch.cuda.device_count() >= 2 else 64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cdist, "_said_gloo", False)
    assert cdist.pick_for(1, cpu="small", gpu="big") == "big" and cdist.pick_for(2, cpu="small", gpu="big") == "small"
    assert [cdist.backend_for(n) for n in (1, 2, 4, 4)] == ["nccl", "gloo", "gloo", "gloo"]
    # Said once per process, so a cell's output does not depend on how many launches came before.
    assert capsys.readouterr().out.count("use gloo on the CPU") == 1


@pytest.fixture
def forked_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks forked from this process (as on a machine without a GPU), so that they inherit its monkeypatches.

    On a GPU machine ``launch`` starts ranks from a forkserver, which a patch made here does not reach.
    This process never initialises CUDA, so forking it is safe there too.
    """
    monkeypatch.setattr(cdist, "_context_and_payload", lambda fn, args, kwargs: (mp.get_context("fork"), (fn, args, kwargs)))


def test_a_failed_gloo_mesh_setup_is_retried_once(no_leftovers, forked_ranks, monkeypatch, tmp_path) -> None:
    # gloo's set-up occasionally fails with "Connection closed by peer" before any user code runs.
    real_init = dist.init_process_group
    marker = tmp_path / "failed_once"

    def flaky_init(*args, **kwargs):
        if kwargs["rank"] == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", flaky_init)  # forked ranks inherit the patch
    assert cdist.launch(lambda: dist.get_rank() + 10, 2, timeout=300) == [10, 11]
    assert marker.exists()


def test_an_error_in_init_other_than_the_mesh_is_not_retried(no_leftovers, forked_ranks, monkeypatch) -> None:
    def broken_init(*args, **kwargs):
        raise RuntimeError("no such backend")

    monkeypatch.setattr(dist, "init_process_group", broken_init)
    with pytest.raises(cdist.RankError, match="no such backend"):
        cdist.launch(lambda: 0, 2, timeout=60)


def test_concurrent_launches_keep_to_their_own_groups() -> None:
    # Each launch serves its own rendezvous store; two at once must not join each other's ranks.
    results: dict[int, list] = {}

    def run(tag: int) -> None:
        results[tag] = cdist.launch(lambda: float(dist.get_world_size() * 10 + tag), 2 + tag, timeout=120)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: [20.0, 20.0], 1: [31.0, 31.0, 31.0]}


def test_assert_same_across_ranks_passes_and_names_the_differing_rank(no_leftovers) -> None:
    cdist.launch(lambda: torchrun.assert_same_across_ranks(torch.arange(4.0), "weights"), 3)

    def differ() -> None:
        torchrun.assert_same_across_ranks(torch.arange(4.0) + (dist.get_rank() == 2), "weights")

    with pytest.raises(cdist.RankError, match=r"AssertionError: weights differs between ranks: rank 2 vs rank 0"):
        cdist.launch(differ, 3)


def test_assert_matches_reference_on_tensors_lists_and_modules() -> None:
    a = torch.randn(3, 4)
    torchrun.assert_matches_reference(a, a.clone())
    torchrun.assert_matches_reference([a, a + 1], [a.clone(), a + 1])
    with pytest.raises(AssertionError, match=r"grads\[1\]: 1 of 12 element"):
        b = a.clone()
        b[0, 0] += 1
        torchrun.assert_matches_reference([a, b], [a, a], name="grads")
    with pytest.raises(AssertionError, match="grads: 1 tensors, expected 2"):
        torchrun.assert_matches_reference([a], [a, a], name="grads")

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    par = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    par.load_state_dict(ref.state_dict())
    torchrun.assert_matches_reference(par, ref, name="model")  # no gradients yet: parameters only
    for m in (ref, par):
        m(torch.ones(2, 4)).sum().backward()
    torchrun.assert_matches_reference(par, ref, name="model")

    class Wrapped(nn.Module):  # what DDP looks like: the model under .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    torchrun.assert_matches_reference(Wrapped(par), ref, name="model")
    with torch.no_grad():
        par[2].bias.grad[1] += 0.5
    with pytest.raises(AssertionError, match=r"model\.2\.bias\.grad: 1 of 2 element"):
        torchrun.assert_matches_reference(par, ref, name="model")
    par[2].bias.grad = None
    with pytest.raises(AssertionError, match=r"model\.2\.bias\.grad: missing in the result"):
        torchrun.assert_matches_reference(par, ref, name="model")
    with torch.no_grad():
        par[0].weight[0, 0] += 1
    with pytest.raises(AssertionError, match=r"model\.0\.weight: 1 of 12 element"):
        torchrun.assert_matches_reference(par, ref, name="model")
    with pytest.raises(AssertionError, match="parameter names differ"):
        torchrun.assert_matches_reference(nn.Linear(4, 3), ref, name="model")


def test_init_from_torchrun_and_run_as_script(tmp_path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from course_lib.support.torchrun import init_from_torchrun, run_as_script

        def main(scale):
            t = torch.tensor([float(dist.get_rank() + 1)]) * scale
            dist.all_reduce(t)
            print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():g}")

        if __name__ == "__main__":
            run_as_script(main, 2)
            assert not dist.is_initialized()
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, env=env, timeout=600,  # for a hang only
    )
    assert run.returncode == 0, torchrun.explain_failure(run.stdout + run.stderr) + "\n" + run.stdout + run.stderr
    # The two processes share one stdout, so their lines may interleave: look for each report, not for lines.
    assert sorted(re.findall(r"rank \d of \d: \d+", run.stdout)) == ["rank 0 of 2: 6", "rank 1 of 2: 6"], run.stdout


def test_init_from_torchrun_outside_torchrun_says_how_to_start(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node N"):
        torchrun.init_from_torchrun()


@pytest.mark.slow
def test_launch_from_a_notebook_cell_shows_rank_output() -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent("""
        import torch, torch.distributed as dist
        from course_lib.support.dist import launch

        def greet(x):
            t = torch.tensor([x * (dist.get_rank() + 1)])
            dist.all_reduce(t)
            print(f"hello from rank {dist.get_rank()}")
            return t.item()

        print("results:", launch(greet, 2, 10))
    """))]
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = nb.cells[0].outputs
    assert all(o["output_type"] == "stream" and o["name"] == "stdout" for o in outputs), outputs
    lines = "".join(o["text"] for o in outputs).splitlines()
    # (On a machine with one GPU, launch first says once that two ranks run gloo on the CPU.)
    lines = [line for line in lines if not line.startswith("launch: ")]
    assert sorted(lines[:2]) == ["[rank 0] hello from rank 0", "[rank 1] hello from rank 1"], lines
    assert lines[2:] == ["results: [30, 30]"], lines


def _layer_norm_sum() -> float:
    return float(torch.nn.functional.layer_norm(torch.ones(64, 256), (256,)).sum())


def test_a_rank_forked_after_the_parent_ran_parallel_work_does_not_hang() -> None:
    # The parent uses its OpenMP pool first; a forked rank that then asked for several threads hung.
    torch.nn.functional.layer_norm(torch.randn(512, 1024), (1024,))
    assert cdist.launch(_layer_norm_sum, 1, timeout=300) == [0.0]


def _functional_all_reduce() -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    # Returns an AsyncCollectiveTensor: the reduction may still be in flight when fn returns.
    return funcol.all_reduce(torch.full((4,), float(dist.get_rank() + 1)), "sum", dist.group.WORLD)


def test_results_wait_for_collectives_still_in_flight() -> None:
    results = cdist.launch(_functional_all_reduce, 2)
    for rank, result in enumerate(results):
        assert type(result) is torch.Tensor and torch.equal(result, torch.full((4,), 3.0)), (rank, result)


def _store_timeout_s() -> float:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store().timeout.total_seconds()


def test_the_ranks_own_timeouts_lie_past_the_launch_deadline(no_leftovers) -> None:
    # So a rank stuck in a collective is stopped and named by launch (TimeoutError), never reported first by
    # its own store or group timing out at the same moment (a RankError that races with the deadline).
    assert all(t > 10 for t in cdist.launch(_store_timeout_s, 2, timeout=10))
