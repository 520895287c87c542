"""#22: does what the draft knows before verification predict acceptance? One request at a time
through the reference loop (:func:`dflash2.engine.speculative.speculative_generate`) at the full
width, the draft's per-position confidence recorded beside the accepted count of every step:

- ``sel``: the selector's probability of the chosen token at temperature 1 (softmax of the path
  scores over its k candidates; at T > 0 the token was drawn from it),
- ``margin``: the selector's top-1 minus top-2 path score,
- ``top``: the draft head's softmax probability of its top-1 token over the whole vocabulary.

    .venv/bin/python scripts/confidence_trace.py OUT.jsonl --suites heldout,gsm8k --limit 8 --temperatures 0,1

One JSON line a step: suite, prompt index, temperature, accepted count ``n`` (of ``width - 1``), and
the three features per draft position. ``scripts/confidence_sim.py`` reads them."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


class TracingProposer:
    """DFlashProposer's propose, keeping the features of the path it returns."""

    def __init__(self, inner):
        self.inner, self.last = inner, None

    def begin(self, features):
        self.inner.begin(features)

    def commit(self, features, start):
        self.inner.commit(features, start)

    @torch.no_grad()
    def propose(self, anchor, anchor_pos, num, sampling, uniforms):
        from dflash2.model.context_cache import draft_block
        from dflash2.sampling import CandidateQ

        p = self.inner
        dev = p.lm_head_weight.device
        out = draft_block(
            p.draft, [p.cache], torch.tensor([anchor]), torch.tensor([anchor_pos]), num + 1, p.embed, p.lm_head_weight
        )
        U, cand = out.candidates()
        sel = p.draft.candidate_selector
        sel_out = sel.walk(
            (U, cand),
            out.hidden,
            torch.tensor([anchor], device=dev),
            torch.tensor([sampling.temperature], device=dev),
            uniforms[None].to(dev),
            sampling.top_k,
            sampling.top_p,
            sampling.min_p,
            all_greedy=sampling.greedy,
        )
        # the path scores of each slot given the chosen predecessor, at temperature 1
        W = sel.pair_weights(out.hidden, cand)[0]  # [g, k, r]
        prev = torch.cat([torch.tensor([anchor]), sel_out.tokens[0, :-1]])
        S = U[0].float() + torch.einsum("tkr,tr->tk", W, sel.predecessor(prev).float())  # [g, k]
        chosen = (cand[0] == sel_out.tokens[0, :, None]).float().argmax(-1)
        probs = S.softmax(-1)
        top2 = S.topk(2, dim=-1).values
        full = out.logits[0].float().softmax(-1).max(-1).values
        self.last = {
            "sel": probs.gather(-1, chosen[:, None])[:, 0].tolist(),
            "margin": (top2[:, 0] - top2[:, 1]).tolist(),
            "top": full.tolist(),
        }
        tokens = sel_out.tokens[0]
        return tokens, None if sampling.greedy else CandidateQ(sel_out.cand_ids[0], sel_out.q_draft[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output")
    ap.add_argument("--suites", default="heldout,gsm8k")
    ap.add_argument("--limit", type=int, default=8, help="prompts per suite (held-out: per domain)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from dflash2.benchmark import suites
    from dflash2.benchmark.acceptance import render
    from dflash2.cli import DEFAULT_DRAFT, REPO
    from dflash2.engine import speculative
    from dflash2.engine.proposers import DFlashProposer
    from dflash2.model.checkpoint import load_draft
    from dflash2.sampling import SamplingParams
    from dflash2.target.loading import load_target

    draft = load_draft(DEFAULT_DRAFT, dtype=torch.float32)
    target = load_target(None, "float32", layer_ids=draft.config.target_layer_ids)
    items: dict[str, list] = {}
    for name in args.suites.split(","):
        if name == "gsm8k":
            items["gsm8k"] = suites.gsm8k(REPO.parent / "shared/data/gsm8k/test.jsonl", args.limit)
        elif name == "heldout":
            items.update(suites.heldout(REPO / "work/recipe/heldout_prompts.jsonl", args.limit))
    with open(args.output, "w") as f:
        for temp in [float(t) for t in args.temperatures.split(",")]:
            for suite, lst in items.items():
                for i, item in enumerate(lst):
                    prop = TracingProposer(DFlashProposer(draft, target.embed, target.lm_head_weight))
                    steps: list[dict] = []
                    commit = prop.commit

                    def record(features, start, commit=commit, prop=prop, steps=steps):
                        if prop.last is not None:  # a step's commit: n + 1 rows
                            steps.append({**prop.last, "n": int(features.shape[0]) - 1})
                            prop.last = None
                        commit(features, start)

                    prop.commit = record  # type: ignore[method-assign]
                    sp = SamplingParams(
                        temperature=temp, top_p=0.95 if temp else 1.0, max_new_tokens=args.max_tokens, seed=i
                    )
                    speculative.speculative_generate(
                        target,
                        prop,
                        render(target.tokenizer, item.prompt),
                        sp,
                        width=args.width,
                        verify_method=None if temp == 0 else "block",
                    )
                    for k, s in enumerate(steps):
                        f.write(json.dumps({"suite": suite, "prompt": i, "T": temp, "step": k, **s}) + "\n")
                    f.flush()
                    mean = sum(s["n"] + 1 for s in steps) / max(1, len(steps))
                    print(f"T={temp} {suite} {i}: {len(steps)} steps, AL {mean:.2f}", flush=True)


if __name__ == "__main__":
    main()
