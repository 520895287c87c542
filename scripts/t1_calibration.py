"""Teacher-forced sampled acceptance of the drafter, per slot (CPU, fp32).

For T=1 / top-p 0.95 answers of the target itself to GSM8K test prompts, every response position is
an anchor; for slot k the token-level acceptance is sum_x min(p_target, q_draft) with the true
predecessor (what the selector sees when slot k-1 was accepted). Compares the selector's q at several
temperatures and top-p values, the dense draft logits without the selector, and the ceiling of a selector that matched
p_target on its own candidates (= p_target's mass on them). AL estimates: 1 + mean over anchors of
sum_k prod_{j<=k} a_j.

Usage: python scripts/t1_calibration.py SEQS.json [DRAFT_DIR] [--generate N --offset O]
  --generate: first answer N prompts (from O) with the target at T=1 / top-p 0.95 into SEQS.json.
The seventh session ran --generate 24 --offset 200 (prompts outside the first-200 evaluation);
its output is docs/cpu_2026-11-30d/teacher_forced_t1.txt.
"""

import argparse
import json
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(2)
from dflash2.cli import DEFAULT_DRAFT, REPO
from dflash2.model.checkpoint import load_draft
from dflash2.model.token_map import DEFAULT_NAME, load_token_map
from dflash2.target.loading import load_target
from dflash2.training.data import gsm8k_prompts, render
from dflash2.sampling import probs_from_logits
from cpu_selector_tv import teacher_forced

ap = argparse.ArgumentParser()
ap.add_argument("seqs")
ap.add_argument("draft", nargs="?", default=str(DEFAULT_DRAFT))
ap.add_argument("--generate", type=int, default=0)
ap.add_argument("--offset", type=int, default=200)
args = ap.parse_args()
draft = load_draft(args.draft, dtype=torch.float32).eval()
target = load_target(None, "float32", layer_ids=draft.config.target_layer_ids)
if args.generate:
    prompts = gsm8k_prompts(REPO.parent / "shared/data/gsm8k/test.jsonl", args.offset + args.generate)[args.offset :]
    rows = []
    for i, p in enumerate(prompts):
        ids = torch.tensor(render(target.tokenizer, p))
        torch.manual_seed(1000 + i)
        g = target.model.generate(ids[None], do_sample=True, temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=160)
        rows.append({"ids": g[0].tolist(), "prompt_len": len(ids)})
    json.dump(rows, open(args.seqs, "w"))
draft.set_token_map(load_token_map(f"{DEFAULT_DRAFT}/{DEFAULT_NAME}", draft.config.vocab_size), target.lm_head_weight)
W, G = 8, 7
TAUS = [0.7, 0.85, 1.0, 1.15, 1.3, 1.5]
acc = {f"sel{t}": [] for t in TAUS}
acc.update({f"dense{t}": [] for t in [0.85, 1.0, 1.15, 1.3]})
acc.update({f"sel_q_top_p{tp}": [] for tp in [1.0, 0.9, 0.8, 0.7]})  # q truncated at its own top-p
acc["oracle_cand"] = []
sel = draft.candidate_selector
with torch.no_grad():
    for s in json.load(open(args.seqs)):
        ids = torch.tensor(s["ids"])[None]
        P0 = s["prompt_len"]
        T = ids.shape[1]
        if T - G - P0 < 8:
            continue
        anchors = torch.arange(P0 - 1, T - G)  # slots a+1..a+G all inside the sequence
        pos = anchors[:, None] + torch.arange(W)
        tl, hid = teacher_forced(draft, target, ids, anchors)
        U, cand = draft.candidates(hid, target.lm_head_weight)  # [N, G, k]
        labels = ids[0, pos[:, 1:]]  # [N, G]
        pred = torch.cat([ids[0, anchors][:, None], labels[:, :-1]], 1)
        S = sel.scores(U, hid, cand, pred)
        p_target = probs_from_logits(tl[pos[:, :-1]], 1.0, -1, 0.95)  # [N, G, V] at slot k's position
        p_cand = p_target.gather(-1, cand)
        for t in TAUS:
            acc[f"sel{t}"].append(torch.minimum(p_cand, probs_from_logits(S, t, -1, 0.95)).sum(-1))
        for tp in [1.0, 0.9, 0.8, 0.7]:  # p_target keeps the request's 0.95; decoding truncates q at it too
            acc[f"sel_q_top_p{tp}"].append(torch.minimum(p_cand, probs_from_logits(S, 1.0, -1, tp)).sum(-1))
        dense = draft.compute_logits(hid, target.lm_head_weight)
        for t in [0.85, 1.0, 1.15, 1.3]:
            acc[f"dense{t}"].append(torch.minimum(p_target, probs_from_logits(dense, t, -1, 0.95)).sum(-1))
        acc["oracle_cand"].append(p_cand.sum(-1))  # q = p_target on the candidates, renormalised
for k, v in acc.items():
    a = torch.cat(v)  # [anchors, G]
    al5 = 1 + torch.cumprod(a[:, :4], 1).sum(1).mean().item()
    al8 = 1 + torch.cumprod(a, 1).sum(1).mean().item()
    print(k, {"slot": [round(x, 3) for x in a.mean(0).tolist()], "al5_est": round(al5, 3), "al8_est": round(al8, 3)})
