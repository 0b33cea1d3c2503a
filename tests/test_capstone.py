"""Tests for course_lib.capstone: the assembled run against plain PyTorch and DP x TP, the ablation, the all-at-once run."""

import dataclasses
import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import capstone, hybrid, models
from course_lib.attention import tiled_attention, tiled_attention_backward
from course_lib.kernels.fusion import adam_step_
from course_lib.support.dist import launch


def test_flops_per_step_is_six_n_plus_attention():
    cfg = models.GPTConfig.small()
    matmul_params = 12 * cfg.n_layer * cfg.d_model**2 + cfg.vocab_size * cfg.d_model
    tokens = 4 * cfg.seq_len
    want = 6 * matmul_params * tokens + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len * tokens
    assert math.isclose(capstone.flops_per_step(cfg, 4), want, rel_tol=1e-12)


def test_device_peak_flops_on_a_cpu_is_measured():
    rate, source = capstone.device_peak_flops(torch.device("cpu"))
    assert rate > 0 and "CPU" in source


def test_tiny_run_learns_and_reports():
    run = capstone.RunConfig("tiny", steps=6, batch_size=4, seq_len=32, compile=False, warmup=2, lr=3e-3)
    res = capstone.train(run, progress=False, peak=(1e12, "test"))
    assert len(res.losses) == 8
    assert res.losses[-1] < res.losses[0]
    assert res.tokens_per_s > 0 and res.mfu > 0
    assert math.isclose(res.mfu, capstone.flops_per_step(run.model_config(), 4) / res.step_s / 1e12, rel_tol=1e-9)
    assert res.params == models.gpt_param_count(run.model_config())


def test_baseline_switches_everything_off():
    base = dataclasses.replace(capstone.RunConfig.for_this_machine(), fused_loss=True, course_adam=True,
                               bf16_weights=True).baseline()
    assert not (base.bf16 or base.compile or base.fused_adam or base.checkpointing or base.fused_loss or base.course_adam
                or base.bf16_weights)


def test_course_adam_trains_as_adamw():
    # Chapter 08's flat Adam with decoupled decay 0.01 is torch's AdamW default: the same losses in fp32.
    run = capstone.RunConfig("tiny", steps=3, batch_size=2, seq_len=16, compile=False, bf16=False, warmup=1, lr=3e-3)
    plain = capstone.train(run, progress=False, peak=(1e12, "test"))
    flat = capstone.train(dataclasses.replace(run, course_adam=True), progress=False, peak=(1e12, "test"))
    assert flat.extra["course_adam"] is True and flat.extra["fused_adam"] is False
    assert plain.extra["course_adam"] is False
    assert flat.losses == pytest.approx(plain.losses, rel=1e-4)
    assert flat.losses[-1] != pytest.approx(flat.losses[0], rel=1e-3)  # it did train


def _mlp_is(flag):
    """What every block's MLP must be once ``flag`` replaces its GELU."""
    from course_lib.erfc import fitted_gelu
    from course_lib.kernels.fused_mlp import FusedFeedForward
    from course_lib.kernels.gelu_op import KernelGeluFeedForward

    return {"fused_mlp": lambda mlp: isinstance(mlp, FusedFeedForward),  # GELU in the matmuls' epilogues
            "fitted_gelu": lambda mlp: mlp.activation is fitted_gelu,  # the fitted erfc in PyTorch ops
            "kernel_gelu": lambda mlp: isinstance(mlp, KernelGeluFeedForward)}[flag]  # chapter 08's kernel, custom op


@pytest.mark.parametrize("flag, rel", [("fused_mlp", 1e-3), ("fitted_gelu", 1e-4), ("kernel_gelu", 1e-4)])
def test_gelu_replacements_train_like_the_exact_gelu(flag, rel):
    # Each way of replacing the MLP's GELU, in fp32: the exact GELU's losses up to the fitted erfc's
    # error (and, fused into a matmul, a different order of sums), the model's own parameters, every
    # block switched, off in the baseline, and no two replacements at once.
    run = capstone.RunConfig("tiny", steps=3, batch_size=2, seq_len=16, compile=False, bf16=False, warmup=1, lr=3e-3)
    exact = capstone.train(run, progress=False, peak=(1e12, "test"))
    replaced = capstone.train(dataclasses.replace(run, **{flag: True}), progress=False, peak=(1e12, "test"))
    assert replaced.extra[flag] is True and exact.extra[flag] is False
    assert replaced.losses == pytest.approx(exact.losses, rel=rel)
    assert replaced.losses[-1] != pytest.approx(replaced.losses[0], rel=1e-3)  # it did train
    _, model, _ = capstone.training_step(dataclasses.replace(run, **{flag: True}))
    assert all(_mlp_is(flag)(block.mlp) for block in model.blocks)
    assert getattr(capstone.RunConfig(**{flag: True}).baseline(), flag) is False
    other = "fitted_gelu" if flag != "fitted_gelu" else "kernel_gelu"
    with pytest.raises(ValueError, match="choose one"):
        capstone.training_step(dataclasses.replace(run, **{flag: True, other: True}))


def test_cuda_graphs_compile_in_reduce_overhead_mode(monkeypatch):
    # The compiled part goes through torch.compile(mode="reduce-overhead"); on a CPU no graph is recorded,
    # and the run must train exactly as the same run compiled without it. Needs compile.
    modes = []

    def fake_compile(fn, **kwargs):
        modes.append(kwargs.get("mode"))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    run = capstone.RunConfig("tiny", steps=3, batch_size=2, seq_len=16, bf16=False, warmup=1, lr=3e-3)
    plain = capstone.train(run, progress=False, peak=(1e12, "test"))
    graphed = capstone.train(dataclasses.replace(run, cuda_graphs=True), progress=False, peak=(1e12, "test"))
    assert modes == [None, "reduce-overhead"]
    assert graphed.losses == plain.losses and graphed.extra["cuda_graphs"] is False  # no graphs on a CPU
    with pytest.raises(ValueError, match="cuda_graphs needs compile"):
        capstone.training_step(dataclasses.replace(run, compile=False, cuda_graphs=True))
    assert capstone.RunConfig(cuda_graphs=True).baseline().cuda_graphs is False


@pytest.mark.gpu
@pytest.mark.parametrize("fused_loss", [False, True])
def test_cuda_graphs_train_like_the_compiled_run_gpu(fused_loss):
    # Replayed graphs compute what the compiled kernels compute; every step's loss is kept, so a loss
    # that lived in a graph's output memory (the unfused path) would show the next step's value.
    run = capstone.RunConfig("tiny", steps=4, batch_size=4, warmup=2, lr=3e-3, fused_loss=fused_loss,
                             bf16_weights=fused_loss)
    plain = capstone.train(run, progress=False)
    graphed = capstone.train(dataclasses.replace(run, cuda_graphs=True), progress=False)
    assert graphed.extra["cuda_graphs"] is True
    assert graphed.losses == pytest.approx(plain.losses, rel=1e-2)
    assert len(set(graphed.losses)) == len(graphed.losses)  # each step's own loss, not one buffer's last value


@pytest.mark.gpu
def test_fitted_gelu_and_kernel_gelu_compile_gpu():
    # torch.compile turns the autograd.Function into its own fused kernels: the same values and
    # gradients as eager PyTorch within a bf16 rounding; compiled runs with it and with the bias+GELU
    # kernel's custom op train like the exact GELU's.
    from course_lib.erfc import fitted_gelu

    torch.manual_seed(0)
    z = (4 * torch.randn(2048, 3072, device="cuda")).bfloat16().requires_grad_()
    z_eager = z.detach().clone().requires_grad_()
    dy = torch.randn_like(z)
    y = torch.compile(fitted_gelu)(z)
    y.backward(dy)
    y_eager = fitted_gelu(z_eager)
    y_eager.backward(dy)
    torch.testing.assert_close(y, y_eager, atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(z.grad, z_eager.grad, atol=1e-6, rtol=2**-7)
    run = capstone.RunConfig("tiny", steps=4, batch_size=4, warmup=2, lr=3e-3, fused_loss=True, bf16_weights=True)
    exact = capstone.train(run, progress=False)
    fitted = capstone.train(dataclasses.replace(run, fitted_gelu=True), progress=False)
    assert fitted.extra["fitted_gelu"] is True
    assert fitted.losses == pytest.approx(exact.losses, rel=1e-2)
    kernel = capstone.train(dataclasses.replace(run, kernel_gelu=True), progress=False)
    assert kernel.extra["kernel_gelu"] is True
    assert kernel.losses == pytest.approx(exact.losses, rel=1e-2)


def test_bf16_weights_train_like_autocast():
    # A bf16 model with fp32 master weights (chapter 06) against autocast over fp32 weights: the same
    # run within bf16 rounding, and the master copies are what the optimizer updates.
    run = capstone.RunConfig("tiny", steps=3, batch_size=2, seq_len=16, compile=False, warmup=1, lr=3e-3,
                             fused_loss=True)
    amp = capstone.train(run, progress=False, peak=(1e12, "test"))
    low = capstone.train(dataclasses.replace(run, bf16_weights=True), progress=False, peak=(1e12, "test"))
    assert low.extra["bf16_weights"] is True and amp.extra["bf16_weights"] is False
    assert low.losses == pytest.approx(amp.losses, rel=2e-2)
    step, model, _ = capstone.training_step(dataclasses.replace(run, bf16_weights=True))
    before = [p.detach().clone() for p in model.parameters()]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the bf16 copy follows the master
    with pytest.raises(ValueError, match="needs bf16 and fused_loss"):
        capstone.training_step(dataclasses.replace(run, bf16_weights=True, fused_loss=False))


def test_mfu_benchmark_profiles_a_step_and_the_matmul_peak():
    from benchmarks import capstone_mfu as bench
    from course_lib import profiling

    a, b = torch.randn(64, 32), torch.randn(32, 16)
    summary = profiling.profile_categories(lambda: a @ b, torch.device("cpu"), steps=2)
    assert summary["steps"] == 2 and summary["categories"].get("matmul", 0) > 0
    peak = bench.matmul_peak(torch.device("cpu"), [(64, 32, 16), (8, 8, 8)], lambda fn: (fn(), 0.5)[1])
    assert peak["by_shape"]["64x32x16"] == pytest.approx(2 * 64 * 32 * 16 / 0.5e-3)
    assert peak["flops"] == peak["by_shape"]["64x32x16"] and peak["dtype"] == "float32"


def test_mfu_record_keeps_the_rows_of_a_run_cut_short(tmp_path, monkeypatch):
    # The GPU run takes minutes a row; a timeout or a failing row must not lose the rows measured before it.
    from benchmarks import capstone_mfu as bench

    def fake_row(label, run, *_):
        if failing and label == bench.ROWS[2][0]:
            raise RuntimeError("the third row fails")
        return {"label": label, "batch_size": run.batch_size, "tokens_per_s": 1.0, "mfu": 0.1, "mfu_vs_matmul": 0.2}

    failing = True
    monkeypatch.setattr(bench, "_row", fake_row)
    out = tmp_path / "mfu.json"
    with pytest.raises(RuntimeError, match="third row"):
        bench.main(["--quick", "--out", str(out)])
    record = json.loads(out.read_text())
    assert [row["label"] for row in record["rows"]] == [label for label, _ in bench.ROWS[:2]]
    assert record["complete"] is False and record["command"].endswith("--quick")

    failing = False
    bench.main(["--quick", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["complete"] is True and len(record["rows"]) == len(bench.ROWS)
    base = record["rows"][0]["batch_size"]
    assert [row["batch_size"] for row in record["rows"]] == [base * f.get("batch_size", 1) for _, f in bench.ROWS]

    bench.main(["--quick", "--out", str(out), "--rows", "3", "0"])  # a chosen few, in the order asked
    record = json.loads(out.read_text())
    assert [row["label"] for row in record["rows"]] == [bench.ROWS[3][0], bench.ROWS[0][0]]
    assert record["complete"] is True and record["command"].endswith("--rows 3 0")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--out", str(out), "--rows", str(len(bench.ROWS))])


def test_checkpointed_run_same_losses():
    run = capstone.RunConfig("tiny", steps=2, batch_size=2, seq_len=16, compile=False, bf16=False, warmup=1)
    a = capstone.train(run, progress=False, peak=(1e12, "test"))
    b = capstone.train(run.__class__(**{**run.__dict__, "checkpointing": True}), progress=False, peak=(1e12, "test"))
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a.losses, b.losses))


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    capstone.main(["--preset", "tiny", "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"baseline", "optimized", "speedup"}
    assert data["baseline"]["config"]["bf16"] is False and data["optimized"]["config"]["bf16"] is True
    assert "RESULT " in capsys.readouterr().out


# ---- the assembled run and the ablation -------------------------------------------------------------

RUN = capstone.CapstoneRun()
# On a GPU the Triton FlashAttention's fp32 dot products run in TF32 (about 1e-4 relative on these losses).
_FLASH_RTOL = 1e-3 if torch.cuda.is_available() else 1e-6


def _losses(parts, tech, run=RUN, steps=3):
    step = capstone.assemble(parts, tech, run)
    return [step(i) for i in range(steps)]


def test_plain_run_is_the_gpt_with_adam():
    # Techniques all off: the course GPT's own forward, torch.optim.Adam, on the run's batches.
    model = models.GPT(RUN.model, seed=RUN.seed)
    opt = torch.optim.Adam(model.parameters(), lr=RUN.lr)
    want = []
    for i in range(3):
        x, y = RUN.batch(i)
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert _losses(capstone.Parts(), capstone.Techniques()) == pytest.approx(want, rel=1e-6)
    assert want[-1] < want[0]


@pytest.mark.parametrize("name", ["flash", "fused_adam", "checkpointing"])
def test_each_fp32_technique_changes_nothing_computed(name):
    plain = _losses(capstone.Parts(), capstone.Techniques())
    assert _losses(capstone.Parts(), capstone.Techniques(**{name: True})) == pytest.approx(plain, rel=_FLASH_RTOL)


def test_bf16_close_and_checkpoint_replays_autocast():
    plain = _losses(capstone.Parts(), capstone.Techniques())
    bf16 = _losses(capstone.Parts(), capstone.Techniques(bf16=True))
    both = _losses(capstone.Parts(), capstone.Techniques(bf16=True, checkpointing=True))
    assert bf16 == pytest.approx(plain, rel=5e-3) and bf16 != plain
    assert both == pytest.approx(bf16, rel=1e-6)  # the recomputation ran in bf16 as the forward did


def test_parts_are_used_only_when_switched_on():
    def half(q, k, v, causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal) * 0.5
    parts = dataclasses.replace(capstone.Parts(), attention=half)
    assert _losses(parts, capstone.Techniques()) == _losses(capstone.Parts(), capstone.Techniques())
    plain = _losses(capstone.Parts(), capstone.Techniques())
    assert _losses(parts, capstone.Techniques(flash=True)) != pytest.approx(plain, rel=1e-3)


def test_own_parts_plug_in():  # PyTorch attention against the course's Triton kernel on a GPU
    parts = capstone.Parts(attention=capstone.attention_from(tiled_attention, tiled_attention_backward),
                           optimizer=functools.partial(capstone.fused_adam, step_fn=adam_step_))
    tech = capstone.Techniques(flash=True, fused_adam=True)
    assert _losses(parts, tech) == pytest.approx(_losses(capstone.Parts(), tech), rel=_FLASH_RTOL)


def test_load_solutions_reads_exercise_cells(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import math\nprint('experiment')\nraise RuntimeError('not run')"),
        nbformat.v4.new_code_cell("def helper(x):\n    return math.sqrt(x)"),
        nbformat.v4.new_code_cell("def mine(x):\n    return helper(x) + 1", metadata={"nbgrader": {"solution": True}}),
    ])
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    assert capstone.load_solutions(path, ["mine"])["mine"](4.0) == 3.0
    with pytest.raises(KeyError, match="defines no absent"):
        capstone.load_solutions(path, ["absent"])


def _in_mesh(shape, tech):
    mesh = hybrid.new_mesh_groups(shape, ("dp", "tp"))
    step = capstone.assemble(capstone.Parts(), tech, RUN, mesh)
    return [step(i) for i in range(3)]


@pytest.mark.parametrize("shape", [(2, 2), (1, 2), (2, 1)])
def test_dp_tp_mesh_matches_one_process(shape):
    tech = capstone.Techniques(flash=True, fused_adam=True, checkpointing=True)
    want = _losses(capstone.Parts(), tech)
    for rank, got in enumerate(launch(_in_mesh, shape[0] * shape[1], shape, tech, timeout=300)):
        assert got == pytest.approx(want, rel=1e-4), f"rank {rank}"


def test_ablation_rows_one_change_each():
    rows = capstone.ablation(capstone.assemble, capstone.Parts(), RUN, capstone.TECHNIQUES, steps=1, peak_flops=1e12)
    assert [r["added"] for r in rows] == [None, *capstone.TECHNIQUES]
    assert [len(r["techniques"]) for r in rows] == list(range(len(rows)))
    flops = capstone.flops_per_step(RUN.model, RUN.batch_size)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 and len(r["losses"]) == 2
        assert math.isclose(r["mfu"], flops * r["tokens_per_s"] / RUN.tokens_per_step / 1e12, rel_tol=1e-9)
    ck = capstone.TECHNIQUES.index("checkpointing") + 1
    assert rows[ck]["peak_bytes"] < rows[ck - 1]["peak_bytes"]  # on a CPU: what autograd saved


def test_benchmark_record_quick_on_cpu(tmp_path):
    from benchmarks import capstone as bench

    out = tmp_path / "rec.json"
    if torch.cuda.is_available():
        pytest.skip("the CPU smoke run needs a machine without a GPU")
    assert bench.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["order"] == list(capstone.TECHNIQUES) and len(record["rows"]) == 5
    assert record["rows"][0]["added"] is None and record["tokens_per_step"] == RUN.tokens_per_step


def test_capstone_attention_benchmark_measures_each_layout_on_stand_ins():
    # The record compares attention in the model's layout (strided views of one projection) with contiguous
    # tensors: the instrument must hand each implementation the layout it names, check it, and keep a failing row.
    from benchmarks import capstone_attention as bench
    from course_lib import profiling

    seen = []

    def math(q, k, v, causal):
        seen.append(q.is_contiguous())
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def broken(q, k, v, causal):
        raise RuntimeError("no kernel\nhere")

    impls = {"math": math, "no mask": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v), "broken": broken}
    config = {"batches": [1, 3], "heads": 2, "seq": 16, "head_dim": 8}
    profile = functools.partial(profiling.profile_categories, device="cpu", steps=2)
    result = bench.sweep(impls, config, lambda fn, grads: (fn(), 0.5)[1], lambda fn, grads: 0.25, profile,
                         device="cpu", dtype=torch.float32)
    rows = {(r["batch"], r["layout"], r["implementation"]): r for r in result["rows"]}
    assert len(rows) == 2 * len(bench.LAYOUTS) * len(impls) and result["layouts"] == list(bench.LAYOUTS)
    assert False in seen and True in seen, "the model layout passes strided views, the contiguous one does not"
    ok = rows[(3, "model", "math")]
    assert ok["error"] is None and ok["wall_ms"] == 0.5 and ok["host_ms"] == 0.25 and ok["kernel_ms"] > 0
    assert ok["other_ms"] == pytest.approx(ok["kernel_ms"] - ok["attention_ms"]) and ok["kernels"]
    flops = 3.5 * 4 * 3 * 2 * 16 * 16 * 8 / 2
    assert ok["tflops"] == pytest.approx(flops / 0.5e-3 / 1e12)
    for layout in bench.LAYOUTS:
        assert "differs from math's" in rows[(1, layout, "no mask")]["error"], "a missing causal mask is caught"
        assert rows[(1, layout, "broken")]["error"] == "RuntimeError: no kernel here"
    forward, grad, leaves = bench.layout_call(math, 2, 2, 16, 8, "model", "cpu", torch.float32)
    assert forward().shape == grad.shape == (2, 16, 16) and [t.shape for t in leaves] == [(2, 16, 48)]
    with pytest.raises(ValueError, match="layout"):
        bench.layout_call(math, 2, 2, 16, 8, "rows", "cpu", torch.float32)
