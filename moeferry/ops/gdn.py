"""Gated DeltaNet (gated delta rule) over a flat batch with a pooled recurrent state.

Per head h and token t (k, q l2-normalised, q scaled by 1/sqrt(K)):
    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
with S [K, V] in fp32. k-heads are repeated to v-heads (GQA style).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeferry.ops.triton import use_triton


def _host(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, num_v_heads):
    """fp32, l2norm q/k, repeat k-heads to v-heads, scale q."""
    rep = num_v_heads // q.shape[1]
    q = _l2norm(q.float()).repeat_interleave(rep, dim=1)
    k = _l2norm(k.float()).repeat_interleave(rep, dim=1)
    q = q * (q.shape[-1] ** -0.5)
    return q, k, v.float(), g.float(), beta.float()


def _chunk_scan(q, k, v, g, beta, state, chunk: int = 64):
    """One sequence, UT-transform chunked form. q,k [n,H,K], v [n,H,V], g,beta [n,H]; state [H,K,V]."""
    n = q.shape[0]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, n, *]
    g, beta = g.t(), beta.t()  # [H, n]
    out = torch.empty_like(v)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(0)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        c = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        cum = g[:, s:e].cumsum(-1)  # [H, c]
        causal = lower[:c, :c]
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        kb = kc * bc[..., None]
        a = ((kb @ kc.transpose(-1, -2)) * decay).tril(-1)  # strictly lower part of the UT system
        eye = torch.eye(c, device=q.device, dtype=q.dtype)
        t = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
        u = t @ (vc * bc[..., None])  # pseudo values
        w = t @ (kb * cum.exp()[..., None])  # decayed keys reading the old state
        v_new = u - w @ state
        attn = ((qc @ kc.transpose(-1, -2)) * decay)
        out[:, s:e] = (qc * cum.exp()[..., None]) @ state + attn @ v_new
        tail = (cum[:, -1:] - cum).exp()[..., None]  # decay from each token to chunk end
        state = state * cum[:, -1].exp()[:, None, None] + (kc * tail).transpose(-1, -2) @ v_new
    return out.transpose(0, 1), state


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) from the raw projections: g = -exp(A_log) * softplus(a + dt_bias) in fp32,
    beta = sigmoid(b) in b's dtype."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


def gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, max_q_len: int | None = None) -> torch.Tensor:
    """Chunked gated delta rule for sequences of any lengths.

    q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; state_pool [S, Hv, K, V] fp32 (in/out).
    cu_seqlens [B+1], state_slots [B]: host lists or int tensors. Returns o [T, Hv, V] in v's dtype.
    Triton path: chunk 64, UT form (`moeferry.ops.triton.gdn`). Workspace (fp32 W, U, G and the
    chunks' q k^T): T * Hv * (K + V + 65) * 4 bytes (`triton.gdn.prefill_workspace`), made per call.
    """
    if use_triton(v):
        from moeferry.ops.triton import gdn as tg
        return tg.gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, max_q_len)
    return gdn_prefill_ref(q, k, v, g, beta, state_pool, _host(cu_seqlens), _host(state_slots))


def gdn_prefill_ref(q, k, v, g, beta, state_pool, cu_seqlens: list[int], state_slots: list[int]) -> torch.Tensor:
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, v.shape[1])
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    for b, slot in enumerate(state_slots):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        o, new_state = _chunk_scan(qf[s:e], kf[s:e], vf[s:e], gf[s:e], bf[s:e], state_pool[slot].float())
        out[s:e] = o
        state_pool[slot] = new_state.to(state_pool.dtype)
    return out.to(v.dtype)


def gdn_decode_gated(q, k, v, a, b, a_log, dt_bias, state_pool, state_slots) -> torch.Tensor:
    """One recurrent step from the raw gate inputs a, b [B, Hv] (see gdn_gates). On the Triton
    path gates, l2norm, state update and output are one kernel; no workspace."""
    if use_triton(v):
        from moeferry.ops.triton import gdn as tg
        return tg.gdn_decode_gated(q, k, v, a, b, a_log, dt_bias, state_pool, state_slots)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    return gdn_decode(q, k, v, g, beta, state_pool, state_slots)


def gdn_decode(q, k, v, g, beta, state_pool, state_slots) -> torch.Tensor:
    """One recurrent step for B sequences (one token each); same layouts as gdn_prefill with T = B.
    Reference (the Triton decode step takes raw gates: gdn_decode_gated)."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, v.shape[1])
    slots = torch.as_tensor(state_slots, device=state_pool.device, dtype=torch.long)
    state = state_pool[slots].float() * gf.exp()[..., None, None]  # [B, H, K, V]
    mem = (state * kf[..., None]).sum(-2)
    delta = (vf - mem) * bf[..., None]
    state = state + kf[..., None] * delta[..., None, :]
    out = (state * qf[..., None]).sum(-2)
    state_pool[slots] = state.to(state_pool.dtype)
    return out.to(v.dtype)
