#!/bin/bash
# dflash2 serve with --speculative-algorithm NONE / the planner off (fixed width) / --speculative-planner auto,
# one server at a time, measured by vLLM's own client (`vllm bench serve`, installed in its own venv: VLLM_VENV)
# over the last user turn of a recipe's held-out prompts. Session 15's figures: docs/benchmarks.md.
#   bash scripts/cpu_server_ab.sh [work/recipe/heldout_prompts.jsonl] [out dir]
set -u
HELD=${1:-work/recipe/heldout_prompts.jsonl}
OUTD=${2:-/tmp/b22}
VLLM_VENV=${VLLM_VENV:-/tmp/vllmvenv}
TOK=${TOK:-.cache/smollm2-135m-instruct}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUTD"
.venv/bin/python - "$HELD" "$OUTD/prompts.jsonl" <<'PY'
import json, sys
from dflash2.training.sources import load_prompts
with open(sys.argv[2], "w") as f:
    for p in load_prompts(sys.argv[1]):
        f.write(json.dumps({"prompt": p.messages[-1]["content"]}) + "\n")
PY
run() {  # name, server flags, concurrency, prompts, temperature
  .venv/bin/dflash2 serve --port 30012 --max-running-requests 16 $2 > "$OUTD/serve_$1.log" 2>&1 &
  for _ in $(seq 1 90); do curl -s localhost:30012/health > /dev/null && break; sleep 2; done
  "$VLLM_VENV/bin/vllm" bench serve --backend openai-chat --base-url http://127.0.0.1:30012 \
    --endpoint /v1/chat/completions --model SmolLM2-135M-Instruct --tokenizer "$TOK" --dataset-name custom \
    --dataset-path "$OUTD/prompts.jsonl" --custom-output-len 128 --num-prompts "$4" --max-concurrency "$3" \
    --temperature "$5" --top-p 0.95 --seed 0 --save-result --result-dir "$OUTD" \
    --result-filename "$1_c$3_t$5.json" > "$OUTD/bench_$1_c$3_t$5.log" 2>&1
  pkill -f "dflash2 serve --port 30012"; sleep 3
}
for t in 0 1; do
  run none "--speculative-algorithm NONE" 16 32 $t
  run auto "--speculative-planner auto" 16 32 $t
  run off "--speculative-planner off" 16 32 $t
done
run none "--speculative-algorithm NONE" 1 6 0
run auto "--speculative-planner auto" 1 6 0
run none "--speculative-algorithm NONE" 1 6 1
run auto "--speculative-planner auto" 1 6 1
