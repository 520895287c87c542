"""``dflash2 bench acceptance``: the card's table (acc_len, token-weighted and pooled AL) against
a running server (``/generate``'s ``meta_info``, ours or SGLang's) or in process."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from . import suites
from .metrics import aggregate, per_position


def add_acceptance_parser(bsub) -> None:
    from ..entry import add_model_flags

    p = bsub.add_parser("acceptance", help="acceptance length on GSM8K / AIME / GPQA (the card's table)")
    add_model_flags(p)
    p.add_argument("--base-url", default=None, help="a running server (ours or SGLang); else in process")
    p.add_argument("--tokenizer-path", default=None, help="for the chat template when --base-url is given")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--gsm8k-path")
    p.add_argument("--aime-path")
    p.add_argument("--gpqa-path")
    p.add_argument("--heldout-path", help="heldout_prompts.jsonl of a data recipe: suite 'heldout', one row per domain")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--num-workers", type=int, default=32)
    p.add_argument("--max-running-requests", type=int, default=16, help="in-process engine")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--output", default=None)
    p.add_argument("--plot", default=None, help="PNG of the acceptance-length distribution per suite")
    p.set_defaults(fn=cmd_acceptance)


def load_items(args) -> dict[str, list]:
    out = {}
    for name in [s.strip() for s in args.dataset.split(",") if s.strip()]:
        if name == "gsm8k":
            out[name] = suites.gsm8k(args.gsm8k_path, args.limit)
        elif name == "aime":
            out[name] = suites.aime(args.aime_path, args.limit, args.repeats)
        elif name == "gpqa":
            out[name] = suites.gpqa(args.gpqa_path, args.limit)
        elif name == "heldout":
            if not args.heldout_path:
                raise SystemExit("--dataset heldout needs --heldout-path (a recipe's heldout_prompts.jsonl)")
            out.update(suites.heldout(args.heldout_path, args.limit))
        else:
            raise SystemExit(f"--dataset: unknown suite {name!r} (gsm8k, aime, gpqa, heldout)")
    return out


def render_text(tokenizer, prompt: str | list[dict]) -> str:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class ServerBackend:
    def __init__(self, base_url: str, tokenizer, args):
        import httpx

        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=3600)
        self.tok, self.args = tokenizer, args

    def run(self, item) -> dict:
        sp = {
            "temperature": self.args.temperature,
            "top_p": self.args.top_p,
            "max_new_tokens": self.args.max_tokens,
            "seed": item.seed,
            "sampling_seed": item.seed,
        }
        r = self.client.post("/generate", json={"text": render_text(self.tok, item.prompt), "sampling_params": sp})
        r.raise_for_status()
        meta = r.json()["meta_info"]
        fr = meta.get("finish_reason") or {}
        return {
            "C": meta["completion_tokens"],
            "V": meta["spec_verify_ct"],
            "finish": fr.get("type", "stop") if isinstance(fr, dict) else str(fr),
            "hist": meta.get("spec_accept_histogram"),
        }


class EngineBackend:
    """All requests go into one in-process engine (continuous batching), like a server would."""

    def __init__(self, args, items: dict[str, list]):
        from ..entry import load_models
        from ..engine.engine import EngineConfig, LLMEngine
        from ..training.data import render

        target, draft, width = load_models(args)
        self.tok = target.tokenizer
        # the context these prompts need, so that no attention prefix past it is captured at start-up
        longest = max((len(render(self.tok, it.prompt)) for lst in items.values() for it in lst), default=1)
        ctx = int(getattr(target.config, "max_position_embeddings", 2048))
        self.engine = LLMEngine(
            target,
            draft,
            EngineConfig.for_models(
                target,
                draft,
                width,
                context_length=min(ctx, longest + args.max_tokens + width + 1),
                max_running_requests=args.max_running_requests,
                block_verification=args.speculative_use_block_verification,
                disable_cuda_graph=args.disable_cuda_graph,
                disable_torch_compile=args.disable_torch_compile,
                attention_backend=args.attention_backend,
                sampler_backend=args.sampler_backend,
                speculative_planner="off",  # acceptance at the loaded width: a width-1 step would count as AL 1
                graph_sampling="greedy" if args.temperature == 0 else "sampled",  # one kind: half the captures
            ),
        )
        self.engine.start()
        self.args = args

    def run(self, item) -> dict:
        from ..engine.request import Request
        from ..training.data import render
        from ..verification import SamplingParams

        done = threading.Event()
        req = Request(
            render(self.tok, item.prompt),
            SamplingParams(
                temperature=self.args.temperature,
                top_p=self.args.top_p,
                max_new_tokens=self.args.max_tokens,
                seed=item.seed,
            ),
            on_update=lambda r, new: done.set() if r.finished else None,
        )
        self.engine.add_request(req)
        done.wait()
        if req.finish_reason == "error":
            raise RuntimeError(req.error)
        return {"C": len(req.output_ids), "V": req.verify_steps, "finish": req.finish_reason, "hist": req.accept_hist}


def run_suites(backend, items: dict[str, list], num_workers: int) -> dict:
    results: dict[str, dict] = {}
    bars = {name: tqdm(total=len(lst), desc=name, position=i) for i, (name, lst) in enumerate(items.items())}

    def one(name, item):
        for attempt in (0, 1):  # a failed request is retried once, and counted
            try:
                r = backend.run(item)
                r["retried"] = attempt
                break
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}", "retried": attempt}
        bars[name].update(1)
        return r

    pools = {name: ThreadPoolExecutor(num_workers) for name in items}
    futures = {name: [pools[name].submit(one, name, it) for it in lst] for name, lst in items.items()}
    for name, futs in futures.items():
        rows = [f.result() for f in futs]
        pools[name].shutdown()
        ok = [r for r in rows if "error" not in r]
        C, V = [r["C"] for r in ok], [r["V"] for r in ok]
        hist = None
        for r in ok:
            if r.get("hist"):
                hist = [a + b for a, b in zip(hist, r["hist"])] if hist else list(r["hist"])
        res = aggregate(C, V)
        res.update(
            {
                "C": C,
                "V": V,
                "mean_completion": sum(C) / max(len(C), 1),
                "finished_eot": sum(r["finish"] == "stop" for r in ok),
                "truncated": sum(r["finish"] == "length" for r in ok),
                "failed": len(rows) - len(ok),
                "retried": sum(r["retried"] for r in rows),
                "per_position": per_position(hist) if hist else None,
            }
        )
        results[name] = res
    held = [n for n in results if n.startswith("heldout/")]
    if len(held) > 1:  # the whole held-out split, pooled over its domains
        C = [c for n in held for c in results[n]["C"]]
        V = [v for n in held for v in results[n]["V"]]
        results["heldout/all"] = aggregate(C, V) | {
            "C": C,
            "V": V,
            "mean_completion": sum(C) / max(len(C), 1),
            **{k: sum(results[n][k] for n in held) for k in ("finished_eot", "truncated", "failed", "retried")},
            "per_position": None,
        }
    for b in bars.values():
        b.close()
    return results


def format_table(results: dict) -> str:
    lines = [
        f"{'dataset':<22}{'samples':>8}{'acc_len':>9}{'weighted':>10}{'pooled':>8}{'mean C':>8}{'eot':>6}{'trunc':>6}{'fail':>5}"
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<22}{r['samples']:>8}{r['acc_len']:>9.3f}{r['weighted_al']:>10.3f}{r['pooled_al']:>8.3f}"
            f"{r['mean_completion']:>8.1f}{r['finished_eot']:>6}{r['truncated']:>6}{r['failed']:>5}"
        )
        if r.get("per_position"):
            lines.append("  per-position acceptance: " + " ".join(f"{x:.3f}" for x in r["per_position"]))
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        L = [c / v for c, v in zip(r["C"], r["V"]) if v]
        if L:
            ax.hist(L, bins=30, alpha=0.5, label=f"{name} (acc_len {r['acc_len']:.2f})")
    ax.set_xlabel("acceptance length C/V per request")
    ax.set_ylabel("requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_acceptance(args) -> int:
    items = load_items(args)
    if args.base_url:
        from transformers import AutoTokenizer

        from ..target.loading import default_target_path

        tok = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path or default_target_path())
        backend = ServerBackend(args.base_url, tok, args)
    else:
        backend = EngineBackend(args, items)
    t0 = time.time()
    results = run_suites(backend, items, args.num_workers)
    print(format_table(results) + f"\n({time.time() - t0:.0f}s)")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)
    if isinstance(backend, EngineBackend):
        backend.engine.shutdown()
    return 0
