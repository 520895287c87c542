"""Tiny random targets built in-process from transformers config classes (no downloads)."""
import torch
import transformers as tf

VOCAB = 96


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return base


def build(arch: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = tf.LlamaConfig(**_common())
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**_common(head_dim=8))
        model = tf.Qwen3ForCausalLM(cfg)
    elif arch == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**_common(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                            qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4,
                                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                            n_group=1, topk_group=1, rope_scaling=None))
        model = tf.DeepseekV3ForCausalLM(cfg)
    elif arch == "kimi_linear":
        cfg = tf.KimiLinearConfig(**_common(num_key_value_heads=4, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=None,
                                            qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, num_experts=4,
                                            num_experts_per_token=2, num_shared_experts=1, linear_head_dim=8,
                                            linear_num_heads=4, first_k_dense_replace=1,
                                            layer_types=["linear_attention", "full_attention",
                                                         "linear_attention", "full_attention"]))
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
