# teacher-forced per-slot token-level acceptance sum_x min(p_target, q_draft) at T=1/top-p .95,
# for several draft distributions (selector at temperature tau; dense draft logits)
import json, sys, torch, warnings
warnings.filterwarnings("ignore")
torch.set_num_threads(2)
from dflash2.cli import DEFAULT_DRAFT
from dflash2.model import build_block_mask
from dflash2.model.checkpoint import load_draft
from dflash2.model.token_map import load_token_map
from dflash2.target.loading import load_target
from dflash2.verification.logits import probs_from_logits
torch.manual_seed(0)
draft_dir = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_DRAFT
draft = load_draft(draft_dir, dtype=torch.float32).eval()
target = load_target(None, "float32", layer_ids=draft.config.target_layer_ids)
draft.set_token_map(load_token_map(f"{DEFAULT_DRAFT}/token_map.pt", draft.config.vocab_size), target.lm_head_weight)
seqs = json.load(open(sys.argv[1]))
W, G = 8, 7
TAUS = [0.7, 0.85, 1.0, 1.15, 1.3, 1.5]
acc = {f"sel{t}": [] for t in TAUS}
acc.update({f"dense{t}": [] for t in [0.85, 1.0, 1.15, 1.3]})
acc["oracle_cand"] = []; acc["recall_p"] = []
sel = draft.candidate_selector
with torch.no_grad():
    for s in seqs:
        ids = torch.tensor(s["ids"])[None]; P0 = s["prompt_len"]; T = ids.shape[1]
        if T - G - P0 < 8: continue
        target._captured.clear()
        tl = target.model(input_ids=ids, use_cache=False).logits[0].float()
        feats = torch.cat([target._captured[i] for i in target.layer_ids], -1)
        anchors = torch.arange(P0 - 1, T - G)  # slots a+1..a+G all inside the sequence
        N = len(anchors)
        pos = anchors[:, None] + torch.arange(W)
        ctx_pos = torch.arange(T)[None]
        lat = draft.context_latents(draft.fuse(feats), ctx_pos)
        qp = pos.view(1, -1)
        mask = build_block_mask(qp, anchors[:, None].expand(N, W).reshape(1, -1),
                                torch.arange(N)[:, None].expand(N, W).reshape(1, -1), ctx_pos,
                                torch.ones(1, T, dtype=torch.bool), draft.config.sliding_window, draft.config.is_causal)
        blk = torch.full((N, W), draft.config.mask_token_id); blk[:, 0] = ids[0, anchors]
        hid = draft(target.embed(blk.view(1, -1)), qp, lat, mask, W).view(N, W, -1)[:, 1:]
        U, cand = draft.candidates(hid, target.lm_head_weight)              # [N, G, k]
        labels = ids[0, pos[:, 1:]]                                           # [N, G]
        pred = torch.cat([ids[0, anchors][:, None], labels[:, :-1]], 1)
        Wp = sel.pair_weights(hid, cand)
        S = U + torch.einsum("ngkr,ngr->ngk", Wp, sel.predecessor_codebook[pred].float())
        p_t = probs_from_logits(tl[pos[:, :-1]], 1.0, -1, 0.95)             # [N, G, V] target at slot k
        p_c = p_t.gather(-1, cand)
        for t in TAUS:
            q = probs_from_logits(S, t, -1, 0.95)
            acc[f"sel{t}"].append(torch.minimum(p_c, q).sum(-1))
        dl = draft.compute_logits(hid, target.lm_head_weight)
        for t in [0.85, 1.0, 1.15, 1.3]:
            q = probs_from_logits(dl, t, -1, 0.95)
            acc[f"dense{t}"].append(torch.minimum(p_t, q).sum(-1))
        acc["oracle_cand"].append(p_c.sum(-1))   # q = p_target restricted to the candidates, renormalised -> accept = mass
        acc["recall_p"].append(p_c.sum(-1))
        print(len(acc["oracle_cand"]), N, flush=True)
res = {}
for k, v in acc.items():
    a = torch.cat(v)                                       # [Nall, G]
    al5 = 1 + torch.cumprod(a[:, :4], 1).sum(1).mean().item()
    al8 = 1 + torch.cumprod(a, 1).sum(1).mean().item()
    res[k] = {"slot": [round(x, 3) for x in a.mean(0).tolist()], "al5_est": round(al5, 3), "al8_est": round(al8, 3)}
    print(k, res[k])
json.dump(res, open(sys.argv[1] + ".res.json", "w"), indent=1)
