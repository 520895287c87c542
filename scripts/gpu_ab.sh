#!/bin/bash
# Before / after in one H200 call, no stash: the same `bench speed` (random SmolLM2-shaped target, the
# published drafter architecture at its size, synthetic acceptance 0.62 ~ GSM8K's T=1 profile) through
# work/old_src (an earlier commit) and src (the working tree), one concurrency at a time, new code first.
# Here, first:  rm -rf work/old_src; git worktree add -q /tmp/oldwt REV; cp -r /tmp/oldwt/src work/old_src
#               git worktree remove --force /tmp/oldwt; cp -r configs work/configs  (old_src reads ../configs)
#               mkdir -p work/tok; cp .cache/smollm2-135m-instruct/{*.json,*.jinja} work/tok/  (the tokenizer)
#               (config.json is harmless: --target-shape builds the model)
# Then a call carrying work/:  bash scripts/gpu_ab.sh 64 ""   (building, compiling and capturing take
# ~2 min per code version before the first row: give the call 420 s or more for one concurrency)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUTD=${OUT:-/tmp/out}
mkdir -p "$OUTD"
for c in ${1//,/ }; do
  for v in src work/old_src; do
    n=$(basename "$v")_c$c
    # (no grep in the pipe: it holds its output back, and a call cut by its limit returned nothing)
    python -c "import sys; sys.path.insert(0, '$v'); from dflash2.cli import main; sys.argv[0] = 'dflash2'; sys.exit(main())" \
      bench speed --model-path work/tok --target-shape smollm2-135m --synthetic-acceptance 0.62 \
      --gsm8k-path work/gsm8k_test.jsonl --limit 512 --concurrency "$c" --temperature 1 \
      --speculative-use-block-verification --adaptive --rounds 2 --requests-per-slot 8 --max-new-tokens 128 \
      --output "$OUTD/$n.json" $2 2>&1 | tee "$OUTD/$n.txt"
  done
done
