#!/usr/bin/env bash
# The GPU night's checks on one CUDA node, in two steps (README "GPU path").
#
#   jobs/gpu_bench.sh [MODEL] [bench_agents.py flags]     MODEL: smollm2-135m-instruct (default), tiny, or a folder
#
# 1. jobs/gpu_check.py: needs only torch and transformers (a bare node): option probabilities of the production
#    settings against the transformers float32 agent (tolerance in benchmarks/gpu_check.py), coalitions/s of the
#    transformers agent on a synthetic pool, and its ratio to the compute floor; where vLLM is installed, the vLLM agent
#    too. Without a GPU it stops at the first CUDA call with one line (exit 2).
# 2. Where vLLM and Ray are installed: jobs/bench_agents.py, the Ray pipeline against a bare LLM.generate loop.
# 3. Where vLLM is installed and LOCOMO names LoCoMo's locomo10.json: jobs/bench_engine.py --floor, the CPU floor-ratio
#    benchmark (K=5 LoCoMo cases under cloze and letter scoring against tokens x FLOPs / the GPU's measured GEMM rate),
#    for the first three eligible queries of conv-26. Run it with a model of 1B parameters or more (a folder): on a
#    GPU SmolLM2-135M is too small to keep the GEMMs busy, so its ratio says little about a production model.
#
# Installs nothing: vLLM comes from the pinned extra (pip install -e '.[gpu]': vLLM 0.33.x, CUDA 13 wheels, NVIDIA
# driver >= 580), never unpinned. max_model_len is the model's own (at most 4096), not fixed here. Reports go to $OUT
# when set, else to the current folder.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-smollm2-135m-instruct}"
shift || true
python=${PYTHON:-python3}
out="${OUT:-.}"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1

rc=0
timeout 1500 "$python" jobs/gpu_check.py --model "$model" --out "$out/gpu-check.json" || rc=$?
[ "$rc" -eq 2 ] && exit 2  # no GPU (or a missing package): said in one line above

if ! "$python" -c "import vllm, ray" 2>/dev/null; then
  echo "gpu_bench: vLLM or Ray not installed: the pipeline/bare-loop ratio is skipped (pip install -e '.[gpu]')"
  exit "$rc"
fi
"$python" - <<'PY' || exit 2
import sys
from importlib.metadata import version
v = version("vllm")
if not v.startswith("0.33."):
    sys.exit(f"gpu_bench: vLLM {v} is outside the tested range 0.33.x (pyproject's gpu extra); not benchmarked")
PY
timeout 900 "$python" jobs/bench_agents.py --model "$model" --gpus-per-actor 1 \
  --agent-option dtype=bfloat16 --repetitions 3 --out "$out/bench-agents-gpu.json" "$@" || rc=$?

if [ -z "${LOCOMO:-}" ] || [ ! -f "$LOCOMO" ]; then
  echo "gpu_bench: set LOCOMO=path/to/locomo10.json for the floor-ratio benchmark (skipped)"
  exit "$rc"
fi
for q in 0 1 2; do
  timeout 900 "$python" jobs/bench_engine.py --model "$model" --floor --locomo "$LOCOMO" --passes 3 \
    --query-index "$q" --out "$out/bench-floor-gpu-q$q.json" || rc=$?
done
exit "$rc"
