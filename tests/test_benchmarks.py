"""The benchmark suite's report (ratios, targets, JSON, markdown, file names) from synthetic
measurements; the cases' plumbing on the CPU with stand-in kernels and timer; the CPU exit status."""

import dataclasses
import json
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import cases
from benchmarks.provenance import interleaved_rounds
from benchmarks.report import KNOWN_SLUGS, Report, Result, Target, gpu_slug

ROOT = Path(__file__).resolve().parents[1]
COPY = 4000.0


def _report(results: list[Result], copy: float | None = COPY, quick: bool = False) -> Report:
    return Report("NVIDIA H200", "2.11.0", "3.6.0", "2026-12-01T10:00:00+00:00", copy, quick, results)


def _softmax(ours: float | None, reference: float = 1900.0, error: str | None = None) -> Result:
    return Result(
        "softmax", [8192, 8192], "float32", "GB/s", "torch.softmax(x, dim=-1)", ours, reference,
        targets=[Target("ratio", 1.0), Target("copy_fraction", 0.8)], error=error,
    )


def _adam(ours: float, reference: float = 2.0) -> Result:
    return Result(
        "adam", [16, 4096, 4096], "float32", "ms", "torch.optim.Adam(fused=True).step()", ours, reference,
        targets=[Target("time_factor", 1.1)], context={"foreach": 5.26, "for-loop": 4.87},
    )


# ---------------------------------------------------------------------------------------------
# File names
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        ("Tesla V100-SXM2-16GB", "tesla-v100-sxm2-16gb"),
        ("  ", "gpu"),
    ],
)
def test_slug_from_device_name(name: str, slug: str) -> None:
    assert gpu_slug(name) == slug


def test_known_slugs_are_file_safe() -> None:
    assert all(slug == gpu_slug(slug) for slug in KNOWN_SLUGS.values())


def test_quick_runs_get_their_own_files(tmp_path: Path) -> None:
    assert _report([]).slug == "h200" and _report([], quick=True).slug == "h200-quick"
    json_path, md_path = _report([], quick=True).write(tmp_path / "new")
    assert (json_path.name, md_path.name) == ("h200-quick.json", "h200-quick.md")


# ---------------------------------------------------------------------------------------------
# Ratios and targets
# ---------------------------------------------------------------------------------------------


def test_ratio_is_above_one_when_ours_is_better_whatever_the_unit() -> None:
    assert _softmax(ours=3800.0, reference=1900.0).ratio == pytest.approx(2.0)  # rate: ours / reference
    assert _adam(ours=1.0, reference=2.0).ratio == pytest.approx(2.0)  # time: reference / ours
    assert _softmax(ours=None).ratio is None
    assert Result("x", [1], "float32", "ms", "ref", ours=1.0).ratio is None


def test_the_fastest_reference_is_the_one_judged_against() -> None:
    rate = Result("attention_fwd", [1], "bfloat16", "TFLOP/s", "", ours=500.0, targets=[Target("ratio", 0.9)])
    rate.judge_against_fastest({"SDPA flash (FA2)": 350.0, "SDPA cuDNN": 610.0, "FlexAttention": 480.0})
    assert (rate.reference_name, rate.reference) == ("SDPA cuDNN", 610.0)
    assert rate.context == {"SDPA flash (FA2)": 350.0, "FlexAttention": 480.0}
    assert rate.ratio == pytest.approx(500 / 610) and rate.met(None) is False  # beating FA2 is not enough
    time = Result("adam", [1], "float32", "ms", "", ours=2.0)
    time.judge_against_fastest({"for-loop": 4.9, "fused": 2.2})
    assert (time.reference_name, time.reference) == ("fused", 2.2)  # for times, the fastest is the smallest
    with pytest.raises(ValueError, match="none of its references"):
        Result("x", [1], "float32", "ms", "").judge_against_fastest({})


def test_every_target_must_be_met() -> None:
    assert _softmax(ours=3400.0).met(COPY) is True  # ratio 1.79, 3400 >= 0.8 x 4000
    assert _softmax(ours=3000.0).met(COPY) is False  # ratio 1.58 but 3000 < 3200
    slow_but_fast = _softmax(ours=3300.0, reference=3500.0)  # above 0.8 x copy, below the reference
    assert [t.met(slow_but_fast, COPY) for t in slow_but_fast.targets] == [False, True]
    assert slow_but_fast.met(COPY) is False


def test_time_target_allows_the_stated_slack() -> None:
    assert _adam(ours=2.2).met(COPY) is True  # 2.2 <= 1.1 x 2.0
    assert _adam(ours=2.3).met(COPY) is False


def test_copy_target_is_not_met_without_a_copy_bandwidth() -> None:
    assert _softmax(ours=3400.0).met(None) is False


def test_targets_need_a_fitting_unit() -> None:
    with pytest.raises(ValueError, match="GB/s"):
        Target("copy_fraction", 0.8).met(_adam(ours=1.0), COPY)
    with pytest.raises(ValueError, match="ms"):
        Target("time_factor", 1.1).met(_softmax(ours=1.0), COPY)


def test_context_rows_have_no_verdict() -> None:
    add = Result("add", [2**28], "float32", "GB/s", "torch.add", 3500.0, 3600.0)
    assert add.met(COPY) is None
    assert _report([add]).summary() == {"rows": 1, "with_targets": 0, "met": 0, "errors": 0}


def test_an_error_row_keeps_the_reference_and_misses_its_target() -> None:
    row = _softmax(ours=None, error="AssertionError: output differs from the reference")
    assert row.met(COPY) is False and row.ratio is None
    assert "error" in row.line(COPY) and "differs" in row.line(COPY)


# ---------------------------------------------------------------------------------------------
# JSON and markdown
# ---------------------------------------------------------------------------------------------


def test_json_holds_every_field(tmp_path: Path) -> None:
    rows = [_softmax(ours=3400.0), _adam(ours=2.3), _softmax(ours=None, error="RuntimeError: boom")]
    json_path, _ = _report(rows).write(tmp_path)
    data = json.loads(json_path.read_text())
    assert {"schema_version", "device", "slug", "torch", "triton", "date", "quick", "copy_gbps",
            "ratio_convention", "summary", "results"} <= data.keys()
    assert (data["device"], data["slug"], data["copy_gbps"]) == ("NVIDIA H200", "h200", COPY)
    assert data["summary"] == {"rows": 3, "with_targets": 3, "met": 1, "errors": 1}
    softmax, adam, failed = data["results"]
    assert softmax["shape"] == [8192, 8192] and softmax["unit"] == "GB/s"
    assert softmax["ratio"] == pytest.approx(3400 / 1900) and softmax["met"] is True
    assert [t["met"] for t in softmax["targets"]] == [True, True]
    assert softmax["targets"][1] == {
        "kind": "copy_fraction", "threshold": 0.8, "description": ">= 0.8 x copy GB/s", "met": True,
    }
    assert adam["met"] is False and adam["context"] == {"foreach": 5.26, "for-loop": 4.87}
    assert failed["error"] == "RuntimeError: boom" and failed["ours"] is None and failed["reference"] == 1900.0


def test_markdown_has_header_table_notes_and_errors() -> None:
    add = Result("add", [2**28], "float32", "GB/s", "torch.add", 3500.0, 3600.0, notes=["bytes: a | b"])
    failed = _softmax(ours=None, error="RuntimeError: line one\nline two")
    text = _report([_softmax(ours=3400.0), _adam(ours=2.3), add, failed]).to_markdown()
    for expected in ("NVIDIA H200", "torch 2.11.0", "triton 3.6.0", "2026-12-01", "4,000 GB/s", "ratio > 1 means ours"):
        assert expected in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 5  # the heading and four results
    assert all(row.count(" | ") == rows[0].count(" | ") for row in rows[1:]), "a cell broke the table"
    softmax_row, adam_row, add_row, failed_row = rows[1:]
    assert "| 3,400 |" in softmax_row and "| 1.79 |" in softmax_row and "| met |" in softmax_row
    assert "| not met |" in adam_row and "time <= 1.1 x reference" in adam_row and "foreach 5.26" in adam_row
    assert "| 0.97 |" in add_row and "met |" not in add_row
    assert "| error |" in failed_row
    assert "- add: bytes: a \\| b" in text
    assert "## Errors" in text and "- softmax: RuntimeError: line one line two" in text


def test_a_note_shared_by_rows_is_written_once() -> None:
    rows = [
        Result(f"matmul_{n}", [n, n, n], "bfloat16", "TFLOP/s", "torch.matmul", 700.0, 740.0, notes=["2 M N K"])
        for n in (4096, 8192)
    ]
    assert "- matmul_4096, matmul_8192: 2 M N K\n" in _report(rows).to_markdown()


def test_quick_report_says_so() -> None:
    assert "quick smoke run" in _report([], quick=True).to_markdown()


# ---------------------------------------------------------------------------------------------
# The cases' plumbing, on the CPU: PyTorch stand-ins for our kernels, a constant timer
# ---------------------------------------------------------------------------------------------

TINY = cases.Sizes(
    copy_numel=1024, softmax=(8, 64), bias_gelu=(8, 64), adam=(2, 16, 16), matmul=(32, 64),
    attention=(cases.AttentionShape(1, 2, 64, 32), cases.AttentionShape(1, 2, 32, 16, label="_d16")),
    add_numel=1024, transpose=(16, 24), warmup_ms=1, rep_ms=1,
)


class _FlatAdam(torch.optim.Adam):
    def __init__(
        self, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float,
        weight_decay: float, decoupled: bool = False,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _stand_in_kernels(**overrides: object) -> dict[str, types.ModuleType]:
    kernels = {
        "fusion": {
            "softmax": lambda x: torch.softmax(x, dim=-1),
            "bias_gelu": lambda x, bias, fast_erf=False: F.gelu(x + bias),
            "add": torch.add,
            "FlatAdam": _FlatAdam,
        },
        "tiling_coalescing": {
            "matmul": torch.matmul,
            "transpose": lambda x, coalesced=True: x.t().contiguous(),
        },
        "flash_attention": {
            "flash_attention": lambda q, k, v, causal=False, scale=None: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale
            ),
        },
        "flash_attention_hopper": {
            "flash_attention_tma": lambda q, k, v, causal=False, scale=None: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale
            ),
        },
    }
    modules = {}
    for module, functions in kernels.items():
        functions.update({k: v for k, v in overrides.items() if k in functions})
        modules[f"course_lib.kernels.{module}"] = types.SimpleNamespace(**functions)
    return modules


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(cases, "DEVICE", "cpu")
    monkeypatch.setattr(cases, "_ms", lambda fn, sizes, grad_to_none=None: (fn(), 2.0)[1])
    monkeypatch.setattr(cases, "_graph_ms", lambda fn, sizes: (fn(), 1.0)[1])
    monkeypatch.setattr(torch, "compile", lambda fn: fn)
    yield


def _run(monkeypatch: pytest.MonkeyPatch, names: list[str], **overrides: object) -> tuple[float, list[Result]]:
    for name, module in _stand_in_kernels(**overrides).items():
        monkeypatch.setitem(sys.modules, name, module)
    return cases.run(names, TINY, log=lambda line: None)


def test_every_case_yields_its_rows(on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    copy, results = _run(monkeypatch, list(cases.CASES))
    assert copy == pytest.approx(2 * 1024 * 4 / 2e-3 / 1e9)
    assert [r.name for r in results] == [
        "softmax", "bias_gelu", "adam", "matmul_32", "matmul_64",
        "attention_fwd", "attention_bwd", "attention_fwd_causal", "attention_bwd_causal",
        "attention_fwd_d16", "attention_bwd_d16", "attention_fwd_d16_causal", "attention_bwd_d16_causal", "add", "transpose",
    ]
    assert [r.error for r in results] == [None] * len(results)
    assert all(r.ratio == pytest.approx(1.0) for r in results)  # equal times on both sides
    adam = results[2]
    assert set(adam.context) == {"foreach", "for-loop"} and adam.unit == "ms"
    assert results[1].reference_name == "eager F.gelu(x + bias)" and "torch.compile" in results[1].context
    assert results[1].context["ours, CUDA-graph replay (kernel time only)"] == pytest.approx(2 * results[1].ours)
    fwd, bwd = results[5], results[6]
    assert bwd.reference == pytest.approx(2.5 * fwd.reference)
    # every attention row is judged against the fastest reference that ran; one that cannot run here is a note
    # (on a CPU: cuDNN has no kernel, FlexAttention no backward)
    assert fwd.reference_name == "SDPA flash (FA2)"
    for row in results[5:13]:
        for label in ("SDPA flash (FA2)", "SDPA cuDNN", "FlexAttention (torch.compile)"):
            assert label == row.reference_name or label in row.context or any(
                note.startswith(f"{label} failed") for note in row.notes), (row.name, label)
    assert any(n.startswith("SDPA cuDNN failed") for n in fwd.notes)
    assert all("course_lib teaching kernels" in row.context for row in results[5:13])  # beside ours, the TMA path


def test_rounds_interleave_the_timers_and_keep_each_sample() -> None:
    order: list[str] = []
    clock = iter([1.0, 5.0, 3.0, 4.0, 2.0, 6.0])

    def timer(name: str) -> Callable[[], float]:
        def time_once() -> float:
            order.append(name)
            return next(clock)
        return time_once

    def broken() -> float:
        order.append("c")
        raise RuntimeError("illegal memory access")

    samples, failures = interleaved_rounds({"a": timer("a"), "b": timer("b"), "c": broken}, 3)
    assert order == ["a", "b", "c", "a", "b", "a", "b"]  # once a round each, in turn; a failure stops there
    assert samples == {"a": [1.0, 3.0, 2.0], "b": [5.0, 4.0, 6.0]} and str(failures["c"]) == "illegal memory access"


def test_attention_rows_say_they_were_timed_in_rounds(on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, module in _stand_in_kernels().items():
        monkeypatch.setitem(sys.modules, name, module)
    sizes = dataclasses.replace(TINY, attention=TINY.attention[:1], rounds=3)
    _, results = cases.run(["attention"], sizes, log=lambda line: None)
    assert len(results) == 4 and all(r.error is None for r in results)
    assert all(any("3 interleaved rounds" in note for note in r.notes) for r in results)


def test_a_failing_kernel_is_one_rows_error(on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("does not compile")

    _, results = _run(monkeypatch, ["softmax", "add"], softmax=broken, add=lambda x, y: x - y)
    softmax, add = results
    assert softmax.error == "RuntimeError: does not compile" and softmax.reference is not None
    assert softmax.ours is None and softmax.met(COPY) is False
    assert add.error.startswith("AssertionError: output differs from the reference")


def test_a_missing_kernel_module_is_recorded(on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "course_lib.kernels.tiling_coalescing", None)  # import fails
    _, results = cases.run(["transpose", "matmul"], TINY, log=lambda line: None)
    transpose, *matmuls = results
    assert transpose.name == "transpose" and transpose.reference is None  # the reference is ours too
    assert "ModuleNotFoundError" in transpose.error or "ImportError" in transpose.error
    assert [m.reference is not None and m.error is not None for m in matmuls] == [True, True]


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_exits_with_status_2_without_cuda(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "benchmarks need a CUDA GPU" in out.stderr and "interpreter" in out.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.gpu
def test_quick_run_writes_a_report(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [json_path] = tmp_path.glob("*-quick.json")
    data = json.loads(json_path.read_text())
    assert data["copy_gbps"] > 0 and len(data["results"]) == 7 + 4 * len(cases.QUICK.attention)
    assert [r["name"] for r in data["results"] if r["error"]] == [], out.stdout
    # A reference or context measurement that fails is a note on its row, not an error: none may fail either.
    assert [n for r in data["results"] for n in r["notes"] if " failed: " in n] == [], out.stdout


def test_record_main_writes_what_measure_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import provenance

    calls = []

    def measure(quick: bool) -> dict:
        calls.append(quick)
        return {"gpu": "NVIDIA H200", "rows": [1.5]}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        provenance.record_main("steps", "doc", measure, [])
    assert exc.value.code == 2 and calls == [], "without CUDA: a usage error before anything is measured"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "r.json"
    assert provenance.record_main("steps", "doc", measure, ["--quick", "--out", str(out)]) == 0
    assert calls == [True] and json.loads(out.read_text()) == {"gpu": "NVIDIA H200", "rows": [1.5]}
    assert provenance.record_path("steps", "NVIDIA H200", False) == provenance.RESULTS / "steps_h200.json"
    assert provenance.record_path("steps", "NVIDIA H200", True).name == "steps_h200-quick.json"


def test_median_ms_passes_the_config_and_grads_to_do_bench(monkeypatch):
    import triton.testing

    from benchmarks.provenance import median_ms

    seen = {}

    def fake_do_bench(fn, warmup, rep, grad_to_none=None, return_mode="mean"):
        seen.update(warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode=return_mode, result=fn())
        return 0.25

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    grads = [torch.zeros(2, requires_grad=True)]
    assert median_ms({"warmup_ms": 5, "rep_ms": 20}, lambda: "ran", grads) == 0.25
    assert seen == {"warmup": 5, "rep": 20, "grad_to_none": grads, "return_mode": "median", "result": "ran"}
    median_ms({"warmup_ms": 5, "rep_ms": 20}, lambda: None, [])
    assert seen["grad_to_none"] is None  # no tensors: nothing to reset


def test_host_ms_times_the_calls_and_not_the_waits():
    import time

    from benchmarks.provenance import host_ms

    log = []
    grads = [torch.zeros(2, requires_grad=True)]

    def call():
        assert grads[0].grad is None or not log, "grads must be reset before every timed call"
        grads[0].grad = torch.ones(2)
        log.append("call")
        time.sleep(0.002)

    def slow_sync():
        log.append("sync")
        time.sleep(0.03)  # a GPU still busy: must not count as the host's time per call

    ms = host_ms(call, grads, calls=4, repeats=3, sync=slow_sync)
    assert 2.0 <= ms < 2.0 + 30 / 4, f"{ms:.2f} ms per call: the syncs (30 ms each) leaked into the timing"
    assert log == ["call"] + (["sync"] + ["call"] * 4) * 3 + ["sync"], log
