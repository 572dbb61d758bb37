#!/usr/bin/env bash
# Agent throughput on one GPU: the Ray audit pipeline vs a bare vLLM LLM.generate loop (jobs/bench_agents.py).
#
#   jobs/gpu_bench.sh /models/Qwen2.5-7B-Instruct [extra bench_agents.py flags, e.g. --locomo locomo10.json --top-k 8]
#
# Two engine starts (pipeline actor, then bare engine; the first is shut down before the second) plus 3 cold
# repetitions of each side: a few minutes for a 7B model on one H200. Installs only the package's GPU extra, and only
# when vLLM is missing. Writes the JSON report to $OUT/bench-agents-gpu.json when $OUT is set, else to the current
# folder.
set -euo pipefail
cd "$(dirname "$0")/.."

model="${1:?usage: jobs/gpu_bench.sh MODEL_FOLDER [bench_agents.py flags]}"
shift
[ -d "$model" ] || { echo "gpu_bench: $model is not a folder (a local model is needed: no hub access)" >&2; exit 2; }
python=${PYTHON:-python3}

if ! "$python" -c "import vllm, pipeline" 2>/dev/null; then
  echo "gpu_bench: installing meclear with its GPU extra (vLLM)"
  "$python" -m pip install -q -e '.[gpu]'
fi

export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
out="${OUT:-.}/bench-agents-gpu.json"
# bfloat16 and 85% of GPU memory for the KV cache; block_size stays vLLM's GPU default (VLLMConfig leaves it unset).
timeout 570 "$python" jobs/bench_agents.py --model "$model" --gpus-per-actor 1 \
  --agent-option dtype=bfloat16 --agent-option gpu_memory_utilization=0.85 --agent-option max_model_len=4096 \
  --repetitions 3 --out "$out" "$@"
