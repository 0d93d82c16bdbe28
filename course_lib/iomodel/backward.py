"""HBM traffic of the attention *backward* pass, and what recomputing P costs and saves.

Introduced in notebooks/10_backward.ipynb. References: Dao et al. 2022, "FlashAttention",
Appendix B.2 (standard backward, Algorithm 3), B.4 (FlashAttention backward, Algorithm 4) and
Theorem 5: with SRAM of M elements (d <= M <= Nd), standard attention's backward moves
Θ(Nd + N²) elements between HBM and the chip, FlashAttention's Θ(N²d²/M).

As in ``course_lib.iomodel.attention``, every count exists twice: *counted*, by running the
algorithm's loops on real tensors and reporting each block they load or store
(``count_standard_backward``, ``count_flash_backward``), and in *closed form*
(``standard_backward_io``, ``flash_backward_io``); the tests check that they agree.
Counts are elements per (batch, head) times B·H; l, m, lse and delta are fp32 (``stats_bytes``).

* Algorithm 3 (standard, P stored by the forward): dV = PᵀdO; dP = dO Vᵀ (written, N²);
  dS = P ∘ (dP - rowsum(P ∘ dP)) (read P, dP, write dS); dQ = dS K; dK = dSᵀ Q.
  Reads 5·N_q·N_k + 3·N_q·d + 2·N_k·d, writes 2·N_q·N_k + N_q·d + 2·N_k·d.
* Algorithm 4 (FlashAttention): K_j, V_j loaded once; for every (j, i) pair Q_i, O_i, dO_i,
  dQ_i, l_i, m_i are loaded and dQ_i is written back; dK_j, dV_j written once. With the
  paper's B_c = ⌈M/4d⌉ the T_c = ⌈N/B_c⌉ passes over the rows cost ≈ 20·N²d²/M.
* ``flash_v2_backward_io``: the course's Triton kernels (course_lib.kernels.flash_bwd): a
  preprocess pass, a dK/dV kernel that streams Q, dO past each K/V block, a dQ kernel that
  streams K, V past each Q block. dQ is never read back, so nothing is O(T_c·N·d) writes.

``recompute_tradeoff`` puts numbers on FlashAttention's bargain: the backward recomputes
S = QKᵀ and P (2·N_q·N_k·d more FLOPs, +25% over a backward that reads a stored P) and in
return never stores the N_q × N_k matrix P (nor reads it back).
"""
from __future__ import annotations

import math

import torch
from matplotlib.figure import Figure

from course_lib.iomodel.attention import HBMCounter, block_is_visible, paper_block_sizes

__all__ = [
    "BackwardCounter", "standard_backward_io", "count_standard_backward",
    "flash_backward_reference", "flash_backward_io", "count_flash_backward", "theorem5_io",
    "flash_v2_backward_io", "recompute_tradeoff", "forward_statistics", "FIGURES",
]


class BackwardCounter(HBMCounter):
    """``course_lib.iomodel.attention.HBMCounter`` for the backward's loops.

    Same interface (``read(name, block)``, ``write(name, block)``, ``reads``, ``writes``,
    ``elements``, ``hbm_bytes``); the row statistics l, m, lse and delta are ``stats_bytes``
    wide, every other tensor ``bytes_per_el``.
    """

    STATS = ("m", "l", "lse", "delta")

    def __init__(self, bytes_per_el: int = 2, stats_bytes: int = 4):
        super().__init__(bytes_per_el, stats_bytes)
        self.bytes_per_el, self.stats_bytes = bytes_per_el, stats_bytes
        self.widths["delta"] = stats_bytes


def _result(reads: dict, writes: dict, B: int, H: int, bytes_per_el: int, stats_bytes: int,
            flops: float, **extra) -> dict:
    """Per-tensor element counts for all B·H heads, their totals and bytes."""
    bh = B * H
    reads = {k: v * bh for k, v in reads.items() if v}
    writes = {k: v * bh for k, v in writes.items() if v}

    def nbytes(counts):
        return sum(n * (stats_bytes if k in BackwardCounter.STATS else bytes_per_el)
                   for k, n in counts.items())

    return {"reads": reads, "writes": writes,
            "read_elements": sum(reads.values()), "write_elements": sum(writes.values()),
            "elements": sum(reads.values()) + sum(writes.values()),
            "hbm_bytes": nbytes(reads) + nbytes(writes), "flops": float(flops), **extra}


def _backward_flops(B, H, N_q, N_k, d, recompute: bool) -> float:
    """Matmul FLOPs: 4 products of 2·N_q·N_k·d (dV, dP, dQ, dK), a 5th (S = QKᵀ) if recomputed."""
    return B * H * N_q * N_k * d * (10.0 if recompute else 8.0)


# ---------------------------------------------------------------------------------------------
# standard attention backward (Algorithm 3)
# ---------------------------------------------------------------------------------------------
def standard_backward_io(N_q, N_k, d, B=1, H=1, bytes_per_el=2, stats_bytes=4) -> dict:
    """Closed form of Algorithm 3's traffic: Θ(Nd + N²), five N_q × N_k reads and two writes."""
    reads = {"P": 2 * N_q * N_k, "dO": 2 * N_q * d, "V": N_k * d, "dP": N_q * N_k,
             "dS": 2 * N_q * N_k, "K": N_k * d, "Q": N_q * d}
    writes = {"dV": N_k * d, "dP": N_q * N_k, "dS": N_q * N_k, "dQ": N_q * d, "dK": N_k * d}
    return _result(reads, writes, B, H, bytes_per_el, stats_bytes,
                   _backward_flops(B, H, N_q, N_k, d, recompute=False))


def count_standard_backward(N_q, N_k, d, bytes_per_el=2, stats_bytes=4, seed=0):
    """Run Algorithm 3 on one head (random inputs), reporting every tensor it moves.

    Returns (counter, (q, k, v, do), (dq, dk, dv)): the inputs and gradients let the tests
    check it against autograd.
    """
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(n, d, generator=gen, dtype=torch.float64)
                   for n in (N_q, N_k, N_k, N_q))
    p = torch.softmax(q @ k.T * d ** -0.5, dim=-1)  # what the forward stored, (N_q, N_k)
    hbm = BackwardCounter(bytes_per_el, stats_bytes)
    hbm.read("P", p), hbm.read("dO", do)                          # 1: dV = Pᵀ dO
    dv = p.T @ do
    hbm.write("dV", dv)
    hbm.read("dO", do), hbm.read("V", v)                          # 2: dP = dO Vᵀ
    dp = do @ v.T                                                 # (N_q, N_k)
    hbm.write("dP", dp)
    hbm.read("P", p), hbm.read("dP", dp)                          # 3: dS = P ∘ (dP - rowsum)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    hbm.write("dS", ds)
    hbm.read("dS", ds), hbm.read("K", k)                          # 4: dQ = dS K · scale
    dq = ds @ k * d ** -0.5
    hbm.write("dQ", dq)
    hbm.read("dS", ds), hbm.read("Q", q)                          # 5: dK = dSᵀ Q · scale
    dk = ds.T @ q * d ** -0.5
    hbm.write("dK", dk)
    return hbm, (q, k, v, do), (dq, dk, dv)


# ---------------------------------------------------------------------------------------------
# FlashAttention backward (Algorithm 4), counted
# ---------------------------------------------------------------------------------------------
def forward_statistics(q, k, v, causal=False, sm_scale=None):
    """O, and the row statistics m (row max) and l (row sum of e^{S - m}) that Algorithm 1 saves.

    Rows that see no key get m = -inf, l = 0, O = 0.
    """
    from course_lib.reference import attention, causal_mask, expand_kv

    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    kk = expand_kv(k, q.shape[1])
    s = q @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], s.device), float("-inf"))
    m = s.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l = torch.exp(s - m_safe[..., None]).sum(-1)
    return attention(q, k, v, causal=causal, sm_scale=scale), l, m


def flash_backward_reference(q, k, v, o, do, l, m, block_m, block_n, causal=False, sm_scale=None,
                             hbm=None, skip_masked_blocks=False):
    """FlashAttention's backward, Algorithm 4 of Dao et al. 2022 (no dropout), in PyTorch.

    q, o, do (B, H, N_q, d); k, v (B, H, N_k, d); l, m (B, H, N_q) from the forward. The outer
    loop walks K/V blocks j (B_c = ``block_n`` keys), the inner loop Q blocks i (B_r =
    ``block_m`` rows). dQ lives in "HBM" and is read, updated and written back at every (j, i);
    dK_j, dV_j stay on chip until the inner loop ends. Per step, in the paper's line order:

        S_ij = τ Q_i K_jᵀ (masked);  P_ij = diag(l_i)⁻¹ exp(S_ij - m_i);  dV_j += P_ijᵀ dO_i;
        dP_ij = dO_i V_jᵀ;  D_i = rowsum(dO_i ∘ O_i);  dS_ij = P_ij ∘ (dP_ij - D_i);
        dQ_i += τ dS_ij K_j (written to HBM);  dK_j += τ dS_ijᵀ Q_i.

    ``hbm``: a ``BackwardCounter`` told of every load and store. ``skip_masked_blocks``: causal
    only, leave out pairs that no row of Q_i can see. Returns (dq, dk, dv).
    """
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    tau = d ** -0.5 if sm_scale is None else sm_scale
    offset = N_k - N_q
    dq = torch.zeros_like(q)
    if hbm is not None:
        hbm.write("dQ", dq)                                       # line 4: dQ = 0 in HBM
    dk, dv = torch.empty_like(k), torch.empty_like(v)

    def load(name, t):
        if hbm is not None:
            hbm.read(name, t)
        return t.clone()

    for c0 in range(0, N_k, block_n):
        c1 = min(c0 + block_n, N_k)
        K_j, V_j = load("K", k[:, :, c0:c1]), load("V", v[:, :, c0:c1])  # (B, H, B_c, d)
        dK_j, dV_j = torch.zeros_like(K_j), torch.zeros_like(V_j)
        for r0 in range(0, N_q, block_m):
            r1 = min(r0 + block_m, N_q)
            if causal and skip_masked_blocks and not block_is_visible(r0, r1, c0, N_q, N_k):
                continue
            Q_i, O_i = load("Q", q[:, :, r0:r1]), load("O", o[:, :, r0:r1])
            dO_i, dQ_i = load("dO", do[:, :, r0:r1]), load("dQ", dq[:, :, r0:r1])
            l_i, m_i = load("l", l[:, :, r0:r1]), load("m", m[:, :, r0:r1])  # (B, H, B_r)
            S = tau * Q_i @ K_j.transpose(-1, -2)                 # (B, H, B_r, B_c)
            if causal:
                rows = torch.arange(r0, r1)[:, None]
                cols = torch.arange(c0, c1)[None, :]
                S = S.masked_fill(cols > rows + offset, float("-inf"))
            seen = l_i > 0                                        # rows that see some key
            m_safe = torch.where(seen, m_i, torch.zeros_like(m_i))
            l_safe = torch.where(seen, l_i, torch.ones_like(l_i))
            P = torch.exp(S - m_safe[..., None]) / l_safe[..., None]
            dV_j += P.transpose(-1, -2) @ dO_i
            dP = dO_i @ V_j.transpose(-1, -2)
            D_i = (dO_i * O_i).sum(-1)                            # (B, H, B_r)
            dS = P * (dP - D_i[..., None])
            dQ_i = dQ_i + tau * dS @ K_j
            if hbm is not None:
                hbm.write("dQ", dQ_i)
            dq[:, :, r0:r1] = dQ_i
            dK_j += tau * dS.transpose(-1, -2) @ Q_i
        if hbm is not None:
            hbm.write("dK", dK_j), hbm.write("dV", dV_j)
        dk[:, :, c0:c1], dv[:, :, c0:c1] = dK_j, dV_j
    return dq, dk, dv


def count_flash_backward(N_q, N_k, d, block_m, block_n, causal=False, skip_masked_blocks=False,
                         bytes_per_el=2, stats_bytes=4) -> BackwardCounter:
    """Run ``flash_backward_reference`` on one head (shapes are all that matter), counting."""
    hbm = BackwardCounter(bytes_per_el, stats_bytes)
    q, k, v, do = (torch.zeros(1, 1, n, d) for n in (N_q, N_k, N_k, N_q))
    o, l, m = torch.zeros(1, 1, N_q, d), torch.ones(1, 1, N_q), torch.zeros(1, 1, N_q)
    flash_backward_reference(q, k, v, o, do, l, m, block_m, block_n, causal=causal, hbm=hbm,
                             skip_masked_blocks=skip_masked_blocks)
    return hbm


def _row_visits(N_q, N_k, block_m, block_n, causal, skip_masked_blocks) -> int:
    """Σ over the visited (j, i) pairs of the rows in Q block i."""
    T_c = math.ceil(N_k / block_n)
    if not (causal and skip_masked_blocks):
        return T_c * N_q
    total = 0
    for c0 in range(0, N_k, block_n):
        for r0 in range(0, N_q, block_m):
            r1 = min(r0 + block_m, N_q)
            if block_is_visible(r0, r1, c0, N_q, N_k):
                total += r1 - r0
    return total


def flash_backward_io(N_q, N_k, d, block_m, block_n, B=1, H=1, bytes_per_el=2, causal=False,
                      skip_masked_blocks=False, include_init=True, stats_bytes=4) -> dict:
    """Closed form of Algorithm 4's traffic for given block sizes.

    Reads: K, V once (2·N_k·d); per visited (j, i) pair Q_i, O_i, dO_i, dQ_i (4 rows·d) and
    l_i, m_i (2 rows). Writes: dQ_i per pair (rows·d), dK, dV once (2·N_k·d), and, with
    ``include_init``, line 4's zero dQ (N_q·d). Non-causal: rows per pass = N_q, T_c passes.
    """
    visits = _row_visits(N_q, N_k, block_m, block_n, causal, skip_masked_blocks)
    reads = {"K": N_k * d, "V": N_k * d, "Q": visits * d, "O": visits * d, "dO": visits * d,
             "dQ": visits * d, "l": visits, "m": visits}
    writes = {"dQ": (visits + (N_q if include_init else 0)) * d, "dK": N_k * d, "dV": N_k * d}
    return _result(reads, writes, B, H, bytes_per_el, stats_bytes,
                   _backward_flops(B, H, N_q, N_k, d, recompute=True), block_m=block_m,
                   block_n=block_n, T_r=math.ceil(N_q / block_m), T_c=math.ceil(N_k / block_n))


def theorem5_io(N, d, M, B=1, H=1, bytes_per_el=2) -> dict:
    """Theorem 5: Algorithm 4 with the paper's blocks (B_c = ⌈M/4d⌉, B_r = min(B_c, d)) for an
    SRAM of M elements, next to the standard backward and the Θ(N²d²/M) scale.

    Returns the ``flash_backward_io`` dict plus "M", "standard" (Algorithm 3's dict) and
    "n2d2_over_M" (N²d²/M: the ratio elements / n2d2_over_M tends to 20 as N grows).
    """
    block_m, block_n = paper_block_sizes(M, d)
    out = flash_backward_io(N, N, d, block_m, block_n, B, H, bytes_per_el)
    out.update(M=M, standard=standard_backward_io(N, N, d, B, H, bytes_per_el),
               n2d2_over_M=B * H * N * N * d * d / M)
    return out


# ---------------------------------------------------------------------------------------------
# the course's Triton kernels
# ---------------------------------------------------------------------------------------------
def flash_v2_backward_io(N_q, N_k, d, block_m1, block_n1, block_m2, block_n2, B=1, H=1,
                         H_kv=None, causal=False, bytes_per_el=2, stats_bytes=4) -> dict:
    """Traffic of course_lib.kernels.flash_bwd's three kernels (closed form of their loops).

    * preprocess: reads O, dO, lse; writes delta and lse₂ (= lse·log2 e, fp32);
    * dK/dV: K, V once per K/V head; for every key block, the query rows that can see it (all
      N_q, or causal from the first row that sees the block's first key) of every head of the
      GQA group: Q, dO (rows·d) and lse₂, delta (rows); dK, dV written once;
    * dQ: Q, dO, lse₂, delta once; for every Q block, the keys any of its rows sees: K, V;
      dQ written once.

    The loops' masked "diagonal" stage uses narrower blocks but covers the same rows, so the
    count does not depend on ``mask_factor``. Returns the usual dict plus "kernels": one dict of
    reads/writes per kernel, and "compulsory": Q, K, V, O, dO, lse read and dQ, dK, dV written
    once (the floor of any exact backward).
    """
    h_kv = H if H_kv is None else H_kv
    offset = N_k - N_q
    kv_rows = 0  # query rows streamed past all key blocks, per query head
    for c0 in range(0, N_k, block_n1):
        m_lo = min(max(c0 - offset, 0), N_q) if causal else 0
        kv_rows += N_q - m_lo
    q_keys = 0  # keys streamed past all Q blocks
    for r0 in range(0, N_q, block_m2):
        q_keys += min(max(r0 + block_m2 + offset, 0), N_k) if causal else N_k
    per_h = {  # per query head
        "pre": ({"O": N_q * d, "dO": N_q * d, "lse": N_q}, {"delta": N_q, "lse": N_q}),
        "dkdv": ({"Q": kv_rows * d, "dO": kv_rows * d, "lse": kv_rows, "delta": kv_rows}, {}),
        "dq": ({"Q": N_q * d, "dO": N_q * d, "lse": N_q, "delta": N_q,
                "K": q_keys * d, "V": q_keys * d}, {"dQ": N_q * d}),
    }
    per_hkv = {"dkdv": ({"K": N_k * d, "V": N_k * d}, {"dK": N_k * d, "dV": N_k * d})}
    kernels, reads, writes = {}, {}, {}
    for name in ("pre", "dkdv", "dq"):
        r, w = {}, {}
        for counts, mult in ((per_h.get(name), H), (per_hkv.get(name), h_kv)):
            if counts is None:
                continue
            for src, dst in ((counts[0], r), (counts[1], w)):
                for key, n in src.items():
                    dst[key] = dst.get(key, 0) + n * mult * B
        kernels[name] = _result(r, w, 1, 1, bytes_per_el, stats_bytes, 0.0)
        for src, dst in ((r, reads), (w, writes)):
            for key, n in src.items():
                dst[key] = dst.get(key, 0) + n
    comp_r = {"Q": B * H * N_q * d, "O": B * H * N_q * d, "dO": B * H * N_q * d,
              "lse": B * H * N_q, "K": B * h_kv * N_k * d, "V": B * h_kv * N_k * d}
    comp_w = {"dQ": B * H * N_q * d, "dK": B * h_kv * N_k * d, "dV": B * h_kv * N_k * d}
    flops = _backward_flops(B, H, N_q, N_k, d, recompute=True) * (0.5 if causal else 1.0)
    out = _result(reads, writes, 1, 1, bytes_per_el, stats_bytes, flops, kernels=kernels)
    out["compulsory"] = _result(comp_r, comp_w, 1, 1, bytes_per_el, stats_bytes, flops)
    return out


# ---------------------------------------------------------------------------------------------
# the recomputation trade-off
# ---------------------------------------------------------------------------------------------
def recompute_tradeoff(N, d, B=1, H=1, bytes_per_el=2, causal=False, peak_tflops=None,
                       hbm_tbs=None) -> dict:
    """What recomputing P in the backward costs (FLOPs) and saves (memory, HBM traffic).

    * ``flops_stored_p``: backward that reads a stored P: dV, dP, dQ, dK, 8·N²·d per head;
    * ``flops_recompute``: FlashAttention's backward, + S = QKᵀ again: 10·N²·d (= 2.5 × the
      forward's 4·N²·d); ``extra_flops`` the difference, ``extra_fraction`` = 0.25;
      ``extra_exps``: N² exponentials to rebuild P (causal: half of everything);
    * ``bytes_saved``: P (N² per head, ``bytes_per_el``) no longer kept between forward and
      backward, minus the lse kept instead (N per head, fp32);
    * ``traffic_saved_bytes``: P written by the forward and read back by the backward (2·N²).

    With ``peak_tflops`` and ``hbm_tbs`` (a GPU's tensor-core peak and HBM bandwidth) it adds
    the time each side costs at those rates: recomputing wins when 2·N²·d / peak is below
    2·N²·bytes / bandwidth, i.e. for d < peak·bytes / bandwidth (≈ 590 on an H100 SXM).
    """
    half = 0.5 if causal else 1.0
    scores = B * H * N * N * half
    stored = 8.0 * scores * d
    recompute = 10.0 * scores * d
    p_bytes = scores * bytes_per_el
    out = {"N": N, "d": d, "B": B, "H": H, "causal": causal,
           "flops_forward": 4.0 * scores * d, "flops_stored_p": stored,
           "flops_recompute": recompute, "extra_flops": recompute - stored,
           "extra_fraction": (recompute - stored) / stored, "extra_exps": scores,
           "p_bytes": p_bytes, "lse_bytes": B * H * N * 4,
           "bytes_saved": p_bytes - B * H * N * 4, "traffic_saved_bytes": 2 * p_bytes}
    if peak_tflops and hbm_tbs:
        out["extra_compute_s"] = out["extra_flops"] / (peak_tflops * 1e12)
        out["saved_traffic_s"] = out["traffic_saved_bytes"] / (hbm_tbs * 1e12)
        out["break_even_d"] = peak_tflops * 1e12 * bytes_per_el / (hbm_tbs * 1e12)
    return out


# ---------------------------------------------------------------------------------------------
# figure
# ---------------------------------------------------------------------------------------------
def plot_backward_io_vs_N(d=64, M=100_000, seq_lens=(256, 512, 1024, 2048, 4096, 8192, 16384),
                          ax=None):
    """HBM accesses of the backward against N: Algorithm 3 (standard), Algorithm 4 with the
    paper's blocks for SRAM M, and the Θ(N²d²/M) scale (× 20), one head."""
    if ax is None:
        fig = Figure(figsize=(6.4, 4.2), layout="constrained")
        ax = fig.subplots()
    else:
        fig = ax.figure
    rows = [theorem5_io(n, d, M) for n in seq_lens]
    ax.loglog(seq_lens, [r["standard"]["elements"] for r in rows], "s-", color="C3",
              label="standard backward (Alg. 3): Θ(Nd + N²)")
    ax.loglog(seq_lens, [r["elements"] for r in rows], "o-", color="C0",
              label="FlashAttention backward (Alg. 4)")
    ax.loglog(seq_lens, [20 * r["n2d2_over_M"] for r in rows], ":", color="C0",
              label="20·N²d²/M")
    ax.set(xlabel="sequence length N", ylabel="HBM accesses (elements, one head)",
           title=f"Backward HBM traffic (d = {d}, M = {M:,} elements)")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    return fig


FIGURES = {"10_backward_io_vs_N": plot_backward_io_vs_N}
"""The figures this module draws: image stem in images/ -> a function returning the Figure."""
