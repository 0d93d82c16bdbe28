"""HBM traffic of attention: standard attention, FlashAttention v1 and v2, counted and in closed form.

Introduced in notebooks/04_attention_io.ipynb (standard attention), used again in
notebooks/06_flash_v1_algorithm.ipynb (FlashAttention v1 and v2) and by the roofline.

The model is the FlashAttention paper's (Dao et al. 2022, §3.2 and Theorem 2): a tensor that a
kernel moves between HBM and on-chip SRAM is counted once per load and once per store, in
elements; bytes are elements times their width. Every count here exists twice:

* *counted*: ``HBMCounter`` is handed to the tiled loops of ``course_lib.reference`` (the
  ``hbm=`` argument of ``flash_v1_reference`` / ``flash_v2_reference``), which report each block
  they load or store; ``count_standard``, ``count_flash_v1`` and ``count_flash_v2`` run them;
* *closed form*: ``standard_attention_io``, ``flash_v1_io``, ``flash_v2_io`` (plain arithmetic,
  fast for any size). The tests check that the two agree.

Sizes, per (batch, head): N_q query rows, N_k keys, head dim d; blocks of ``block_m`` (B_r)
query rows and ``block_n`` (B_c) keys, T_r = ⌈N_q/B_r⌉, T_c = ⌈N_k/B_c⌉.

* standard (Algorithm 0): read Q, K, write S; read S, write P; read P, V, write O.
  4·N·d + 4·N² elements for N_q = N_k = N: Θ(Nd + N²).
* v1 (Algorithm 1): K_j, V_j loaded once each; for every (j, i) pair, Q_i, O_i, l_i, m_i are
  loaded and O_i, l_i, m_i stored: 2·N_k·d + T_c·N_q·(2d + 2) reads and
  (1 + T_c)·N_q·(d + 2) writes (the 1 is the initialisation of O, l, m in HBM). With the paper's
  B_c = ⌈M/4d⌉ this is Θ(N²d²/M).
* v2: Q_i loaded once per row block; K_j, V_j for every (i, j) pair; O_i and lse_i stored once:
  N_q·d + T_r·2·N_k·d reads, N_q·(d + 1) writes. Its floor (every input read once, every output
  written once) is ``compulsory``: N_q·d + 2·N_k·d reads, N_q·(d + 1) writes.

m, l and lse are fp32 in every implementation: they cost ``stats_bytes`` (4) per element while
Q, K, V, O, S, P cost ``bytes_per_el``. FLOPs: the course counts 4·N_q·N_k·d for the two
matmuls (``course_lib.reference.attention_flops``) plus ``SOFTMAX_FLOPS_PER_ELEMENT`` per score.
"""
from __future__ import annotations

import math
from collections import defaultdict

SOFTMAX_FLOPS_PER_ELEMENT = 5
"""Per score of a safe softmax: max, subtract, exp, sum, divide (FlashAttention's rescaling
adds a few per row and block, not counted)."""

STANDARD_STEPS = ("S = QKᵀ", "P = softmax(S)", "O = PV")

FIGURE2_SHAPE = {"B": 64, "H": 16, "N": 1024, "d": 64, "bytes_per_el": 2}
"""The FlashAttention paper's Figure 2 setting: GPT-2 medium, batch 64, 16 heads, N 1024,
d 64, fp16 (forward pass here)."""

A100_SRAM_BYTES = 192 * 1024
"""On-chip SRAM per SM of an A100 (the paper, §2.1): M = 192 KiB / 2 bytes = 98304 fp16 elements."""


# ---------------------------------------------------------------------------------------------
# counting: the object the tiled loops of course_lib.reference report their loads and stores to
# ---------------------------------------------------------------------------------------------

class HBMCounter:
    """Counts the elements a tiled algorithm loads from and stores to HBM, per tensor name.

    ``read(name, block)`` / ``write(name, block)`` take the block (a tensor, or a number of
    elements); the reference implementations call them at every load and store.
    """

    STATS = ("m", "l", "lse")

    def __init__(self, bytes_per_el: int = 2, stats_bytes: int = 4):
        self.bytes_per_el = bytes_per_el
        self.stats_bytes = stats_bytes
        self.reads: dict[str, int] = defaultdict(int)
        self.writes: dict[str, int] = defaultdict(int)

    @staticmethod
    def _numel(block) -> int:
        return int(block) if isinstance(block, int) else int(block.numel())

    def read(self, name: str, block) -> None:
        self.reads[name] += self._numel(block)

    def write(self, name: str, block) -> None:
        self.writes[name] += self._numel(block)

    def _bytes(self, counts: dict[str, int]) -> int:
        return sum(n * (self.stats_bytes if name in self.STATS else self.bytes_per_el)
                   for name, n in counts.items())

    @property
    def read_elements(self) -> int:
        return sum(self.reads.values())

    @property
    def write_elements(self) -> int:
        return sum(self.writes.values())

    @property
    def elements(self) -> int:
        return self.read_elements + self.write_elements

    @property
    def hbm_bytes(self) -> int:
        return self._bytes(self.reads) + self._bytes(self.writes)

    def snapshot(self) -> dict:
        """A copy of the counts so far (the tile walk shows one per step)."""
        return {"reads": dict(self.reads), "writes": dict(self.writes),
                "elements": self.elements, "hbm_bytes": self.hbm_bytes}

    def __repr__(self) -> str:
        return (f"HBMCounter(reads={dict(self.reads)}, writes={dict(self.writes)}, "
                f"elements={self.elements}, bytes={self.hbm_bytes})")


def _result(reads: dict, writes: dict, B: int, H: int, bytes_per_el: int, stats_bytes: int,
            flops: float, **extra) -> dict:
    """The common result dict: per-tensor element counts for all B·H heads, totals, bytes."""
    bh = B * H
    reads = {k: v * bh for k, v in reads.items() if v}
    writes = {k: v * bh for k, v in writes.items() if v}
    width = {name: stats_bytes if name in HBMCounter.STATS else bytes_per_el
             for name in (*reads, *writes)}
    read_bytes = sum(n * width[k] for k, n in reads.items())
    write_bytes = sum(n * width[k] for k, n in writes.items())
    return {"reads": reads, "writes": writes,
            "read_elements": sum(reads.values()), "write_elements": sum(writes.values()),
            "elements": sum(reads.values()) + sum(writes.values()),
            "read_bytes": read_bytes, "write_bytes": write_bytes,
            "hbm_bytes": read_bytes + write_bytes, "flops": float(flops), **extra}


def _attention_flops(B, H, N_q, N_k, d) -> float:
    return B * H * N_q * N_k * (4.0 * d + SOFTMAX_FLOPS_PER_ELEMENT)


# ---------------------------------------------------------------------------------------------
# standard attention (Algorithm 0 of the paper; the 8 HBM operations of seed 000)
# ---------------------------------------------------------------------------------------------

def standard_attention_steps(N, d, B=1, H=1, bytes_per_el=2, N_k=None) -> list[dict]:
    """The three kernels of standard attention, each with its FLOPs and HBM bytes.

    Returns ``[{"name", "flops", "hbm_bytes", "reads", "writes"}, ...]`` for "S = QKᵀ",
    "P = softmax(S)" and "O = PV" (reads/writes: elements per tensor, all B·H heads). Each kernel
    reads its inputs once and writes its output once (an ideal kernel: a real GEMM may re-read).
    """
    N_q, N_k = N, (N if N_k is None else N_k)
    bh = B * H
    raw = [
        (STANDARD_STEPS[0], {"Q": N_q * d, "K": N_k * d}, {"S": N_q * N_k}, 2.0 * N_q * N_k * d),
        (STANDARD_STEPS[1], {"S": N_q * N_k}, {"P": N_q * N_k},
         float(SOFTMAX_FLOPS_PER_ELEMENT * N_q * N_k)),
        (STANDARD_STEPS[2], {"P": N_q * N_k, "V": N_k * d}, {"O": N_q * d}, 2.0 * N_q * N_k * d),
    ]
    steps = []
    for name, reads, writes, flops in raw:
        reads = {k: v * bh for k, v in reads.items()}
        writes = {k: v * bh for k, v in writes.items()}
        steps.append({"name": name, "flops": flops * bh,
                      "hbm_bytes": (sum(reads.values()) + sum(writes.values())) * bytes_per_el,
                      "reads": reads, "writes": writes})
    return steps


def standard_attention_io(N_q, N_k, d, B=1, H=1, bytes_per_el=2) -> dict:
    """Closed form of standard attention's traffic: 2·N_q·d + 2·N_k·d + 4·N_q·N_k elements."""
    reads = {"Q": N_q * d, "K": N_k * d, "S": N_q * N_k, "P": N_q * N_k, "V": N_k * d}
    writes = {"S": N_q * N_k, "P": N_q * N_k, "O": N_q * d}
    return _result(reads, writes, B, H, bytes_per_el, 4, _attention_flops(B, H, N_q, N_k, d))


def count_standard(N_q, N_k, d, bytes_per_el=2) -> HBMCounter:
    """Standard attention as three kernels, one head, reporting each tensor it moves."""
    import torch

    hbm = HBMCounter(bytes_per_el)
    q, k, v = (torch.empty(n, d, device="meta") for n in (N_q, N_k, N_k))
    hbm.read("Q", q), hbm.read("K", k)
    s = q @ k.T                                             # (N_q, N_k)
    hbm.write("S", s)
    hbm.read("S", s)
    p = torch.softmax(s, dim=-1)                            # (N_q, N_k)
    hbm.write("P", p)
    hbm.read("P", p), hbm.read("V", v)
    hbm.write("O", p @ v)                                   # (N_q, d)
    return hbm


# ---------------------------------------------------------------------------------------------
# FlashAttention: block sizes, visited blocks, closed forms
# ---------------------------------------------------------------------------------------------

def paper_block_sizes(M: int, d: int) -> tuple[int, int]:
    """(B_r, B_c) of Algorithm 1 for an SRAM of M elements: B_c = ⌈M/4d⌉, B_r = min(B_c, d)."""
    if M < d:
        raise ValueError(f"the paper needs d <= M; got M={M}, d={d}")
    block_n = math.ceil(M / (4 * d))
    return min(block_n, d), block_n


def block_is_visible(r0, r1, c0, N_q, N_k) -> bool:
    """Whether any query row in [r0, r1) sees any key at column >= c0 (bottom-right causal)."""
    return c0 <= (r1 - 1) + (N_k - N_q)


def visited_blocks(N_q, N_k, block_m, block_n, causal=False, skip_masked_blocks=True):
    """The (i, j) block pairs a tiled loop computes: all of them, or, causal with skipping, those
    with at least one visible score. Returns a list of (i, j)."""
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    pairs = []
    for i in range(T_r):
        r0, r1 = i * block_m, min((i + 1) * block_m, N_q)
        for j in range(T_c):
            if causal and skip_masked_blocks and not block_is_visible(r0, r1, j * block_n, N_q, N_k):
                continue
            pairs.append((i, j))
    return pairs


def _rows(i, block, n):
    return min((i + 1) * block, n) - i * block


def flash_v1_io(N_q, N_k, d, block_m, block_n, B=1, H=1, bytes_per_el=2, causal=False,
                skip_masked_blocks=False, include_init=True, stats_bytes=4) -> dict:
    """FlashAttention v1 (Algorithm 1) traffic for given block sizes.

    K/V outer (each K_j, V_j read once), Q inner: every computed (j, i) pair reads Q_i, O_i, l_i,
    m_i and writes O_i, l_i, m_i back. ``include_init`` counts line 2's zero-fill of O, l, m in
    HBM (a separate fill kernel in practice: leave it out to compare with the main kernel's
    counters). Causal with ``skip_masked_blocks`` leaves out pairs that see no key.
    """
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    if causal and skip_masked_blocks:
        row_visits = sum(_rows(i, block_m, N_q)
                         for i, _ in visited_blocks(N_q, N_k, block_m, block_n, True, True))
    else:
        row_visits = T_c * N_q            # every (j, i) pair: T_c passes over all N_q rows
    init = N_q if include_init else 0
    reads = {"Q": row_visits * d, "K": N_k * d, "V": N_k * d, "O": row_visits * d,
             "l": row_visits, "m": row_visits}
    writes = {"O": (init + row_visits) * d, "l": init + row_visits, "m": init + row_visits}
    return _result(reads, writes, B, H, bytes_per_el, stats_bytes,
                   _attention_flops(B, H, N_q, N_k, d), block_m=block_m, block_n=block_n,
                   T_r=T_r, T_c=T_c)


def flash_v2_io(N_q, N_k, d, block_m, block_n, B=1, H=1, bytes_per_el=2, causal=False,
                skip_masked_blocks=True, stats_bytes=4, H_kv=None) -> dict:
    """FlashAttention v2 traffic for given block sizes, plus its floor under ``"compulsory"``.

    Q outer (Q_i read once, O_i and lse_i written once), K/V inner: every computed (i, j) pair
    reads K_j and V_j. ``compulsory`` is the least any exact algorithm moves: Q, K, V read once,
    O and lse written once (K/V counted per K/V head: ``H_kv`` for GQA). On a GPU the re-reads
    of K/V by different Q blocks mostly hit the L2 cache, so DRAM traffic lands near that floor.
    """
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    if causal and skip_masked_blocks:
        key_visits = sum(_rows(j, block_n, N_k)
                         for _, j in visited_blocks(N_q, N_k, block_m, block_n, True, True))
    else:
        key_visits = T_r * N_k            # every (i, j) pair: T_r passes over all N_k keys
    reads = {"Q": N_q * d, "K": key_visits * d, "V": key_visits * d}
    writes = {"O": N_q * d, "lse": N_q}
    out = _result(reads, writes, B, H, bytes_per_el, stats_bytes,
                  _attention_flops(B, H, N_q, N_k, d), block_m=block_m, block_n=block_n,
                  T_r=T_r, T_c=T_c)
    out["compulsory"] = compulsory_io(N_q, N_k, d, B, H, bytes_per_el, stats_bytes, H_kv)
    return out


def compulsory_io(N_q, N_k, d, B=1, H=1, bytes_per_el=2, stats_bytes=4, H_kv=None) -> dict:
    """The floor: Q, K, V read once and O, lse written once (K/V once per K/V head)."""
    h_kv = H if H_kv is None else H_kv
    reads = {"Q": B * H * N_q * d, "K": B * h_kv * N_k * d, "V": B * h_kv * N_k * d}
    writes = {"O": B * H * N_q * d, "lse": B * H * N_q}
    return _result(reads, writes, 1, 1, bytes_per_el, stats_bytes,
                   _attention_flops(B, H, N_q, N_k, d))


def flash_attention_io(N, d, M, B=1, H=1, bytes_per_el=2, include_init=True) -> dict:
    """FlashAttention v1 with the paper's block sizes for an SRAM of M elements (Theorem 2).

    Returns the ``flash_v1_io`` dict ("flops", "hbm_bytes", "elements", "reads", "writes",
    "block_m", "block_n", ...) plus "M".
    """
    block_m, block_n = paper_block_sizes(M, d)
    out = flash_v1_io(N, N, d, block_m, block_n, B, H, bytes_per_el, include_init=include_init)
    out["M"] = M
    return out
