"""Per-position recurrent states for hybrid (linear-attention) targets.

A verify pass over L tokens must be able to put every recurrent layer back to its state after
any of those positions. transformers' linear-attention kernels return only the final state, so
while a :class:`PositionRecorder` is active the supported kernels are replaced by a recurrent
loop that keeps every state, and the causal-conv input (old conv state + the L new columns) is
kept so that the conv state after any position can be cut from it. Prefill (no initial state)
and every call outside a recording go to the original kernels unchanged.

Supported: KimiLinear's Kimi delta attention (the card's target family). Other hybrids fall
back to snapshot + replay in the adapter.
"""

from __future__ import annotations

import contextvars
import importlib
from dataclasses import dataclass, field

import torch

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("dflash2_position_recorder", default=None)


@dataclass
class PositionRecorder:
    length: int  # L, tokens of the verify pass
    layer: int | None = None  # layer being run (set by a pre-hook)
    states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [L+1, B, H, dk, dv]; [0] = before
    conv_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, C, K+L]

    def __enter__(self):
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)  # FLA's form (+eps, not max)


def kda_states(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel=False):
    """Kimi delta attention one position at a time, in float32.

    query/key ``[B, L, H, dk]``, value ``[B, L, H, dv]``, g ``[B, L, H, dk]`` (log decay per
    channel), beta ``[B, L, H]``, initial_state ``[B, H, dk, dv]``. Returns the outputs
    ``[B, L, H, dv]`` and the states ``[L+1, B, H, dk, dv]`` (index i: after i tokens)."""
    query, key, value, g, beta = (t.float() for t in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    state = initial_state.float()
    states, outs = [state], []
    for i in range(query.shape[1]):
        state = state * g[:, i, :, :, None].exp()  # per-channel decay of the key dim
        recalled = (state * key[:, i, :, :, None]).sum(-2)  # S^T k
        delta = (value[:, i] - recalled) * beta[:, i, :, None]  # delta rule
        state = state + key[:, i, :, :, None] * delta[:, :, None, :]
        outs.append((state * query[:, i, :, :, None]).sum(-2))
        states.append(state)
    return torch.stack(outs, 1), torch.stack(states)


def _kda_kernel(original):
    def kernel(
        query,
        key,
        value,
        g=None,
        beta=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        rec = _ACTIVE.get()
        if rec is None or initial_state is None or rec.layer is None:
            return original(
                query,
                key,
                value,
                g=g,
                beta=beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )
        out, states = kda_states(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
        rec.states[rec.layer] = states
        return out.to(query.dtype), (states[-1] if output_final_state else None)

    kernel._dflash2_original = original
    return kernel


def _conv_kernel(original):
    def kernel(hidden_states, *args, **kwargs):
        rec = _ACTIVE.get()
        if rec is not None and rec.layer is not None:
            rec.conv_inputs[rec.layer] = hidden_states  # [B, C, old + L]: the columns any later state is cut from
        return original(hidden_states, *args, **kwargs)

    kernel._dflash2_original = original
    return kernel


# modeling module -> (linear-attention class, {function name: wrapper factory})
_SUPPORTED = {
    "transformers.models.kimi_linear.modeling_kimi_linear": (
        "KimiLinearDeltaAttention",
        {
            "chunk_kimi_delta_attention": _kda_kernel,
            "recurrent_kimi_delta_attention": _kda_kernel,
            "causal_conv1d_fn": _conv_kernel,
        },
    ),
}


def install(model) -> bool:
    """Route ``model``'s linear-attention kernels through the recorder. Returns False (and changes
    nothing) when the model's recurrent layers are not of a supported kind."""
    spec = _SUPPORTED.get(type(model).__module__)
    if spec is None:
        return False
    cls_name, kernels = spec
    module = importlib.import_module(type(model).__module__)
    for name, factory in kernels.items():
        fn = getattr(module, name)
        if not hasattr(fn, "_dflash2_original"):
            setattr(module, name, factory(fn))
    attn_cls = getattr(module, cls_name)
    for m in model.modules():
        if isinstance(m, attn_cls) and not getattr(m, "_dflash2_hooked", False):
            m.register_forward_pre_hook(_set_layer)
            m._dflash2_hooked = True
    return True


def _set_layer(module, _args):
    rec = _ACTIVE.get()
    if rec is not None:
        rec.layer = module.layer_idx


def rewind(cache, rec: PositionRecorder, keep: int) -> None:
    """Put every recorded layer of ``cache`` at its state after the first ``keep`` tokens."""
    live = {
        i for i, layer in enumerate(cache.layers) if any(getattr(layer, "is_recurrent_states_initialized", {}).values())
    }
    if live - rec.states.keys() or live - rec.conv_inputs.keys():
        raise RuntimeError(
            f"recurrent layers {sorted(live - rec.states.keys())} ran without recording per-position "
            "states (a kernel other than the patched one was used); cannot roll back"
        )
    for idx, states in rec.states.items():
        layer = cache.layers[idx]
        layer.recurrent_states[0].copy_(states[keep].to(layer.recurrent_states[0].dtype))
        conv_in = rec.conv_inputs[idx]
        width = layer.conv_states[0].shape[-1]
        end = conv_in.shape[-1] - rec.length + keep
        layer.conv_states[0].copy_(conv_in[..., :end][..., -width:])
