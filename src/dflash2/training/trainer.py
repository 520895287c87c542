"""``dflash2 train``: fit a DFlash2 drafter to a frozen target on the target's own answers."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import ConfigError, DFlash2Config
from ..model import DFlash2DraftModel
from ..model.checkpoint import load_draft, save_draft
from .data import TokenDataset
from .losses import draft_loss, lr_at, sample_blocks


@dataclass
class TrainConfig:
    data: str
    output_dir: str
    draft_config: str | dict  # a config.json path, or the dict itself (target fields filled in)
    target_path: str | None = None  # None: the default target
    steps: int = 1000
    batch_size: int = 16
    max_len: int = 768
    anchors_per_seq: int = 48
    lr: float = 6e-4
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0
    selector_weight: float = 1.0
    kl_weight: float = 0.0  # > 0: add KL(p_target || q_draft) distillation (beyond spec section 7)
    selector_kl_weight: float = 0.0  # > 0: the same for the selector's distribution over its candidates
    init_from: str | None = None  # start from these draft weights (a published-layout folder)
    seed: int = 0
    device: str = "cpu"
    save_every: int = 500
    eval_every: int = 500
    eval_prompts: int = 4
    eval_max_new_tokens: int = 96
    heldout_fraction: float = 0.01
    resume: bool = False
    time_limit_s: float | None = None  # stop (and save) after this much wall time
    # a data recipe (training/recipe.py): when ``data`` does not exist yet, it is built from this first
    prepare: dict | None = None
    # held-out prompts (a TokenDataset with domains): acceptance per domain, greedy and T=1 block, at
    # each evaluation; None: ``heldout.npz`` beside ``data`` if there, else a fraction of ``data``
    heldout: str | None = None
    eval_width: int | None = None  # None: the draft's block size
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prepare is not None:
            from .recipe import DataRecipe

            DataRecipe.from_dict(self.prepare)  # a wrong key fails here, before the target loads
        if self.eval_width is not None and self.eval_width < 2:
            raise ValueError(f"eval_width must be at least 2 (got {self.eval_width})")

    def heldout_path(self) -> Path:
        return Path(self.heldout) if self.heldout else Path(self.data).parent / "heldout.npz"

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "TrainConfig":
        raw = json.loads(Path(path).read_text())
        raw.update({k: v for k, v in overrides.items() if v is not None})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown training config key(s): {sorted(unknown)}")
        return cls(**raw)


def _draft_config(tc: TrainConfig, target) -> DFlash2Config:
    raw = json.loads(Path(tc.draft_config).read_text()) if isinstance(tc.draft_config, str) else dict(tc.draft_config)
    raw.setdefault("hidden_size", target.config.hidden_size)
    raw.setdefault("vocab_size", target.lm_head_weight.shape[0])
    raw.setdefault("num_target_layers", target.num_layers)
    cfg = DFlash2Config.from_dict(raw)
    if cfg.selector_vocab_size is not None:  # (codebook_rows would map every token to row 0)
        raise ConfigError(
            f"{tc.draft_config}: selector_vocab_size is set, and a drafter trained from scratch has no codebook "
            "rows for it; grow a trained drafter instead (dflash2 grow-draft --token-map ...) and train with "
            "--init-from its folder"
        )
    return cfg


def heldout_acceptance(target, draft, rows, width: int, max_new_tokens: int, temperature: float = 0.0) -> float:
    """Pooled acceptance length over ``rows``' prompts: greedy, or at ``temperature`` with top-p 0.95
    and block verification (the card's serving point), one seed per prompt."""
    from ..engine import DFlashProposer, speculative_generate
    from ..verification import SamplingParams

    C = V = 0
    for k, r in enumerate(rows):
        prop = DFlashProposer(draft, target.embed, target.lm_head_weight)
        sp = SamplingParams(max_new_tokens=max_new_tokens)
        if temperature > 0:
            sp = SamplingParams(temperature=temperature, top_p=0.95, seed=k, max_new_tokens=max_new_tokens)
        method = "block" if temperature > 0 else None
        res = speculative_generate(target, prop, r["ids"][: r["prompt_len"]].long(), sp, width, method)
        C += res.completion_tokens
        V += res.verify_steps
    return C / max(V, 1)


def heldout_by_domain(target, draft, rows, width: int, max_new_tokens: int, per_domain: int) -> dict:
    """``{domain: {"greedy": AL, "t1_block": AL}}`` (pooled C / V) over the first ``per_domain`` rows
    of each domain, every prompt at once through the serving engine (eager, one batch), so an
    evaluation costs seconds on the GPU; T=1 runs top-p 0.95 with block verification, one seed per
    prompt. The draft runs in the target's dtype (a copy, when training keeps it in float32)."""
    import copy

    from ..engine.engine import EngineConfig, LLMEngine
    from ..sampling import SamplingParams

    picked = [
        (d, r) for d in sorted({r["domain"] for r in rows}) for r in [x for x in rows if x["domain"] == d][:per_domain]
    ]
    dtype = target.lm_head_weight.dtype
    ev = draft if next(draft.parameters()).dtype == dtype else copy.deepcopy(draft).to(dtype)
    prompts = [r["ids"][: r["prompt_len"]].tolist() for _, r in picked]
    out: dict = {d: {} for d, _ in picked}
    for name, temperature in (("greedy", 0.0), ("t1_block", 1.0)):
        cfg = EngineConfig.for_models(
            target,
            ev,
            width,
            max_running_requests=max(len(prompts), 1),
            block_verification=temperature > 0,
            disable_cuda_graph=True,
        )
        sps = [
            SamplingParams(
                temperature=temperature, top_p=0.95 if temperature else 1.0, seed=k, max_new_tokens=max_new_tokens
            )
            for k in range(len(prompts))
        ]
        results = LLMEngine(target, ev, cfg).generate(prompts, sps)
        for d in out:
            C = sum(res.completion_tokens for (dd, _), res in zip(picked, results) if dd == d)
            V = sum(res.verify_steps for (dd, _), res in zip(picked, results) if dd == d)
            out[d][name] = C / max(V, 1)
    return out


def _init_from_target(draft, target) -> None:
    """Start the draft's final norm at a tenth of the target's: with a tied LM head, the MASK slots
    would otherwise start by predicting MASK itself with huge confidence (CE ~50 nats)."""
    norm = getattr(getattr(target.model, "model", None), "norm", None)
    w = getattr(norm, "weight", None)
    if w is not None and w.shape == draft.norm.weight.shape:
        with torch.no_grad():
            draft.norm.weight.copy_(0.1 * w.float())


def _distributed(tc: TrainConfig) -> tuple[int, int, torch.device, bool]:
    """torchrun's environment -> (rank, world size, device, whether this call started the process
    group); one process: (0, 1, tc.device, False). gloo on the CPU, NCCL on GPUs (one per rank)."""
    world, device = int(os.environ.get("WORLD_SIZE", "1")), torch.device(tc.device)
    if world == 1:
        return 0, 1, device, False
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device, started


def _average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Data parallel: every rank's gradients summed in one flat all-reduce, then divided by the ranks
    (a parameter a rank did not reach counts as zero there, so every rank sends the same shape)."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()


def train(tc: TrainConfig, target=None) -> dict:
    from ..target.loading import load_target

    torch.manual_seed(tc.seed)
    rng = random.Random(tc.seed)
    rank, world, device, started = _distributed(tc)
    on_gpu = device.type == "cuda"
    if target is None:
        target = load_target(tc.target_path, "bfloat16" if on_gpu else "float32", str(device))
    if tc.prepare is not None and not Path(tc.data).is_file():
        from .recipe import DataRecipe, prepare_data

        if rank == 0:
            report = prepare_data(DataRecipe.from_dict(tc.prepare), target, tc.data, tc.heldout_path())
            tqdm.write(f"data: {report['sequences']} sequences, {report['tokens']} tokens -> {tc.data}")
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
    out = Path(tc.output_dir)
    if tc.resume and (out / "config.json").is_file():
        draft = load_draft(out, device=device, dtype=torch.float32).train()
        state = torch.load(out / "trainer_state.pt", weights_only=False)
    elif tc.init_from:
        draft = load_draft(tc.init_from, device=device, dtype=torch.float32).train()
        state = None
    else:
        draft = DFlash2DraftModel(_draft_config(tc, target)).to(device).init_weights()
        _init_from_target(draft, target)
        state = None
    cfg = draft.config
    target.set_layer_ids(cfg.target_layer_ids)
    for p in target.model.parameters():
        p.requires_grad_(False)
    params = list(draft.parameters())
    if world > 1:  # every rank starts from rank 0's weights
        import torch.distributed as dist

        for p in params:
            dist.broadcast(p.data, 0)
    data = TokenDataset.load(tc.data)
    idx = list(range(len(data)))
    rng.shuffle(idx)
    by_domain = tc.heldout_path().is_file()
    if by_domain:  # held-out prompts of their own: every data row trains
        held, train_idx = TokenDataset.load(tc.heldout_path()).rows, idx
    else:
        n_held = max(1, int(len(data) * tc.heldout_fraction))
        held, train_idx = [data.rows[i] for i in idx[:n_held]], idx[n_held:]
    opt = torch.optim.AdamW(draft.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    step = 0
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        rng.setstate(state["rng"])
    pad = int(cfg.mask_token_id)
    width = cfg.block_size
    eval_width = min(tc.eval_width or width, width)
    history: list[dict] = []
    if state is not None and (out / "train_log.jsonl").is_file():  # a resumed run's curves go on from its log
        lines = (out / "train_log.jsonl").read_text().splitlines()
        history = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= step]
    t_start = time.perf_counter()
    tokens_seen = 0
    bar = tqdm(total=tc.steps, initial=step, desc="train", dynamic_ncols=True, disable=rank != 0)
    order: list[int] = []
    # the held-out split above is the same on every rank; the batches differ (rank r draws its own order)
    batch_rng = rng if world == 1 else random.Random(tc.seed * 1009 + rank + 7919 * step)
    while step < tc.steps:
        if len(order) < tc.batch_size:
            order += batch_rng.sample(train_idx, len(train_idx))
        batch, order = order[: tc.batch_size], order[tc.batch_size :]
        ids, loss_mask, valid = data.batch(batch, tc.max_len, pad)
        ids, loss_mask, valid = ids.to(device), loss_mask.to(device), valid.to(device)
        with torch.no_grad():
            t_logits, feats = target.batched_forward(ids, valid.long())
        blocks = sample_blocks(ids, loss_mask, tc.anchors_per_seq, width, cfg.mask_token_id, tc.gamma)
        tgt_logits = None
        if (
            tc.kl_weight > 0 or tc.selector_kl_weight > 0
        ):  # row t of the target's logits predicts token t+1: slot k's label sits at a+k
            rows = (blocks.positions[..., :-1]).clamp(max=ids.shape[1] - 1).flatten(1)
            tgt_logits = t_logits[torch.arange(ids.shape[0], device=device)[:, None], rows]
            tgt_logits = tgt_logits.view(*blocks.labels.shape, -1)
        del t_logits
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc.steps, tc.warmup, tc.lr, tc.min_lr_ratio)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            lo = draft_loss(
                draft,
                feats,
                valid,
                blocks,
                target.embed,
                target.lm_head_weight,
                tc.selector_weight,
                tgt_logits,
                tc.kl_weight,
                tc.selector_kl_weight,
            )
        opt.zero_grad(set_to_none=True)
        lo.loss.backward()
        if world > 1:
            _average_gradients(params, world)
        gnorm = torch.nn.utils.clip_grad_norm_(draft.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        tokens_seen += int(valid.sum())
        rec = {
            "step": step,
            "loss": lo.loss.item(),
            "ce": lo.ce.item(),
            "selector": lo.selector.item(),
            "kl": lo.kl.item() if lo.kl is not None else 0.0,
            "selector_kl": lo.selector_kl.item() if lo.selector_kl is not None else 0.0,
            "top1": lo.top1_acc,
            "recall": lo.cand_recall,
            "grad_norm": float(gnorm),
        }
        history.append(rec)
        elapsed = time.perf_counter() - t_start
        bar.set_postfix(
            loss=f"{rec['loss']:.3f}",
            top1=f"{rec['top1']:.3f}",
            recall=f"{rec['recall']:.3f}",
            tok_s=f"{world * tokens_seen / elapsed:.0f}",
        )
        bar.update(1)
        last = bool(step == tc.steps or (tc.time_limit_s and elapsed > tc.time_limit_s))
        if world > 1 and tc.time_limit_s:  # every rank stops at the same step (else an all-reduce waits forever)
            import torch.distributed as dist

            flag = torch.tensor([float(last)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            last = bool(flag.item())
        if rank != 0:  # rank 0 evaluates, saves and logs
            if last:
                break
            continue
        if tc.eval_every and (step % tc.eval_every == 0 or last):
            draft.eval()
            if by_domain:
                per = heldout_by_domain(target, draft, held, eval_width, tc.eval_max_new_tokens, tc.eval_prompts)
                rec["heldout"] = per
                table = ", ".join(f"{d} {v['greedy']:.2f}/{v['t1_block']:.2f}" for d, v in per.items())
                tqdm.write(f"step {step}: held-out acceptance length (width {eval_width}, greedy/T=1 block): {table}")
            else:
                al = heldout_acceptance(target, draft, held[: tc.eval_prompts], eval_width, tc.eval_max_new_tokens)
                rec["heldout_accept_length"] = al
                tqdm.write(f"step {step}: held-out acceptance length {al:.3f} (width {eval_width}, greedy)")
            draft.train()
        if step % tc.save_every == 0 or last:
            _save(draft, opt, step, rng, out, history)
        if last:
            break
    bar.close()
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        if started:
            dist.destroy_process_group()
    seconds = time.perf_counter() - t_start
    return {"steps": step, "history": history, "seconds": seconds, "tokens": world * tokens_seen, "draft": draft}


def _save(draft, opt, step, rng, out: Path, history) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".tmp"
    save_draft(draft, tmp)
    torch.save({"optimizer": opt.state_dict(), "step": step, "rng": rng.getstate()}, tmp / "trainer_state.pt")
    for f in tmp.iterdir():
        f.replace(out / f.name)
    tmp.rmdir()
    (out / "train_log.jsonl").write_text("\n".join(json.dumps(h) for h in history) + "\n")
    from .plots import plot_history

    plot_history(history, out / "train_curves.png")
