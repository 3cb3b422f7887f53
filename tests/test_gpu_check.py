"""benchmarks/gpu_check.sh, on a machine without a GPU: its install steps and its stop at the
first GPU call, and (GPU_CHECK_CPU_SMOKE=1) the same GRPO runs and table on the tiny model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def gpu_check(tmp_path, **env) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHON=sys.executable, OUT_DIR=str(tmp_path), OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900, env=environment, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stop on a machine without a GPU")
def test_without_a_gpu_it_installs_then_stops_at_the_first_gpu_call(tmp_path):
    done = gpu_check(tmp_path)
    assert done.returncode == 1
    assert "gpu_check: no CUDA device is visible to torch" in done.stderr + done.stdout
    assert not (tmp_path / "hf").exists()  # no training started


@pytest.mark.slow
def test_the_cpu_smoke_run_trains_and_reports_each_engine(tmp_path):
    done = gpu_check(tmp_path, GPU_CHECK_CPU_SMOKE="1", PYTHONPATH=str(ROOT))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in (tmp_path / "summary.md").read_text().splitlines()
            if line.startswith("| hf") or line.startswith("| vllm")}
    steps, rollout, update, hits, mismatch = rows["hf"]
    assert steps == "2" and float(rollout) > 0 and float(update) > 0
    assert hits == "-"  # the HF backend has no prefix cache to report
    assert 0 < float(mismatch) < 0.05  # the bf16 update against the fp32 sampler
    assert rows["vllm"][0] == "skipped" and "vLLM half skipped: CPU smoke run" in done.stdout
