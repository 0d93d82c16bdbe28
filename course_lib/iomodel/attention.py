"""HBM traffic of attention: standard, FlashAttention v1 and v2, counted and in closed form.

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
Q, K, V, O, S, P cost ``bytes_per_el``. ``flash_v1_io(..., kernel_bookkeeping=True)`` follows
``course_lib.kernels.flash_v1`` instead of the paper: a row block's first step starts from
registers, its last writes the output, and the O carried between steps is an fp32 ``O_acc``.
FLOPs: the course counts 4·N_q·N_k·d for the two matmuls (``reference.attention_flops``) plus
``SOFTMAX_FLOPS_PER_ELEMENT`` per score.
"""
from __future__ import annotations

import math
from collections import defaultdict

from course_lib.reference import block_is_visible

__all__ = [  # FIGURES stays out: course_lib.iomodel star-imports several modules
    "A100_M", "A100_SRAM_BYTES", "FIGURE2_SHAPE", "HBMCounter", "SOFTMAX_FLOPS_PER_ELEMENT",
    "STANDARD_STEPS", "block_is_visible", "compulsory_io", "count_flash_v1", "count_flash_v2",
    "count_standard", "figure2_prediction", "flash_attention_io", "flash_v1_io", "flash_v2_io",
    "paper_block_sizes", "plot_block_size_sweep", "plot_io_vs_M", "plot_io_vs_N",
    "print_figure2_prediction", "standard_attention_io", "standard_attention_steps",
    "visited_blocks",
]

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

def _widths(bytes_per_el: int, stats_bytes: int, state_bytes: int | None = None) -> dict:
    """Bytes per element of each tensor name: m, l, lse and the v1 kernel's O_acc are fp32."""
    return defaultdict(lambda: bytes_per_el, {"m": stats_bytes, "l": stats_bytes,
                                              "lse": stats_bytes, "O_acc": state_bytes or 4})


class HBMCounter:
    """Counts the elements a tiled algorithm loads from and stores to HBM, per tensor name.

    ``read(name, block)`` / ``write(name, block)`` take the block (a tensor, or a number of
    elements); the reference implementations call them at every load and store.
    """

    def __init__(self, bytes_per_el: int = 2, stats_bytes: int = 4):
        self.widths = _widths(bytes_per_el, stats_bytes)
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
        return sum(n * self.widths[name] for name, n in counts.items())

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


def _result(reads: dict, writes: dict, bh: int, widths: dict, flops: float, **extra) -> dict:
    """Element counts per tensor (per head, times ``bh`` heads), their totals and bytes."""
    reads = {k: v * bh for k, v in reads.items() if v}
    writes = {k: v * bh for k, v in writes.items() if v}
    read_bytes = sum(n * widths[k] for k, n in reads.items())
    write_bytes = sum(n * widths[k] for k, n in writes.items())
    return {"reads": reads, "writes": writes,
            "read_elements": sum(reads.values()), "write_elements": sum(writes.values()),
            "elements": sum(reads.values()) + sum(writes.values()),
            "read_bytes": read_bytes, "write_bytes": write_bytes,
            "hbm_bytes": read_bytes + write_bytes, "flops": float(flops), **extra}


def _attention_flops(B, H, N_q, N_k, d) -> float:
    return B * H * N_q * N_k * (4.0 * d + SOFTMAX_FLOPS_PER_ELEMENT)


# ---------------------------------------------------------------------------------------------
# standard attention (Algorithm 0 of the paper: three kernels, 8 HBM operations)
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
    return _result(reads, writes, B * H, _widths(bytes_per_el, 4),
                   _attention_flops(B, H, N_q, N_k, d))


def count_standard(N_q, N_k, d, bytes_per_el=2) -> HBMCounter:
    """Standard attention as three kernels, one head, reporting each tensor it moves."""
    import torch

    hbm = HBMCounter(bytes_per_el)
    q, k, v = (torch.zeros(n, d) for n in (N_q, N_k, N_k))
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


def visited_blocks(N_q, N_k, block_m, block_n, causal=False, skip_masked_blocks=True):
    """The (i, j) block pairs a tiled loop computes: all of them, or, causal with skipping, those
    with at least one visible score. Returns a list of (i, j)."""
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    pairs = []
    for i in range(T_r):
        r0, r1 = i * block_m, min((i + 1) * block_m, N_q)
        for j in range(T_c):
            if causal and skip_masked_blocks and not block_is_visible(r0, r1, j * block_n,
                                                                      N_q, N_k):
                continue
            pairs.append((i, j))
    return pairs


def _visits_per_row_block(N_q, N_k, block_m, block_n, causal, skip_masked_blocks):
    """[(rows in block i, number of K/V blocks computed for it)] for every Q block i."""
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    out = []
    for i in range(T_r):
        r0, r1 = i * block_m, min((i + 1) * block_m, N_q)
        n = T_c
        if causal and skip_masked_blocks:
            n = sum(block_is_visible(r0, r1, j * block_n, N_q, N_k) for j in range(T_c))
        out.append((r1 - r0, n))
    return out


def flash_v1_io(N_q, N_k, d, block_m, block_n, B=1, H=1, bytes_per_el=2, causal=False,
                skip_masked_blocks=False, include_init=True, stats_bytes=4,
                kernel_bookkeeping=False, state_bytes=4) -> dict:
    """FlashAttention v1 (Algorithm 1) traffic for given block sizes.

    K/V outer (each K_j, V_j read once), Q inner: every computed (j, i) pair reads Q_i, O_i, l_i,
    m_i and writes O_i, l_i, m_i back. ``include_init`` counts line 2's fill of O, l, m in HBM
    (a separate fill kernel in practice). Causal with ``skip_masked_blocks`` leaves out pairs
    that see no key. ``kernel_bookkeeping``: count as ``course_lib.kernels.flash_v1`` runs (no
    init; a row block's first step reads no O, l, m and its last writes only the output O; the
    O carried in between is ``O_acc`` of ``state_bytes``).
    """
    per_block = _visits_per_row_block(N_q, N_k, block_m, block_n, causal, skip_masked_blocks)
    visits = sum(r * n for r, n in per_block)       # Q rows loaded, over all (j, i) steps
    reads = {"Q": visits * d, "K": N_k * d, "V": N_k * d}
    if kernel_bookkeeping:
        carried = sum(r * (n - 1) for r, n in per_block if n)  # steps that hand state on
        reads.update({"O_acc": carried * d, "l": carried, "m": carried})
        writes = {"O_acc": carried * d, "l": carried, "m": carried, "O": N_q * d}
    else:
        init = N_q if include_init else 0
        reads.update({"O": visits * d, "l": visits, "m": visits})
        writes = {"O": (init + visits) * d, "l": init + visits, "m": init + visits}
    return _result(reads, writes, B * H, _widths(bytes_per_el, stats_bytes, state_bytes),
                   _attention_flops(B, H, N_q, N_k, d), block_m=block_m, block_n=block_n,
                   T_r=math.ceil(N_q / block_m), T_c=math.ceil(N_k / block_n))


def flash_v2_io(N_q, N_k, d, block_m, block_n, B=1, H=1, bytes_per_el=2, causal=False,
                skip_masked_blocks=True, stats_bytes=4, H_kv=None) -> dict:
    """FlashAttention v2 traffic for given block sizes, plus its floor under ``"compulsory"``.

    Q outer (Q_i read once, O_i and lse_i written once), K/V inner: every computed (i, j) pair
    reads K_j and V_j. ``compulsory`` is the least any exact algorithm moves: Q, K, V read once,
    O and lse written once (K/V counted per K/V head: ``H_kv`` for GQA). On a GPU the re-reads
    of K/V by different Q blocks mostly hit the L2 cache, so DRAM traffic lands near that floor.
    """
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    if causal and skip_masked_blocks:   # keys loaded: the K/V blocks each Q block computes
        key_visits = sum(min(block_n, N_k - j * block_n)
                         for i, j in visited_blocks(N_q, N_k, block_m, block_n, True, True))
    else:
        key_visits = T_r * N_k            # every (i, j) pair: T_r passes over all N_k keys
    reads = {"Q": N_q * d, "K": key_visits * d, "V": key_visits * d}
    writes = {"O": N_q * d, "lse": N_q}
    out = _result(reads, writes, B * H, _widths(bytes_per_el, stats_bytes),
                  _attention_flops(B, H, N_q, N_k, d), block_m=block_m, block_n=block_n,
                  T_r=T_r, T_c=T_c)
    out["compulsory"] = compulsory_io(N_q, N_k, d, B, H, bytes_per_el, stats_bytes, H_kv)
    return out


def compulsory_io(N_q, N_k, d, B=1, H=1, bytes_per_el=2, stats_bytes=4, H_kv=None) -> dict:
    """The floor: Q, K, V read once and O, lse written once (K/V once per K/V head)."""
    h_kv = H if H_kv is None else H_kv
    reads = {"Q": B * H * N_q * d, "K": B * h_kv * N_k * d, "V": B * h_kv * N_k * d}
    writes = {"O": B * H * N_q * d, "lse": B * H * N_q}
    return _result(reads, writes, 1, _widths(bytes_per_el, stats_bytes),
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


# ---------------------------------------------------------------------------------------------
# counted: the tiled loops of course_lib.reference, run on zero-filled CPU tensors (only their
# shapes matter; torch's shape-only "meta" device would be 30x slower for these small blocks)
# ---------------------------------------------------------------------------------------------

def _count(fn, N_q, N_k, d, block_m, block_n, causal, bytes_per_el, stats_bytes, **kw):
    import torch

    hbm = HBMCounter(bytes_per_el, stats_bytes)
    q, k, v = (torch.zeros(1, 1, n, d) for n in (N_q, N_k, N_k))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                # tiny blocks: threads only add contention
    try:
        fn(q, k, v, block_m, block_n, causal=causal, hbm=hbm, **kw)
    finally:
        torch.set_num_threads(threads)
    return hbm


def count_flash_v1(N_q, N_k, d, block_m, block_n, causal=False, skip_masked_blocks=False,
                   bytes_per_el=2, stats_bytes=4) -> HBMCounter:
    """Run ``reference.flash_v1_reference`` on one head, counting its traffic."""
    from course_lib.reference import flash_v1_reference

    return _count(flash_v1_reference, N_q, N_k, d, block_m, block_n, causal, bytes_per_el,
                  stats_bytes, skip_masked_blocks=skip_masked_blocks)


def count_flash_v2(N_q, N_k, d, block_m, block_n, causal=False, skip_masked_blocks=True,
                   bytes_per_el=2, stats_bytes=4) -> HBMCounter:
    """Run ``reference.flash_v2_reference`` on one head, counting its traffic."""
    from course_lib.reference import flash_v2_reference

    return _count(flash_v2_reference, N_q, N_k, d, block_m, block_n, causal, bytes_per_el,
                  stats_bytes, skip_masked_blocks=skip_masked_blocks)


# ---------------------------------------------------------------------------------------------
# predictions for the paper's Figure 2 shape, and the figures of lessons 04 and 06
# ---------------------------------------------------------------------------------------------

A100_M = A100_SRAM_BYTES // 2
"""M in fp16 elements for an A100 SM (98304): the SRAM size Theorem 2 is about."""


def figure2_prediction(M=A100_M, v1_blocks=None, v2_blocks=(128, 64), shape=None) -> dict:
    """Predicted forward HBM bytes at the paper's Figure 2 shape (B 64, H 16, N 1024, d 64, fp16).

    Keys: "standard" (three kernels, S and P through HBM), "flash_v1" (Algorithm 1 with the
    paper's blocks for M, O/l/m initialised in HBM), "flash_v1_kernel" (``v1_blocks`` =
    (BLOCK_M, BLOCK_N) counted as ``kernels.flash_v1`` runs; only if given), "flash_v2"
    (``v2_blocks``, every K/V re-read counted) and "flash_v2_min" (Q, K, V read once, O and lse
    written once: what DRAM counters approach when K/V re-reads hit L2). Values in bytes.
    """
    sh = {**FIGURE2_SHAPE, **(shape or {})}
    B, H, N, d, nb = sh["B"], sh["H"], sh["N"], sh["d"], sh["bytes_per_el"]
    pred = {"standard": sum(s["hbm_bytes"] for s in standard_attention_steps(N, d, B, H, nb)),
            "flash_v1": flash_attention_io(N, d, M, B, H, nb)["hbm_bytes"]}
    if v1_blocks is not None:
        pred["flash_v1_kernel"] = flash_v1_io(N, N, d, *v1_blocks, B, H, nb,
                                              kernel_bookkeeping=True)["hbm_bytes"]
    v2 = flash_v2_io(N, N, d, *v2_blocks, B, H, nb)
    pred["flash_v2"] = v2["hbm_bytes"]
    pred["flash_v2_min"] = v2["compulsory"]["hbm_bytes"]
    return pred


def print_figure2_prediction(pred: dict | None = None) -> None:
    """A table of ``figure2_prediction()`` in GB (10⁹ bytes) and as a fraction of standard."""
    pred = figure2_prediction() if pred is None else pred
    for name, nbytes in pred.items():
        print(f"{name:<16} {nbytes / 1e9:8.3f} GB   {nbytes / pred['standard']:7.1%} of standard")


def _axes(ax, size=(8.4, 5.6)):
    """A new Figure (no pyplot state, so nothing leaks when many are drawn) or ``ax``'s."""
    from matplotlib.figure import Figure

    if ax is None:
        ax = Figure(figsize=size, layout="constrained").subplots()
    return ax.figure, ax


def plot_io_vs_N(d=64, M=A100_M, N_values=tuple(2 ** k for k in range(7, 17)), count_up_to=2048,
                 ax=None):
    """HBM elements (one head) against N: standard 4Nd + 4N² against FlashAttention v1.

    Lines are the closed forms; markers are the tiled loops' own counts (for N <= count_up_to).
    """
    fig, ax = _axes(ax)
    Ns = list(N_values)
    B_r, B_c = paper_block_sizes(M, d)
    std = [standard_attention_io(n, n, d)["elements"] for n in Ns]
    v1 = [flash_v1_io(n, n, d, B_r, B_c)["elements"] for n in Ns]
    floor = [compulsory_io(n, n, d)["elements"] for n in Ns]
    ax.loglog(Ns, std, "-", color="C3", label="standard: 4Nd + 4N²  (Θ(Nd + N²))")
    ax.loglog(Ns, v1, "-", color="C0",
              label=f"FlashAttention v1, M = {M} (B_r={B_r}, B_c={B_c}): Θ(N²d²/M)")
    ax.loglog(Ns, floor, ":", color="gray", label="floor: read Q, K, V, write O once")
    small = [n for n in Ns if n <= count_up_to]
    ax.loglog(small, [count_standard(n, n, d).elements for n in small], "o", color="C3",
              mfc="none", label="counted by the instrumented loops: standard")
    ax.loglog(small, [count_flash_v1(n, n, d, B_r, B_c).elements for n in small], "o",
              color="C0", mfc="none", label="counted by the instrumented loops: v1")
    ax.annotate("", xy=(Ns[-1], v1[-1]), xytext=(Ns[-1], std[-1]),
                arrowprops={"arrowstyle": "<->", "color": "k"})
    ax.text(Ns[-1] / 1.15, math.sqrt(v1[-1] * std[-1]), f"{std[-1] / v1[-1]:.1f}× fewer\n"
            f"≈ M/(3d²)", ha="right", va="center", fontsize=10)
    ax.set(xlabel="sequence length N", ylabel="HBM accesses (elements, one head)",
           title=f"Attention's HBM traffic against N (d = {d})")
    ax.legend(fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    return fig


def plot_io_vs_M(N=1024, d=64, M_values=tuple(2 ** k for k in range(6, 21)), max_steps=5000,
                 ax=None):
    """HBM elements (one head) against the SRAM size M: v1 falls as 1/M, standard stays flat,
    and once one block holds every key (T_c = 1) v1 levels off about 1.5× above the floor.

    Markers: the instrumented v1 loops, where they take at most ``max_steps`` block steps.
    """
    fig, ax = _axes(ax)
    Ms = list(M_values)
    std = standard_attention_io(N, N, d)["elements"]
    v1 = [flash_attention_io(N, d, m)["elements"] for m in Ms]
    ax.loglog(Ms, [std] * len(Ms), "-", color="C3", label="standard: Θ(Nd + N²), no M in it")
    ax.loglog(Ms, v1, "-", color="C0", label="FlashAttention v1, B_c = ⌈M/4d⌉, B_r = min(B_c, d)")
    guide = [12 * N * N * d * d / m for m in Ms]          # leading term: T_c·N·3d, T_c ≈ 4dN/M
    ax.loglog(Ms, guide, "--", color="C0", alpha=0.5, label="12·N²d²/M")
    ax.loglog(Ms, [compulsory_io(N, N, d)["elements"]] * len(Ms), ":", color="gray",
              label="floor: read Q, K, V, write O once")
    counted = [(m, *paper_block_sizes(m, d)) for m in Ms]
    counted = [(m, br, bc) for m, br, bc in counted
               if math.ceil(N / br) * math.ceil(N / bc) <= max_steps]
    ax.loglog([m for m, _, _ in counted],
              [count_flash_v1(N, N, d, br, bc).elements for _, br, bc in counted], "o",
              color="C0", mfc="none", label="counted (instrumented loops)")
    ax.axvspan(d, N * d, color="C0", alpha=0.05)
    ax.axvline(A100_M, color="k", lw=0.8, ls="-.")
    ax.text(A100_M, std * 1.3, " A100 SM\n (192 KiB fp16)", fontsize=10, va="bottom")
    # T_c = 1 (one block holds every key): the curve levels off above the floor, since O, l
    # and m are still initialised in HBM, read back and written again
    last_floor = compulsory_io(N, N, d)["elements"]
    ax.annotate(f"T_c = 1: {v1[-1] / last_floor:.1f}×\nthe floor (O, ℓ, m\nstill go through HBM)",
                (Ms[-1], v1[-1]), xytext=(Ms[-1], v1[-1] * 2.4), ha="right", va="bottom",
                fontsize=10, arrowprops={"arrowstyle": "-", "color": "0.4", "lw": 0.8})
    ax.set(xlabel="SRAM size M (elements)", ylabel="HBM accesses (elements, one head)",
           title=f"HBM traffic against SRAM size (N = {N}, d = {d}); shaded: d ≤ M ≤ Nd")
    ax.set_ylim(top=std * 8, bottom=last_floor / 3)
    ax.legend(fontsize=10, loc="lower left")
    ax.grid(True, which="major", alpha=0.3)
    return fig


def plot_block_size_sweep(block_sizes=(64, 128, 256, 512), shape=None, bandwidth_tbs=1.555,
                          peak_tflops=312.0, ax=None):
    """The trend of the paper's Figure 2 (middle): larger blocks, fewer HBM bytes, until compute
    bounds the runtime. Bars: v1's forward HBM bytes (B_c = block, B_r = min(block, d)); line:
    the roofline's time floor max(bytes / bandwidth, FLOPs / peak), A100 40GB numbers
    (1.555 TB/s, 312 TFLOP/s fp16): a model, not a measurement.
    """
    sh = {**FIGURE2_SHAPE, **(shape or {})}
    B, H, N, d, nb = sh["B"], sh["H"], sh["N"], sh["d"], sh["bytes_per_el"]
    fig, ax = _axes(ax)
    rows = [flash_v1_io(N, N, d, min(bs, d), bs, B, H, nb) for bs in block_sizes]
    gb = [r["hbm_bytes"] / 1e9 for r in rows]
    ms = [1e3 * max(r["hbm_bytes"] / (bandwidth_tbs * 1e12), r["flops"] / (peak_tflops * 1e12))
          for r in rows]
    x = range(len(block_sizes))
    ax.bar(x, gb, color="C0", alpha=0.7, label="HBM accesses (GB)")
    ax.set_xticks(list(x), [str(b) for b in block_sizes])
    ax.set(xlabel="block size B_c", ylabel="HBM accesses (GB)",
           title=f"Block size, forward (B {B}, H {H}, N {N}, d {d}, fp16)")
    ax2 = ax.twinx()
    ax2.plot(list(x), ms, "o-", color="C1", label="modelled runtime floor (ms)")
    ax2.axhline(rows[0]["flops"] / (peak_tflops * 1e12) * 1e3, color="C1", ls=":", lw=0.8,
                label="compute floor: FLOPs / peak")
    ax2.set_ylabel("runtime floor (ms), A100 roofline")
    ax2.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=10)
    return fig


FIGURES = {
    "04_attention_io_vs_N": plot_io_vs_N,
    "06_flash_io_vs_M": plot_io_vs_M,
    "06_block_size_sweep": plot_block_size_sweep,
}
"""The figures this module draws: image stem (images/<stem>.png) -> a function returning it."""
