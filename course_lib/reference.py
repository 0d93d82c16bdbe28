"""Reference attention in fp32/fp64: the ground truth every kernel of the course is tested against.

Introduced in notebooks/04_attention_io.ipynb; the derivation's steps (2-pass, 1-pass, the
FlashAttention v1 and v2 loop orders) are added in notebooks/05 and 06.

Conventions shared by every implementation in the course:

* ``q`` (B, H, N_q, D); ``k``, ``v`` (B, H_kv, N_k, D) with H a multiple of H_kv (GQA: query
  head ``h`` reads key/value head ``h // (H // H_kv)``).
* ``causal=True`` is *bottom-right* aligned: query ``i`` sees keys ``j <= i + N_k - N_q``
  (FlashAttention >= 2.1, ``torch.nn.attention.bias.causal_lower_right``). With N_q > N_k the
  first rows see no key at all: their output is 0 and their log-sum-exp is -inf.
* Dropout multiplies the *normalised* probabilities P by a keep-mask / (1 - p). The mask comes
  from ``dropout_mask(...)`` with a seed, so every implementation can use the same one.
* ``lse`` is the natural-log log-sum-exp of each row of the scaled scores ``S = sm_scale·QKᵀ``.
"""
from __future__ import annotations

import math

import torch


def block_is_visible(r0, r1, c0, N_q, N_k) -> bool:
    """Whether any query row in [r0, r1) sees any key at column >= c0 (bottom-right causal)."""
    return c0 <= (r1 - 1) + (N_k - N_q)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def expand_kv(k: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat each K/V head for the query heads of its group: (B, H_kv, N, D) -> (B, H, N, D)."""
    h_kv = k.shape[1]
    if n_heads % h_kv:
        raise ValueError(f"q's {n_heads} heads are not a multiple of k/v's {h_kv} heads")
    return k.repeat_interleave(n_heads // h_kv, dim=1)


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """Boolean (N_q, N_k) mask, True where query i may see key j (bottom-right aligned)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def dropout_mask(shape, dropout_p: float, dropout_seed: int, device=None) -> torch.Tensor:
    """The reproducible keep-mask (True = keep) of shape (B, H, N_q, N_k) for a seed.

    Drawn on the CPU with its own generator so the same seed gives the same mask everywhere.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_seed is None:
        raise ValueError(
            "dropout_seed is required when dropout_p > 0 (the mask must be reproducible)")
    gen = torch.Generator(device="cpu").manual_seed(int(dropout_seed))
    keep = torch.rand(tuple(shape), generator=gen) >= dropout_p
    return keep.to(device) if device is not None else keep


def _check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D: (B, H, N, D)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q's {q.shape[1]} heads are not a multiple of k's {k.shape[1]} heads")


def _scaled_scores(q, k, v, sm_scale, dt=None):
    """Checks, then S = sm_scale·QKᵀ (B, H, N_q, N_k) in the compute dtype ``dt`` (None: fp32,
    or fp64 for fp64 input), and V expanded to q's heads in that dtype."""
    _check_qkv(q, k, v)
    dt = _compute_dtype(q) if dt is None else dt
    H, D = q.shape[1], q.shape[3]
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    k, v = expand_kv(k.to(dt), H), expand_kv(v.to(dt), H)
    return torch.matmul(q.to(dt), k.transpose(-1, -2)) * scale, v


def attention(q, k, v, causal=False, sm_scale=None, dropout_p=0.0, dropout_seed=None,
              return_lse=False):
    """Standard attention O = dropout(softmax(sm_scale·QKᵀ + mask))·V in fp32 (fp64 for fp64 input).

    Returns O (B, H, N_q, D) in the compute dtype, and the log-sum-exp (B, H, N_q) if asked.
    """
    s, v = _scaled_scores(q, k, v, sm_scale)  # (B, H, N_q, N_k), v (B, H, N_k, D)
    B, H, N_q, N_k = s.shape
    if causal:
        s = s.masked_fill(~causal_mask(N_q, N_k, s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, N_q); -inf for rows that see no key
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])  # (B, H, N_q, N_k); rows with no key are all 0
    if dropout_p > 0.0:
        keep = dropout_mask((B, H, N_q, N_k), dropout_p, dropout_seed, p.device)
        p = p * keep / (1.0 - dropout_p)
    o = torch.matmul(p, v)  # (B, H, N_q, D)
    return (o, lse) if return_lse else o


def attention_variants(q, k, v, causal=False, sm_scale=None, return_lse=False, compute_dtype=None,
                       **variants):
    """Attention with the variants of open models, in fp32 (fp64 for fp64 input), differentiable
    in q, k, v and ``sinks``: the ground truth of lesson 15 (``course_lib.masks`` has the rules).

    ``variants``: ``flash_attn_v2``'s keywords ``window_size`` (default (-1, -1)), ``softcap``,
    ``alibi_slopes``, ``sinks``, in any float dtype. Scores ``s = sm_scale·qkᵀ``, changed as
    ``masks.variant_scores`` says: with ``softcap`` c > 0, ``s = c·tanh(s / c)`` (Gemma 2); with
    ``alibi_slopes`` (H,) or (B, H), ``s −= slope·|p − j|``. Keys outside ``window_size`` (and
    the causal limit) are masked. ``sinks`` (H,): a logit per head that joins the softmax's
    denominator and carries no value (GPT-OSS): ``o_i = Σ_j e^{s_ij} v_j / (e^{sink} + Σ_j
    e^{s_ij})``, and the lse includes it. A row that sees no key: o = 0, lse = −inf, or the sink.
    Returns O (B, H, N_q, D), and the natural-log lse (B, H, N_q) if asked. ``compute_dtype``:
    every op in that dtype instead (the 2x rule's baseline: ``testing.variants_same_precision``).
    """
    from course_lib import masks

    window = masks.normalize_window(variants.pop("window_size", masks.FULL), causal)
    variant = masks.Variant(window, **variants)
    s, v = _scaled_scores(q, k, v, sm_scale, compute_dtype)  # (B, H, N_q, N_k), v (B, H, N_k, D)
    B, H, N_q, N_k = s.shape
    s = masks.variant_scores(s, variant)
    if window != masks.FULL:
        s = s.masked_fill(~masks.visible(N_q, N_k, window, s.device), float("-inf"))
    if variant.sinks is not None:  # one more "key" per row: its logit, and no value
        sink = variant.sinks.to(s.dtype)[None, :, None, None].expand(B, H, N_q, 1)
        s = torch.cat([s, sink], dim=-1)  # (B, H, N_q, N_k + 1)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, N_q); -inf for rows that see nothing
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])[..., :N_k]  # (B, H, N_q, N_k): the sink's share dropped
    o = torch.matmul(p, v)  # (B, H, N_q, D)
    return (o, lse) if return_lse else o


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     causal=False, sm_scale=None, return_lse=False, **variants):
    """``attention_variants`` over packed sequences (FlashAttention's ``flash_attn_varlen_func``):
    q (total_q, H, D), k and v (total_k, H_kv, D); sequence b is rows ``cu_seqlens_q[b] :
    cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of k and v, each
    aligned bottom-right on its own. Returns O (total_q, H, D), and lse (H, total_q) if asked.
    ``max_seqlen_*`` are accepted for the signature's sake and checked when given."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, cu, bound in (("max_seqlen_q", cq, max_seqlen_q), ("max_seqlen_k", ck, max_seqlen_k)):
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
        if bound is not None and longest > bound:
            raise ValueError(f"{name} = {bound} is shorter than a sequence ({longest})")
    alibi = variants.pop("alibi_slopes", None)
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]  # (1, H, n_q, D)
        kb = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        vb = v[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        slopes = alibi[b] if alibi is not None and alibi.ndim == 2 else alibi
        o, lse = attention_variants(qb, kb, vb, causal, sm_scale, alibi_slopes=slopes,
                                    return_lse=True, **variants)
        outs.append(o[0].transpose(0, 1))  # (n_q, H, D)
        lses.append(lse[0])  # (H, n_q)
    o = torch.cat(outs, dim=0)
    return (o, torch.cat(lses, dim=1)) if return_lse else o


def attention_flops(B, H, N_q, N_k, D, causal=False, mode="fwd") -> float:
    """FLOPs the course counts for attention: forward 4·B·H·N_q·N_k·D (×½ causal), backward 2.5×."""
    flops = 4.0 * B * H * N_q * N_k * D
    if causal:
        flops *= 0.5
    if mode == "bwd":
        flops *= 2.5
    elif mode == "fwd_bwd":
        flops *= 3.5
    elif mode != "fwd":
        raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd_bwd', got {mode!r}")
    return flops


LOG2E = 1.0 / math.log(2.0)


# ---------------------------------------------------------------------------------------------
# The derivation, step by step (notebooks/05_one_pass_attention.ipynb and 06).
#
# Each function below computes exactly what ``attention`` computes, in the way one step of the
# derivation does. The 2-pass and 1-pass versions visit the keys one at a time, as the scalar
# recurrences of the derivation do; they are vectorised over all query rows (B, H, N_q) only so
# that tests stay quick. The FlashAttention references work on blocks and report every block
# they load from or store to "HBM" to an optional counter (``course_lib.iomodel.attention``).
# ---------------------------------------------------------------------------------------------

def _prepare(q, k, v, causal, sm_scale, dropout_p, dropout_seed):
    """Checks, compute dtype, GQA expansion, the causal mask and the dropout keep-scale.

    Returns q, k, v (B, H, N, D) in the compute dtype, sm_scale, ``visible`` (N_q, N_k) or None
    and ``z`` = keep / (1 - p) (B, H, N_q, N_k) or None.
    """
    _check_qkv(q, k, v)
    dt = _compute_dtype(q)
    B, H, N_q, D = q.shape
    N_k = k.shape[2]
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    q, k, v = q.to(dt), expand_kv(k.to(dt), H), expand_kv(v.to(dt), H)
    visible = causal_mask(N_q, N_k, q.device) if causal else None
    z = None
    if dropout_p > 0.0:
        keep = dropout_mask((B, H, N_q, N_k), dropout_p, dropout_seed, q.device)
        z = keep.to(dt) / (1.0 - dropout_p)                   # (B, H, N_q, N_k)
    return q, k, v, scale, visible, z


def _exp_sub(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """exp(x - m), where a running max of -inf (a row that has seen no key yet) gives 0, not NaN.

    x <= m always, so m = -inf means x = -inf too: exp(-inf - 0) = 0.
    """
    return torch.exp(x - torch.where(m == float("-inf"), torch.zeros_like(m), m))


def _safe_inv(l: torch.Tensor) -> torch.Tensor:
    """1 / l, and 0 where l = 0 (a row that sees no key: its output stays 0)."""
    return torch.where(l > 0, 1.0 / l, torch.zeros_like(l))


def _score(q, k, j, scale, visible):
    """x_j = sm_scale·(q · k_j) for every query row, -inf where key j is masked. (B, H, N_q)"""
    x = (q * k[:, :, j, None, :]).sum(-1) * scale
    if visible is not None:
        x = x.masked_fill(~visible[:, j], float("-inf"))
    return x


def attention_2pass(q, k, v, causal=False, sm_scale=None, dropout_p=0.0, dropout_seed=None,
                    return_lse=False):
    """Attention in two passes over the keys (the online softmax, then the output).

    Pass 1 carries the running max m and the normaliser l of each row:
        m_j = max(m_{j-1}, x_j),   l_j = l_{j-1}·e^{m_{j-1} - m_j} + e^{x_j - m_j}.
    Pass 2 recomputes each score and adds its probability times v_j:
        o = Σ_j (e^{x_j - m_N} / l_N)·z_j·v_j      (z_j: the dropout keep-scale, 1 without).
    """
    q, k, v, scale, visible, z = _prepare(q, k, v, causal, sm_scale, dropout_p, dropout_seed)
    B, H, N_q = q.shape[:3]
    N_k = k.shape[2]
    m = torch.full((B, H, N_q), float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros((B, H, N_q), dtype=q.dtype, device=q.device)
    for j in range(N_k):                                      # pass 1: statistics only
        x = _score(q, k, j, scale, visible)                   # (B, H, N_q)
        m_new = torch.maximum(m, x)
        l = l * _exp_sub(m, m_new) + _exp_sub(x, m_new)
        m = m_new
    inv_l = _safe_inv(l)
    o = torch.zeros_like(q)                                   # (B, H, N_q, D)
    for j in range(N_k):                                      # pass 2: the output
        p = _exp_sub(_score(q, k, j, scale, visible), m) * inv_l   # (B, H, N_q): P[:, j]
        if z is not None:
            p = p * z[..., j]
        o = o + p[..., None] * v[:, :, j, None, :]
    lse = m + torch.log(l)                                    # -inf for rows that see no key
    return (o, lse) if return_lse else o


def attention_1pass(q, k, v, causal=False, sm_scale=None, dropout_p=0.0, dropout_seed=None,
                    return_lse=False):
    """Attention in one pass: the output is carried along as the surrogate o′ and rescaled.

    After key j, o′_j is the attention output over keys 0..j alone (normalised by l_j):
        o′_j = o′_{j-1}·(l_{j-1}·e^{m_{j-1} - m_j} / l_j) + (e^{x_j - m_j} / l_j)·z_j·v_j,
    so after the last key o′_N = o. Nothing depends on a statistic of the future.
    """
    q, k, v, scale, visible, z = _prepare(q, k, v, causal, sm_scale, dropout_p, dropout_seed)
    B, H, N_q = q.shape[:3]
    N_k = k.shape[2]
    m = torch.full((B, H, N_q), float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros((B, H, N_q), dtype=q.dtype, device=q.device)
    o = torch.zeros_like(q)                                   # (B, H, N_q, D): o′
    for j in range(N_k):
        x = _score(q, k, j, scale, visible)                   # (B, H, N_q)
        m_new = torch.maximum(m, x)
        alpha, p = _exp_sub(m, m_new), _exp_sub(x, m_new)     # rescale of the old, weight of j
        l_new = l * alpha + p
        inv_l = _safe_inv(l_new)
        if z is not None:
            p = p * z[..., j]
        o = o * (l * alpha * inv_l)[..., None] + (p * inv_l)[..., None] * v[:, :, j, None, :]
        m, l = m_new, l_new
    lse = m + torch.log(l)
    return (o, lse) if return_lse else o


def _load(hbm, name, block):
    """A block read from HBM into SRAM: counted, then copied (SRAM holds its own copy)."""
    if hbm is not None:
        hbm.read(name, block)
    return block.clone()


def _store(hbm, name, dest, block):
    """A block written from SRAM back to HBM (``dest`` is a view into the HBM tensor)."""
    if hbm is not None:
        hbm.write(name, block)
    dest.copy_(block)


def flash_v1_reference(q, k, v, block_m, block_n, causal=False, dropout_p=0.0, dropout_seed=None,
                       sm_scale=None, return_lse=False, hbm=None, trace=None,
                       skip_masked_blocks=False):
    """FlashAttention v1, Algorithm 1 (with Algorithm 2's mask and dropout) of Dao et al. 2022.

    The outer loop walks the K/V blocks j (B_c = ``block_n`` keys), the inner loop the Q blocks
    i (B_r = ``block_m`` rows). O, l and m live in "HBM" tensors: every inner step loads Q_i,
    O_i, l_i, m_i, updates them with the block's scores and stores O_i, l_i, m_i back.
    Per step (i, j), in the paper's line order:

        S_ij = sm_scale·Q_i K_jᵀ, masked to -inf;  m̃ = rowmax(S_ij);  P̃ = exp(S_ij - m̃);
        l̃ = rowsum(P̃);  m_new = max(m_i, m̃);  l_new = e^{m_i - m_new}·l_i + e^{m̃ - m_new}·l̃;
        O_i ← (l_i·e^{m_i - m_new}·O_i + e^{m̃ - m_new}·(P̃ ∘ Z)·V_j) / l_new.

    The normaliser l̃ counts every probability; dropout (Z = keep / (1 - p), the shared
    ``dropout_mask``) touches only the P̃ that multiplies V. ``hbm``: an
    ``iomodel.attention.HBMCounter`` (or anything with read/write) told of every load and store.
    ``trace``: called after every step with a dict: the step (i, j), its rows and cols, and for
    (batch 0, head 0) the block's scores S and its rows' m and l (the tile walk draws them).
    ``skip_masked_blocks``: causal only, leave out blocks that no row of Q_i can see.
    """
    q, k, v, scale, visible, z = _prepare(q, k, v, causal, sm_scale, dropout_p, dropout_seed)
    B, H, N_q = q.shape[:3]
    N_k = k.shape[2]
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    # line 2: O, l, m initialised in HBM
    O = torch.zeros_like(q)                                                   # (B, H, N_q, D)
    l = torch.zeros((B, H, N_q), dtype=q.dtype, device=q.device)              # (B, H, N_q)
    m = torch.full((B, H, N_q), float("-inf"), dtype=q.dtype, device=q.device)
    if hbm is not None:
        hbm.write("O", O), hbm.write("l", l), hbm.write("m", m)
    for j in range(T_c):                                       # line 5: K/V blocks, outer
        c0, c1 = j * block_n, min((j + 1) * block_n, N_k)
        K_j = _load(hbm, "K", k[:, :, c0:c1])                 # (B, H, B_c, D)
        V_j = _load(hbm, "V", v[:, :, c0:c1])                 # (B, H, B_c, D)
        for i in range(T_r):                                   # line 7: Q blocks, inner
            r0, r1 = i * block_m, min((i + 1) * block_m, N_q)
            if causal and skip_masked_blocks and not block_is_visible(r0, r1, c0, N_q, N_k):
                continue
            Q_i = _load(hbm, "Q", q[:, :, r0:r1])             # (B, H, B_r, D)
            O_i = _load(hbm, "O", O[:, :, r0:r1])             # (B, H, B_r, D)
            l_i = _load(hbm, "l", l[:, :, r0:r1])             # (B, H, B_r)
            m_i = _load(hbm, "m", m[:, :, r0:r1])             # (B, H, B_r)
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale        # (B, H, B_r, B_c)
            if visible is not None:
                S_ij = S_ij.masked_fill(~visible[r0:r1, c0:c1], float("-inf"))
            m_tilde = S_ij.amax(dim=-1)                        # (B, H, B_r)
            P_tilde = _exp_sub(S_ij, m_tilde[..., None])       # (B, H, B_r, B_c)
            l_tilde = P_tilde.sum(dim=-1)                      # (B, H, B_r)
            m_new = torch.maximum(m_i, m_tilde)
            alpha, beta = _exp_sub(m_i, m_new), _exp_sub(m_tilde, m_new)
            l_new = alpha * l_i + beta * l_tilde
            if z is not None:                                  # dropout: numerator only
                P_tilde = P_tilde * z[:, :, r0:r1, c0:c1]
            inv_l = _safe_inv(l_new)
            O_i = ((l_i * alpha * inv_l)[..., None] * O_i
                   + (beta * inv_l)[..., None] * (P_tilde @ V_j))  # (B, H, B_r, D)
            _store(hbm, "O", O[:, :, r0:r1], O_i)
            _store(hbm, "l", l[:, :, r0:r1], l_new)
            _store(hbm, "m", m[:, :, r0:r1], m_new)
            if trace is not None:
                trace({"order": "v1", "i": i, "j": j, "rows": (r0, r1), "cols": (c0, c1),
                       "S": S_ij[0, 0], "m": m_new[0, 0], "l": l_new[0, 0],
                       "hbm": hbm.snapshot() if hbm is not None else None})
    lse = m + torch.log(l)                                     # (B, H, N_q)
    return (O, lse) if return_lse else O


def flash_v2_reference(q, k, v, block_m, block_n, causal=False, dropout_p=0.0, dropout_seed=None,
                       sm_scale=None, return_lse=False, hbm=None, trace=None,
                       skip_masked_blocks=True):
    """FlashAttention-2's order (Dao 2023, Algorithm 1): Q blocks outer, K/V blocks inner.

    For each Q block i, the accumulator ``acc``, m_i and l_i stay on chip for the whole row of
    K/V blocks; the old accumulator is only rescaled (acc ← e^{m_old - m_new}·acc + P̃·V_j), the
    division by l_i happens once at the end, and lse_i = m_i + log l_i is saved for the backward
    pass. Q_i is loaded once, O_i and lse_i stored once. Causal blocks that no row sees are
    skipped (``skip_masked_blocks``). ``hbm`` and ``trace`` as in ``flash_v1_reference``.
    """
    q, k, v, scale, visible, z = _prepare(q, k, v, causal, sm_scale, dropout_p, dropout_seed)
    B, H, N_q = q.shape[:3]
    N_k = k.shape[2]
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    O = torch.empty_like(q)                                                   # (B, H, N_q, D)
    lse = torch.empty((B, H, N_q), dtype=q.dtype, device=q.device)            # (B, H, N_q)
    for i in range(T_r):                                       # Q blocks, outer
        r0, r1 = i * block_m, min((i + 1) * block_m, N_q)
        Q_i = _load(hbm, "Q", q[:, :, r0:r1])                 # (B, H, B_r, D)
        acc = torch.zeros_like(Q_i)                            # (B, H, B_r, D): unnormalised O_i
        m_i = torch.full(Q_i.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l_i = torch.zeros(Q_i.shape[:-1], dtype=q.dtype, device=q.device)     # (B, H, B_r)
        for j in range(T_c):                                   # K/V blocks, inner
            c0, c1 = j * block_n, min((j + 1) * block_n, N_k)
            if causal and skip_masked_blocks and not block_is_visible(r0, r1, c0, N_q, N_k):
                continue
            K_j = _load(hbm, "K", k[:, :, c0:c1])             # (B, H, B_c, D)
            V_j = _load(hbm, "V", v[:, :, c0:c1])             # (B, H, B_c, D)
            S_ij = Q_i @ K_j.transpose(-1, -2) * scale        # (B, H, B_r, B_c)
            if visible is not None:
                S_ij = S_ij.masked_fill(~visible[r0:r1, c0:c1], float("-inf"))
            m_new = torch.maximum(m_i, S_ij.amax(dim=-1))      # (B, H, B_r)
            P_tilde = _exp_sub(S_ij, m_new[..., None])         # (B, H, B_r, B_c)
            alpha = _exp_sub(m_i, m_new)                       # rescale of everything so far
            l_i = alpha * l_i + P_tilde.sum(dim=-1)
            if z is not None:
                P_tilde = P_tilde * z[:, :, r0:r1, c0:c1]
            acc = alpha[..., None] * acc + P_tilde @ V_j       # no division inside the loop
            m_i = m_new
            if trace is not None:
                trace({"order": "v2", "i": i, "j": j, "rows": (r0, r1), "cols": (c0, c1),
                       "S": S_ij[0, 0], "m": m_i[0, 0], "l": l_i[0, 0],
                       "hbm": hbm.snapshot() if hbm is not None else None})
        _store(hbm, "O", O[:, :, r0:r1], acc * _safe_inv(l_i)[..., None])  # the one division
        _store(hbm, "lse", lse[:, :, r0:r1], m_i + torch.log(l_i))
    return (O, lse) if return_lse else O


def decode_reference(q, k_cache, v_cache, cache_seqlens=None, sm_scale=None, return_lse=False):
    """The decode reference: ``attention`` per sequence on its first L_b keys, causal
    (bottom-right: the N_q new queries are the last positions). q (B, H, N_q, D), caches
    (B, H_kv, N_max, D), ``cache_seqlens`` (B,) or None (every key)."""
    B, H, N_q, D = q.shape
    lens = [k_cache.shape[2]] * B if cache_seqlens is None else cache_seqlens.tolist()
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, lse = attention(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                           causal=True, sm_scale=sm_scale, return_lse=True)
        outs.append(o)
        lses.append(lse)
    o, lse = torch.cat(outs), torch.cat(lses)
    return (o, lse) if return_lse else o
