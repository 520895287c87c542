"""Issue 23, sampled acceptance: does training the selector on total variation beat its KL term? (CPU, fp32)

The drafter's body is frozen; the selector alone (codebooks and hidden projection) is fine-tuned from the
shipped weights on teacher-forced slot rows of the recipe's training answers, once per objective, the same
rows and steps each; then scored on the target's own T=1 / top-p 0.95 answers to held-out prompts (no
drafter trained on them): per slot, sum_x min(p_target, q_draft) with the true predecessor, q_draft as
decoding draws it (softmax(S) at T=1, top-p 0.95), and the AL estimate 1 + mean sum_k prod_{j<=k} a_j as in
scripts/t1_calibration.py; "top1": argmax q_draft = argmax p_target (what greedy acceptance needs).
Deterministic: the same anchors score every variant (paired), so no sampling noise.

Objectives (the selector's CE on the true token is in each, as in training):
  kl   + KL(p_target on the candidates, renormalised || softmax(S))   (the recipe's selector_kl term)
  tv   + (1 - sum_cand min(p_target, softmax(S)))                      (slot acceptance itself)

    .venv/bin/python scripts/cpu_selector_tv.py --train-seqs 64 --eval-prompts 25 --steps 400 --output OUT.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dflash2.cli import DEFAULT_DRAFT  # noqa: E402
from dflash2.model.checkpoint import load_draft  # noqa: E402
from dflash2.model.token_map import DEFAULT_NAME, load_token_map  # noqa: E402
from dflash2.sampling import probs_from_logits  # noqa: E402
from dflash2.target.loading import load_target  # noqa: E402
from dflash2.training.data import TokenDataset, render  # noqa: E402
from dflash2.training.losses import block_hidden, selector_distill  # noqa: E402
from dflash2.training.sources import load_prompts  # noqa: E402

W, G, TOP_P = 8, 7, 0.95


@torch.no_grad()
def teacher_forced(draft, target, ids: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits over ``ids [1, T]`` ([T, V]) and the drafter's hidden states of slots 1..W-1 of
    a block at each anchor ([N, W-1, H]), every block reading the true context (scripts/t1_calibration.py
    uses it too)."""
    T = ids.shape[1]
    target._captured.clear()
    tl = target.model(input_ids=ids, use_cache=False).logits[0].float()
    feats = torch.cat([target._captured[i] for i in target.layer_ids], -1)
    blk = torch.full((len(anchors), W), draft.config.mask_token_id)
    blk[:, 0] = ids[0, anchors]
    pos = anchors[:, None] + torch.arange(W)
    valid = torch.ones(1, T, dtype=torch.bool)
    return tl, block_hidden(draft, feats, valid, blk[None], pos[None], anchors[None], target.embed)[0]


@torch.no_grad()
def slot_rows(draft, target, ids: torch.Tensor, prompt_len: int, max_anchors: int, rng: random.Random) -> dict:
    """Teacher-forced slot rows of one sequence: the frozen body's hidden state, candidates, their unary
    scores, the true predecessor and label, and p_target (T=1, top-p 0.95) on the candidates."""
    ids = ids[None].long()
    all_anchors = list(range(prompt_len - 1, ids.shape[1] - G))
    anchors = torch.tensor(sorted(rng.sample(all_anchors, min(max_anchors, len(all_anchors)))))
    pos = anchors[:, None] + torch.arange(W)
    tl, hid = teacher_forced(draft, target, ids, anchors)
    U, cand = draft.candidates(hid, target.lm_head_weight)  # [N, G, k]
    labels = ids[0, pos[:, 1:]]
    pred = torch.cat([ids[0, anchors][:, None], labels[:, :-1]], 1)
    p_target = probs_from_logits(tl[pos[:, :-1]], 1.0, -1, TOP_P)  # [N, G, V]
    return {
        "hid": hid,
        "U": U.float(),
        "cand": cand,
        "pred": pred,
        "label": labels,
        "p_cand": p_target.gather(-1, cand),
        "p_top1": p_target.argmax(-1),
    }


def cat_rows(rows: list[dict]) -> dict:
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def scores(sel, b: dict) -> torch.Tensor:
    return sel.scores(b["U"], b["hid"], b["cand"], b["pred"])


def objective(sel, b: dict, kind: str) -> torch.Tensor:
    S = scores(sel, b)  # [n, k]
    hit = b["cand"] == b["label"][:, None]
    present = hit.any(-1).float()
    ce = (F.cross_entropy(S, hit.float().argmax(-1), reduction="none") * present).sum() / present.sum().clamp_min(1)
    q = torch.softmax(S, -1)
    if kind == "kl":
        # (p_target already restricted to the candidates: their own positions, renormalised there)
        at = torch.arange(S.shape[-1]).expand_as(S)
        extra = selector_distill(S, at, torch.log(b["p_cand"].clamp_min(1e-12)), torch.ones(len(S)))
    elif kind == "tv":
        extra = (1 - torch.minimum(b["p_cand"], q).sum(-1)).mean()
    else:
        raise ValueError(kind)
    return ce + extra


@torch.no_grad()
def evaluate(sel, rows: dict) -> dict:
    S = scores(sel, rows)  # [N, G, k]
    q = probs_from_logits(S, 1.0, -1, TOP_P)
    a = torch.minimum(rows["p_cand"], q).sum(-1)  # [N, G]
    top1 = (rows["cand"].gather(-1, S.argmax(-1, keepdim=True))[..., 0] == rows["p_top1"]).float()
    return {
        "slot": [round(x, 4) for x in a.mean(0).tolist()],
        "al5_est": round(1 + torch.cumprod(a[:, :4], 1).sum(1).mean().item(), 4),
        "al8_est": round(1 + torch.cumprod(a, 1).sum(1).mean().item(), 4),
        "top1": [round(x, 4) for x in top1.mean(0).tolist()],
        "ceiling_slot1": round(rows["p_cand"][:, 0].sum(-1).mean().item(), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--data", default=str(ROOT / "work" / "recipe" / "data_part0.npz"))
    ap.add_argument("--heldout", default=str(ROOT / "work" / "recipe" / "heldout_prompts.jsonl"))
    ap.add_argument("--train-seqs", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=96)
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--objectives", default="kl,tv")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    draft = load_draft(args.draft, dtype=torch.float32).eval()
    target = load_target(None, "float32", layer_ids=draft.config.target_layer_ids)
    draft.set_token_map(load_token_map(Path(args.draft) / DEFAULT_NAME, draft.config.vocab_size), target.lm_head_weight)
    t0 = time.time()
    data = [
        r for r in TokenDataset.load(args.data).rows if len(r["ids"]) <= 640 and len(r["ids"]) - r["prompt_len"] > 32
    ]
    train = cat_rows(
        [
            {
                k: v.flatten(0, 1)
                for k, v in slot_rows(draft, target, r["ids"], r["prompt_len"], args.anchors, rng).items()
            }
            for r in rng.sample(data, args.train_seqs)
        ]
    )
    print(f"train rows: {len(train['label'])} from {args.train_seqs} sequences ({time.time() - t0:.0f}s)", flush=True)
    prompts = load_prompts(args.heldout)
    by_domain: dict[str, list] = {}
    for p in prompts:
        by_domain.setdefault(p.domain, []).append(p)
    per = max(1, args.eval_prompts // len(by_domain))
    chosen = [p for d in sorted(by_domain) for p in by_domain[d][:per]]
    evals = []
    for i, p in enumerate(chosen):
        ids = torch.tensor(render(target.tokenizer, p.messages))[None]
        torch.manual_seed(2000 + i)
        g = target.model.generate(
            ids, do_sample=True, temperature=1.0, top_p=TOP_P, top_k=0, max_new_tokens=args.new_tokens
        )
        if g.shape[1] - ids.shape[1] > G + 8:
            evals.append(slot_rows(draft, target, g[0], ids.shape[1], 10_000, rng))
    held = cat_rows(evals)
    print(f"held-out anchors: {len(held['label'])} from {len(evals)} answers ({time.time() - t0:.0f}s)", flush=True)
    decay = torch.exp(-torch.arange(G).float() / 7.0).repeat(len(train["label"]) // G)
    train_slots = {k: v.view(-1, G, *v.shape[1:]) for k, v in train.items()}  # (scored like the held-out rows)
    results = {"shipped": {"heldout": evaluate(draft.candidate_selector, held)}}
    print("shipped", results["shipped"], flush=True)
    for kind in args.objectives.split(","):
        sel = copy.deepcopy(draft.candidate_selector).train()
        opt = torch.optim.AdamW(sel.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(args.steps):
            idx = torch.multinomial(decay, args.batch, replacement=True, generator=gen)
            b = {k: v[idx] for k, v in train.items()}
            loss = objective(sel, b, kind)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sel.eval()
        results[kind] = {
            "heldout": evaluate(sel, held),
            "train_rows": evaluate(sel, train_slots),
        }
        print(kind, results[kind], f"({time.time() - t0:.0f}s)", flush=True)
    results["shipped"]["train_rows"] = evaluate(draft.candidate_selector, train_slots)
    results["args"] = vars(args)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
