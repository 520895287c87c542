#!/bin/bash
# (committed copy of the session-15 A/B: dflash2 serve NONE / planner off / planner auto, vllm bench serve in /tmp/vllmvenv)
# #22 CPU target: dflash2 serve (planner auto / off) against --speculative-algorithm NONE, held-out prompts (last user turn)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TOK=/work/main/.cache/smollm2-135m-instruct
OUTD=/tmp/b22; mkdir -p $OUTD
run() { # name serverflags conc nprompts temp
  cd /work/main && .venv/bin/dflash2 serve --port 30012 --max-running-requests 16 $2 > $OUTD/serve_$1.log 2>&1 &
  for i in $(seq 1 90); do curl -s localhost:30012/health >/dev/null && break; sleep 2; done
  for spec in "$3:$4:$5"; do :; done
  IFS=: read c n t <<< "$3:$4:$5"
  /tmp/vllmvenv/bin/vllm bench serve --backend openai-chat --base-url http://127.0.0.1:30012 --endpoint /v1/chat/completions \
    --model SmolLM2-135M-Instruct --tokenizer $TOK --dataset-name custom --dataset-path /tmp/heldout_last_turn.jsonl \
    --custom-output-len 128 --num-prompts $n --max-concurrency $c --temperature $t --top-p 0.95 --seed 0 \
    --save-result --result-dir $OUTD --result-filename $1_c${c}_t${t}.json > $OUTD/bench_$1_c${c}_t${t}.log 2>&1
  pkill -f "dflash2 serve --port 30012"; sleep 3
}
for t in 0 1; do
  for cfg in "none:--speculative-algorithm NONE" "auto:--speculative-planner auto" "off:--speculative-planner off"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    run $name "$flags" 16 32 $t
  done
done
for cfg in "none:--speculative-algorithm NONE" "auto:--speculative-planner auto"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  run $name "$flags" 1 6 0
done
echo ALLDONE > $OUTD/done
