"""Decoder building blocks shared by the Qwen3-MoE and Qwen3.5-MoE families."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeferry.model.batch import ForwardBatch
from moeferry.model.linear import Linear, Linears
from moeferry.model.spec import ModelSpec
from moeferry.ops.attention import chunk_attention, paged_attention, store_kv, use_chunk_attention
from moeferry.ops.conv import causal_conv1d
from moeferry.ops.gdn import gdn_decode_gated, gdn_gates, gdn_prefill
from moeferry.ops.moe import route_topk
from moeferry.ops.norm import add_rms_norm, gated_rms_norm, rms_norm
from moeferry.ops.rope import qk_norm_rope


def _dev(tensor, host):
    """The batch's device-tensor metadata when built, else its host list."""
    return host if tensor is None else tensor


@dataclass
class StepContext:
    """What every layer of one step needs besides its own weights."""
    batch: ForwardBatch
    cos: torch.Tensor
    sin: torch.Tensor
    kv_pool: object
    state_pool: object


class FullAttention:
    """Standard (Qwen3) or output-gated (Qwen3.5) attention with per-head q/k RMSNorm and rope."""

    def __init__(self, spec: ModelSpec, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, kv_index: int):
        self.spec, self.kv_index = spec, kv_index
        self.qkv, self.o_proj = Linears(q_proj, k_proj, v_proj), o_proj  # one GEMM where the weights stack
        self.q_norm, self.k_norm = q_norm, k_norm

    def __call__(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        s, b = self.spec, ctx.batch
        t, d = x.shape[0], s.head_dim
        q, k, v = self.qkv(x)
        gate = None
        if s.attn_output_gate:
            q, gate = q.view(t, s.num_heads, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(t, s.num_heads * d)
        q, k = qk_norm_rope(q.reshape(t, s.num_heads, d), k.view(t, s.num_kv_heads, d), self.q_norm, self.k_norm,
                            s.rms_norm_eps, s.zero_centered_norm, ctx.cos, ctx.sin)  # one kernel on CUDA
        v = v.view(t, s.num_kv_heads, d)
        k_cache, v_cache = ctx.kv_pool.k[self.kv_index], ctx.kv_pool.v[self.kv_index]
        store_kv(k_cache, v_cache, k, v, b.out_slots)
        if not b.is_decode and use_chunk_attention(q, k, k_cache, b.q_lens):
            out = chunk_attention(q, k, v, k_cache, v_cache, b.cu_seqlens, b.kv_lens, b.page_table, b.page_size,
                                  d ** -0.5)
        else:
            out = paged_attention(q, k_cache, v_cache, _dev(b.cu_seqlens_t, b.cu_seqlens),
                                  _dev(b.kv_lens_t, b.kv_lens), b.page_table, b.page_size, d ** -0.5,
                                  max_q_len=b.max_q_len or None)
        out = out.reshape(t, s.num_heads * d)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class GatedDeltaNet:
    """Qwen3.5 linear attention: conv over q|k|v, gated delta rule, gated RMSNorm, out_proj."""

    def __init__(self, spec: ModelSpec, in_qkv, in_z, in_b, in_a, out_proj, conv_weight, a_log, dt_bias,
                 norm_weight, state_index: int):
        self.spec, self.state_index = spec, state_index
        self.in_qkvz, self.out_proj = Linears(in_qkv, in_z), out_proj  # one GEMM where the weights stack
        self.in_ba = Linears(in_b, in_a)  # the two small gate projections (plain in the NVIDIA checkpoints)
        self.conv_weight, self.a_log, self.dt_bias, self.norm_weight = conv_weight, a_log, dt_bias, norm_weight

    def __call__(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        s, b = self.spec, ctx.batch
        t = x.shape[0]
        hk, hv, dk, dv = s.linear_num_k_heads, s.linear_num_v_heads, s.linear_k_head_dim, s.linear_v_head_dim
        conv_state = ctx.state_pool.conv[self.state_index]
        cu, slots = _dev(b.cu_seqlens_t, b.cu_seqlens), _dev(b.state_slots_t, b.state_slots)
        qkv, z = self.in_qkvz(x)
        mixed = causal_conv1d(qkv, self.conv_weight, conv_state, cu, slots, b.max_q_len or None)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
        state = ctx.state_pool.recurrent[self.state_index]
        gate_b, gate_a = self.in_ba(x)
        if b.is_decode:  # gates fused into the recurrent step
            o = gdn_decode_gated(q, k, v, gate_a, gate_b, self.a_log, self.dt_bias, state, slots)
        else:
            g, beta = gdn_gates(gate_a, gate_b, self.a_log, self.dt_bias)
            o = gdn_prefill(q, k, v, g, beta, state, cu, slots, b.max_q_len or None)
        z = z.reshape(t * hv, dv)
        o = gated_rms_norm(o.reshape(t * hv, dv), z, self.norm_weight, s.rms_norm_eps)
        return self.out_proj(o.reshape(t, hv * dv))


class DenseMLP:
    """SwiGLU MLP (shared expert, or the dense layers of Qwen3-MoE)."""

    def __init__(self, gate_proj: Linear, up_proj: Linear, down_proj: Linear):
        self.gate_up, self.down_proj = Linears(gate_proj, up_proj), down_proj  # one GEMM where the weights stack

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE:
    """Router (fp32 softmax, top-k) + routed experts + optional gated shared expert. With a
    `shared_gate` but no `shared` MLP, the experts' executor holds the shared expert (one more
    slot of its kernel) and is given the gate's logit per token (its kernel takes the sigmoid)."""

    def __init__(self, spec: ModelSpec, router: Linear, experts, shared: DenseMLP | None, shared_gate: Linear | None):
        self.spec, self.experts, self.shared = spec, experts, shared
        self.gates = Linears(router, shared_gate) if shared_gate is not None else Linears(router)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gates.first(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits, *shared_logit = self.gates(x)  # router and shared-expert gate: one GEMM when both are plain
        weights, ids = route_topk(logits, self.spec.top_k, self.spec.norm_topk_prob)
        if shared_logit and self.shared is None:
            return self.experts(x, ids, weights, shared_gate=shared_logit[0])
        if self.shared is not None and getattr(self.experts, "takes_beside", False):  # (it adds the term)
            return self.experts(x, ids, weights, beside=lambda: (torch.sigmoid(shared_logit[0]), self.shared(x)))
        out = self.experts(x, ids, weights)
        if self.shared is not None:  # out + sigmoid(gate) * shared(x), the product and sum in one op
            out = torch.addcmul(out, torch.sigmoid(shared_logit[0]), self.shared(x))
        return out


class DecoderLayer:
    def __init__(self, spec: ModelSpec, mixer, mlp, input_norm: torch.Tensor, post_norm: torch.Tensor):
        self.spec, self.mixer, self.mlp = spec, mixer, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def __call__(self, h: torch.Tensor, pending: torch.Tensor | None, ctx: StepContext) -> tuple:
        """(residual stream, this layer's MLP output): the output is added to the stream by the
        next norm (one fused add + RMSNorm kernel), `pending` being the previous layer's."""
        s = self.spec
        if pending is None:
            x = rms_norm(h, self.input_norm, s.rms_norm_eps, s.zero_centered_norm)
        else:
            x, h = add_rms_norm(pending, h, self.input_norm, s.rms_norm_eps, s.zero_centered_norm)
        x = self.mixer(x, ctx)
        x, h = add_rms_norm(x, h, self.post_norm, s.rms_norm_eps, s.zero_centered_norm)  # h + x, norm(h + x)
        return h, self.mlp(x)
