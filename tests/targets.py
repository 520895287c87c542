"""Tiny random targets built in-process from transformers config classes (no downloads)."""

import torch
import transformers as tf

from dflash2.config import DFlash2Config
from dflash2.model import DFlash2DraftModel

VOCAB = 96


def _common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return base


def build(arch: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = tf.LlamaConfig(**_common())
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "llama_hd16":  # head_dim 16: the smallest the Triton attention kernel takes
        cfg = tf.LlamaConfig(**_common(hidden_size=64, intermediate_size=96))
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen2":  # biased q / k / v projections
        cfg = tf.Qwen2Config(**_common())
        model = tf.Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.3)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**_common(head_dim=8))
        model = tf.Qwen3ForCausalLM(cfg)
    elif arch == "deepseek_v3":
        cfg = tf.DeepseekV3Config(
            **_common(
                num_key_value_heads=4,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                moe_intermediate_size=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                rope_scaling=None,
            )
        )
        model = tf.DeepseekV3ForCausalLM(cfg)
    elif arch == "kimi_linear":
        cfg = tf.KimiLinearConfig(
            **_common(
                num_key_value_heads=4,
                moe_intermediate_size=16,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                v_head_dim=8,
                qk_nope_head_dim=8,
                num_experts=4,
                num_experts_per_token=2,
                num_shared_experts=1,
                linear_head_dim=8,
                linear_num_heads=4,
                first_k_dense_replace=1,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            )
        )
        model = tf.KimiLinearForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # sharper logits than the 0.02 init so greedy paths are not all near-ties
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.to(dtype).eval()


ARCHS = ["llama", "qwen3", "deepseek_v3", "kimi_linear"]


class OracleProposer:
    """Knows the target's greedy continuation and injects errors (so full-block acceptance,
    partial acceptance and rollback all happen). q_draft is one-hot on what it proposes."""

    def __init__(self, continuation, prompt_len, vocab=VOCAB, error_rate=0.25, seed=0):
        self.cont, self.L, self.vocab = list(continuation), prompt_len, vocab
        self.rng = torch.Generator().manual_seed(seed)
        self.error_rate = error_rate

    def begin(self, features):
        pass

    def commit(self, features, start):
        pass

    def propose(self, anchor, anchor_pos, num, sampling, uniforms):
        start = anchor_pos - self.L + 1  # index of the token after the anchor in the continuation
        toks = []
        for i in range(num):
            j = start + i
            tok = self.cont[j] if j < len(self.cont) else 3
            if torch.rand((), generator=self.rng) < self.error_rate:
                tok = int(torch.randint(3, self.vocab, (), generator=self.rng))
            toks.append(tok)
        t = torch.tensor(toks)
        return t, torch.nn.functional.one_hot(t, self.vocab).float()


def tiny_config(**overrides) -> DFlash2Config:
    base = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        intermediate_size=48,
        vocab_size=97,
        target_layer_ids=[0, 2],
        num_target_layers=3,
        block_size=5,
        mask_token_id=96,
        sliding_window=16,
        conv_kernel_size=2,
        conv_group_size=4,
        selector_rank=8,
        selector_top_k=6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    base.update(overrides)
    return DFlash2Config(**base)


def sharp_v8_llama(seed: int = 3):
    """A 2-layer Llama over 8 tokens with sharp, context-dependent distributions: small enough that
    the exact joint distribution of two sampled tokens is computed by enumeration."""
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=8,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=None,
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    return model


def v8_draft(std: float = 0.2) -> DFlash2DraftModel:
    """A drafter for :func:`sharp_v8_llama` (hidden 16, vocabulary 8, features of layer 0)."""
    cfg = tiny_config(
        hidden_size=16,
        vocab_size=8,
        mask_token_id=7,
        target_layer_ids=[0],
        num_target_layers=2,
        selector_top_k=4,
        rope_scaling=None,
    )
    return DFlash2DraftModel(cfg).init_weights(std=std)


@torch.no_grad()
def exact_joint(model, prompt: list[int], n: int) -> torch.Tensor:
    """The target's exact distribution at T=1 of its next ``n`` tokens after ``prompt``, by enumeration:
    ``[V] * n``, flattened in the order ``sum_i tok_i * V^(n-1-i)``."""
    from dflash2.sampling import probs_from_logits

    def p_next(ids):
        return probs_from_logits(model(torch.tensor([ids])).logits[0, -1], 1.0)

    if n == 1:
        return p_next(prompt)
    first = p_next(prompt)
    return torch.cat([first[a] * exact_joint(model, prompt + [a], n - 1) for a in range(first.numel())])


def inside_runner_step(eng, monkeypatch) -> list[bool]:
    """Wraps the engine's ``runner.step``: the returned flag's ``[0]`` is True while a step runs (where
    the engine's overlap work runs: on CUDA, behind the device)."""
    inside, real_step = [False], eng.runner.step

    def step(*a, **k):
        inside[0] = True
        try:
            return real_step(*a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(eng.runner, "step", step)
    return inside
