set -u
cd /work/main
OUTD=/tmp/b17c1; mkdir -p $OUTD
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
run() {  # name, pythonpath src, temperature
  PYTHONPATH=$2 .venv/bin/python -m dflash2.cli serve --port 30013 --max-running-requests 16 --speculative-planner auto > "$OUTD/serve_$1.log" 2>&1 &
  for _ in $(seq 1 90); do curl -s localhost:30013/health > /dev/null && break; sleep 2; done
  /tmp/vllmvenv/bin/vllm bench serve --backend openai-chat --base-url http://127.0.0.1:30013 \
    --endpoint /v1/chat/completions --model SmolLM2-135M-Instruct --tokenizer .cache/smollm2-135m-instruct --dataset-name custom \
    --dataset-path /tmp/b17/prompts.jsonl --custom-output-len 128 --num-prompts 6 --max-concurrency 1 \
    --temperature $3 --top-p 0.95 --seed 0 --save-result --result-dir "$OUTD" \
    --result-filename "$1_t$3_$4.json" > "$OUTD/bench_$1_t$3.log" 2>&1
  curl -s localhost:30013/metrics | grep -E "retired|not_drafting|mean_width|planner_alpha" > "$OUTD/metrics_$1_t$3.txt"
  pkill -f "port 30013"; sleep 3
}
run old /tmp/oldwt/src 0 a
run new /work/main/src 0 a
run old /tmp/oldwt/src 0 b
run new /work/main/src 0 b
echo finished
