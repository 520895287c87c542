import sys, torch
sys.path.insert(0, "src"); sys.path.insert(0, "scripts")
from functools import partial
from gpu import replay_ms
from dflash2.engine.graph_runner import Replay
from dflash2.kernels.truncate import fused_probs
from dflash2.sampling import GREEDY_BELOW, probs_from_logits
g = torch.Generator(device="cuda").manual_seed(2)
for R in (64, 128, 320, 640):
    V = 49152
    logits = (torch.randn(R, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    T = torch.where(torch.arange(R, device="cuda") % 4 == 0, 0.0, 1.0)
    k, tp, mp = torch.full((R,), -1, device="cuda"), torch.full((R,), 0.95, device="cuda"), torch.zeros(R, device="cuda")
    ref = probs_from_logits(logits, T, k, tp, mp, capturable=True, kernel="truncate")
    line = [f"R{R}"]
    for nc, blk, nw, sh in ((2,4096,16,True),(2,4096,16,False),(2,2048,8,True),(2,2048,8,False),(2,1024,4,True),(2,1024,8,True),(4,1024,4,True)):
        f = partial(fused_probs, logits, T[:, None], k[:, None], tp[:, None], mp[:, None], GREEDY_BELOW, nc, blk, nw, shrink=sh)
        same = int(((f() > 0) == (ref > 0)).all(-1).sum())
        ms = replay_ms(Replay(f, True), 50)
        line.append(f"nc{nc} b{blk} w{nw} {'shrink' if sh else 'whole'} {ms:.3f} ({same})")
    print(" | ".join(line), flush=True)
