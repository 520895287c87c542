"""The static forward's fused layer kernels (kernels/layer_ops.py): each torch reference against
Hugging Face's own modules, each Triton kernel (under Triton's interpreter on the CPU) against its
reference, and the static forward with fused layers against Hugging Face's forward."""

import pytest
import torch
import transformers as tf
from transformers.models.llama import modeling_llama

from targets import build
from dflash2.kernels.layer_ops import (
    add_rms_norm,
    add_rms_norm_ref,
    rope_kv_write,
    rope_kv_write_ref,
    silu_mul,
    silu_mul_ref,
)
from dflash2.kernels.live_attention import use_triton
from dflash2.target import TargetModel
from dflash2.target.static_llama import Rows, StaticTarget, concat_linears

pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    not use_triton(torch.device("cpu")), reason="the kernels run on the CPU only under TRITON_INTERPRET=1"
)
DTYPES = [torch.float32, torch.bfloat16]


def close(out, ref):
    """float32: within 1e-5 (sums and exp in another order). bfloat16: within a few ulps of the operands
    (values here are O(1)), because Triton's interpreter truncates where the GPU rounds to nearest, at
    each rounding step; scripts/gpu.py checks the kernels in bfloat16 on the GPU."""
    if out.dtype == torch.float32:
        return (out - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max())
    return ((out.float() - ref.float()).abs() <= 0.02 * (ref.float().abs() + 1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_is_hf(dtype):
    g = torch.Generator().manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm(40, eps=1e-5)
    norm.weight.data = torch.randn(40, generator=g)
    norm = norm.to(dtype)
    x, r = (torch.randn(3, 5, 40, generator=g).to(dtype) for _ in range(2))
    out, h = add_rms_norm_ref(x, norm.weight, 1e-5, r)
    assert torch.equal(h, r + x) and torch.equal(out, norm(r + x))
    out, h = add_rms_norm_ref(x, norm.weight, 1e-5)
    assert h is x and torch.equal(out, norm(x))


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, generator=g).to(dtype)  # 40: not a power of two (masked lanes)
    x, r = (torch.randn(2, 3, 40, generator=g).to(dtype) for _ in range(2))
    res = r if with_residual else None
    out, h = add_rms_norm(x, w, 1e-6, res)
    ref_out, ref_h = add_rms_norm_ref(x, w, 1e-6, res)
    assert close(h, ref_h)
    assert close(out, ref_out)


def _rope_case(B, L, H, KV, d, P, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, L, (H + 2 * KV) * d, generator=g).to(dtype)
    rot = modeling_llama.LlamaRotaryEmbedding(tf.LlamaConfig(head_dim=d, hidden_size=d * H, num_attention_heads=H))
    start = torch.tensor([3, P - 2, 0][:B])
    pos = start[:, None] + torch.arange(L)
    cos, sin = rot(qkv, pos)
    pages = 3 * B + 1
    table = torch.randperm(pages, generator=g)[: 3 * B].view(B, 3).int()
    pools = [torch.zeros(pages, KV, P, d, dtype=dtype) for _ in range(2)]
    return qkv, cos, sin, pools, table, start, pos


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_reference_is_hf(dtype):
    """Rotated q and k equal Hugging Face's apply_rotary_pos_emb; k and v land at each row's
    positions through its table (a row across a page boundary)."""
    B, L, H, KV, d, P = 2, 4, 4, 2, 8, 16
    qkv, cos, sin, (kp, vp), table, start, pos = _rope_case(B, L, H, KV, d, P, dtype)
    q = rope_kv_write_ref(qkv, cos, sin, kp, vp, table, start, H, KV)
    q0, k0, v0 = qkv.view(B, L, H + 2 * KV, d).split([H, KV, KV], 2)
    hq, hk = modeling_llama.apply_rotary_pos_emb(q0.transpose(1, 2), k0.transpose(1, 2), cos, sin)
    assert torch.equal(q, hq)
    for b in range(B):
        for i in range(L):
            p = int(pos[b, i])
            page = int(table[b, p // P])
            assert torch.equal(kp[page, :, p % P], hk[b, :, i]) and torch.equal(vp[page, :, p % P], v0[b, i])


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 12, 64])  # 12: half a head is not a power of two (masked lanes)
def test_rope_kernel_matches_reference(dtype, d):
    B, L, H, KV, P = 3, 5, 6, 2, 16
    qkv, cos, sin, (kp, vp), table, start, _ = _rope_case(B, L, H, KV, d, P, dtype, seed=d)
    kr, vr = kp.clone(), vp.clone()
    q_ref = rope_kv_write_ref(qkv, cos, sin, kr, vr, table, start, H, KV)
    q = rope_kv_write(qkv, cos, sin, kp, vp, table, start, H, KV)
    assert close(q, q_ref) and close(kp, kr) and torch.equal(vp, vr)
    assert torch.equal(kp != 0, kr != 0)  # written where the reference writes, nowhere else


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel_matches_reference(dtype):
    gu = (torch.randn(3, 2, 2 * 1100, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    out, ref = silu_mul(gu), silu_mul_ref(gu)
    assert close(out, ref)


def test_concat_linears_keeps_hf_forward_and_memory():
    t = build("qwen2")
    ids = torch.randint(3, 90, (1, 9))
    before = t(ids).logits
    attn = t.model.layers[0].self_attn
    w, b = concat_linears(attn, ("q_proj", "k_proj", "v_proj"))
    assert attn.q_proj.weight.data_ptr() == w.data_ptr()  # views, no second copy
    assert concat_linears(attn, ("q_proj", "k_proj", "v_proj"))[0] is w  # done once
    assert torch.equal(t(ids).logits, before)


@needs_interpreter
@pytest.mark.parametrize("arch", ["llama", "llama_hd16", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "live"])
def test_static_forward_fused_matches_hf(arch, attention):
    """Prefill, a rejected block rolled back, accepted rows: logits within 1e-4 of Hugging Face's in
    float32 (check()); fused and unfused forwards agree on logits and features."""
    t = TargetModel(build(arch), layer_ids=[0, 2])
    fused = StaticTarget(t, 64, attention=attention, fused=True)
    assert fused.fused and fused.check(length=20) < 1e-4
    plain = StaticTarget(t, 64, attention=attention, fused=False)
    ids, start = torch.randint(3, 90, (1, 7)), torch.zeros(1, dtype=torch.long)
    (a, fa), (b, fb) = fused.forward(ids, start), plain.forward(ids, start)
    assert (a - b).abs().max() < 1e-4 and (fa - fb).abs().max() < 1e-4


def test_fused_refused_where_it_cannot_run():
    t = TargetModel(build("qwen3"), layer_ids=[0, 2])  # per-head q/k norms
    with pytest.raises(ValueError, match="fused layers"):
        StaticTarget(t, 64, fused=True)
    assert not StaticTarget(t, 64).fused  # the CPU default: unfused


@pytest.mark.parametrize(
    "arch,fused,attention",
    [(a, False, at) for a in ("llama_hd16", "qwen3") for at in ("sdpa", "live")] + [("llama_hd16", True, "live")],
)
def test_forward_rows_equals_separate_forwards(arch, fused, attention):
    """A verify block and a prefill chunk in one ``forward_rows`` (projections, MLP and LM head shared)
    give the logits, features and cache of the two forwards run apart, in float32."""
    if fused and not use_triton(torch.device("cpu")):
        pytest.skip("the fused layers run on the CPU only under TRITON_INTERPRET=1")
    t = TargetModel(build(arch), layer_ids=[0, 2])
    apart, joint = (StaticTarget(t, 64, attention=attention, page_size=64, num_pages=4, fused=fused) for _ in "ab")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 90, (2, 10), generator=g)
    block, chunk = torch.randint(3, 90, (2, 3), generator=g), torch.randint(3, 90, (1, 12), generator=g)
    tables = torch.arange(3, dtype=torch.int32)[:, None]  # row b on page b; the chunk's row on page 2
    zero2, zero1 = torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    for st in (apart, joint):  # the verify rows' prompts, already in
        st.forward(prompts, zero2, kv_len=10, tables=tables[:2])
    verify = dict(ids=block, start=torch.full((2,), 10), tables=tables[:2], kv_len=13)
    prefill = dict(ids=chunk, start=zero1, tables=tables[2:], kv_len=12, last=torch.tensor([11]))
    want = [apart.forward(**verify), apart.forward(**prefill)]
    got = joint.forward_rows([Rows(**verify), Rows(**prefill)])
    for (lg, f), (lg_ref, f_ref) in zip(got, want):
        assert lg.shape == lg_ref.shape and f.shape == f_ref.shape
        torch.testing.assert_close(lg, lg_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f, f_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joint.k_cache, apart.k_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joint.v_cache, apart.v_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "arch,fused,attention",
    [("llama_hd16", False, "sdpa"), ("qwen3", False, "live"), ("llama_hd16", True, "live")],
)
def test_packed_rows_equal_each_prompt_alone(arch, fused, attention):
    """Three prompts back to back in one packed group (``Rows.segment``; a padded token continuing the
    last one) give each prompt's last logits row, its features and its cache rows as its own forward
    from position 0 does, in float32: no token sees another prompt's keys."""
    if fused and not use_triton(torch.device("cpu")):
        pytest.skip("the fused layers run on the CPU only under TRITON_INTERPRET=1")
    t = TargetModel(build(arch), layer_ids=[0, 2])
    apart, joint = (StaticTarget(t, 64, attention=attention, page_size=64, num_pages=4, fused=fused) for _ in "ab")
    g = torch.Generator().manual_seed(1)
    lengths = [9, 4, 6]
    prompts = [torch.randint(3, 90, (n,), generator=g) for n in lengths]
    tables = torch.arange(3, dtype=torch.int32)[:, None]  # prompt b on page b
    want = [
        apart.forward(x[None], torch.zeros(1, dtype=torch.long), kv_len=len(x), tables=tables[b : b + 1])
        for b, x in enumerate(prompts)
    ]
    seg = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)] + [2])
    pos = torch.tensor([i for n in lengths for i in range(n)] + [6])
    last = torch.tensor(lengths).cumsum(0) - 1
    ids = torch.cat([*prompts, torch.tensor([5])])[:, None]
    (logits, feats), *_ = joint.forward_rows([Rows(ids, pos, tables[seg], last=last, segment=seg)])
    assert logits.shape == (3, 1, t.config.vocab_size) and feats.shape[:2] == (20, 1)
    for b, (lg_ref, f_ref) in enumerate(want):
        torch.testing.assert_close(logits[b, 0], lg_ref[0, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats[:-1][seg[:-1] == b, 0], f_ref[0], rtol=1e-5, atol=1e-5)
        n = lengths[b]
        for cache in ("k_cache", "v_cache"):
            got, ref = getattr(joint, cache)[:, b, :, :n], getattr(apart, cache)[:, b, :, :n]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,fused,attention", [("llama_hd16", False, "sdpa"), ("llama_hd16", True, "live")])
def test_verify_rows_and_packed_rows_in_one_forward(arch, fused, attention):
    """A verify block and a packed prompt in one ``forward_rows`` (a mixed step) give the logits and
    cache of the two run apart, in float32."""
    if fused and not use_triton(torch.device("cpu")):
        pytest.skip("the fused layers run on the CPU only under TRITON_INTERPRET=1")
    t = TargetModel(build(arch), layer_ids=[0, 2])
    apart, joint = (StaticTarget(t, 64, attention=attention, page_size=64, num_pages=4, fused=fused) for _ in "ab")
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, 90, (2, 10), generator=g)
    tables = torch.arange(3, dtype=torch.int32)[:, None]
    for st in (apart, joint):
        st.forward(prompts, torch.zeros(2, dtype=torch.long), kv_len=10, tables=tables[:2])
    block, chunk = torch.randint(3, 90, (2, 3), generator=g), torch.randint(3, 90, (7,), generator=g)
    verify = Rows(block, torch.full((2,), 10), tables[:2], 13)
    seg = torch.zeros(8, dtype=torch.long)  # 7 tokens and one padding token, page 2
    packed = Rows(
        torch.cat([chunk, chunk[:1]])[:, None], torch.arange(8), tables[seg], last=torch.tensor([6, 0]), segment=seg
    )
    want = [apart.forward_rows([verify])[0], apart.forward_rows([packed])[0]]
    got = joint.forward_rows([verify, packed])
    for (lg, f), (lg_ref, f_ref) in zip(got, want):
        assert lg.shape == lg_ref.shape
        torch.testing.assert_close(lg, lg_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f, f_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joint.k_cache, apart.k_cache, rtol=1e-5, atol=1e-5)
