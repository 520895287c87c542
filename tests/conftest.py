import pytest
import torch

from dflash2.config import DFlash2Config


def tiny_config(**overrides) -> DFlash2Config:
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=12,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, intermediate_size=48, vocab_size=97,
                target_layer_ids=[0, 2], num_target_layers=3, block_size=5, mask_token_id=96, sliding_window=16,
                conv_kernel_size=2, conv_group_size=4, selector_rank=8, selector_top_k=6,
                rope_theta=10000.0, max_position_embeddings=256,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    base.update(overrides)
    return DFlash2Config(**base)


@pytest.fixture
def seed():
    # fresh random inputs each run; the seed is printed so a failure can be replayed
    s = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


from test_server import models  # noqa: E402,F401  (module-scoped fixture shared with test_bench)
