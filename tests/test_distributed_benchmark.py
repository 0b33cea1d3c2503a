"""benchmarks.distributed on two gloo CPU ranks (--small): every section is measured and reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from course_lib.support.torchrun import explain_failure

ROOT = Path(__file__).resolve().parents[1]


def test_small_run_writes_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "benchmarks.distributed", "--small", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,  # for a hang only
    )
    assert run.returncode == 0, explain_failure(run.stdout + run.stderr) + "\n" + run.stdout + run.stderr
    data = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert (data["world_size"], data["backend"], data["small"]) == (2, "gloo", True)
    assert data["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    sections = data["sections"]
    assert set(sections) == {"all_reduce", "ddp", "pipeline"}
    rows = sections["all_reduce"]["rows"]
    assert [r["shape"][0] * 4 for r in rows] == sections["all_reduce"]["sizes_bytes"]
    assert all(r["ours"] > 0 and r["reference"] > 0 and r["ratio"] > 0 for r in rows)
    ddp = sections["ddp"]
    modes = {"compute_only", "communication_only", "naive", "bucketed", "torch_ddp", "torch_ddp_view",
             "communication_only_hp", "bucketed_hp", "torch_ddp_hp"}
    assert set(ddp["ms"]) == set(ddp["ms_per_round"]) == modes
    assert all(len(v) == ddp["rounds"] and min(v) <= ddp["ms"][m] <= max(v) for m, v in ddp["ms_per_round"].items())
    assert [r["name"] for r in ddp["rows"]] == ["ddp_step", "ddp_step_hp"]
    assert all(r["targets"][0]["kind"] == "time_factor" for r in ddp["rows"])
    assert set(ddp["overlap"]) == {"bucketed", "torch_ddp", "torch_ddp_view", "bucketed_hp", "torch_ddp_hp"}
    pipeline = sections["pipeline"]
    schedules = ["CHECK naive ok", "CHECK gpipe ok", "CHECK 1f1b ok", "CHECK interleaved ok"]
    assert "result" in pipeline and pipeline["checks"] == schedules, pipeline
    report = (tmp_path / "multi_gpu.md").read_text()
    for heading in ("## All-reduce", "## DDP step", "## Pipeline bubble fraction"):
        assert heading in report
    assert report.count("BucketedDDP / torch DDP time") == 2, "one verdict per process group"
    assert (tmp_path / "multi_gpu_busbw.png").stat().st_size > 0
