"""A paged KV cache in Python: block allocator, block tables, sharing with copy-on-write, and a
simulation of how much memory contiguous and paged caches waste.

Introduced in notebooks/13_paged_attention.ipynb. The kernel that reads this layout is
``course_lib.kernels.decode.paged_decode``.

PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023) manages the KV cache the way an operating system manages memory:

* the cache is a pool of fixed-size **blocks** (pages) of ``block_size`` tokens (16 here, as in
  vLLM), each holding K and V for every K/V head: ``k_pages[block, slot, head, :]``;
* a sequence owns a **block table** mapping its logical block ``j`` (tokens
  ``j·block_size … (j+1)·block_size − 1``) to any physical block; blocks are allocated on
  demand, one at a time, as the sequence grows (§4.2);
* sequences may **share** physical blocks — the prompt of ``n`` parallel samples, the common
  prefix of beams — with a **reference count** per block; a write to a shared block first
  copies it (**copy-on-write**, §4.4).

Only a sequence's last block can be partly empty, so paging wastes under one block per
sequence, where a contiguous cache reserves room for the longest possible sequence up front.
``simulate_serving`` measures both on a stated workload (``Workload``); ``sampling_memory``
measures what sharing a prompt across parallel samples saves.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from matplotlib.figure import Figure

from course_lib._device import DEVICE

BLOCK_SIZE = 16


class OutOfBlocks(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks: a free list and a reference count per block.

    >>> a = BlockAllocator(2)
    >>> b = a.allocate(); a.incref(b); a.refcount(b)
    2
    >>> a.decref(b); a.decref(b); a.num_free     # freed when the count reaches 0
    2
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """Take a free block (reference count 1)."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block = self._free.pop()
        self._ref[block] = 1
        return block

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not in [0, {self.num_blocks})")
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is free")

    def refcount(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not in [0, {self.num_blocks})")
        return self._ref[block]

    def incref(self, block: int) -> None:
        self._check(block)
        self._ref[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when none is left."""
        self._check(block)
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free.append(block)


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class PagedKVCache:
    """Block tables of many sequences over one ``BlockAllocator``, with optional K/V storage.

    With ``num_kv_heads`` and ``head_dim`` it also holds the pages
    ``k_pages``, ``v_pages`` (num_blocks, block_size, H_kv, D) that ``paged_decode`` reads.
    Without them it only does the bookkeeping (what the simulations need).
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 dtype=torch.float16, device=None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.seqs: dict[object, _Sequence] = {}
        self.cow_copies = 0
        self.k_pages = self.v_pages = None
        if (num_kv_heads is None) != (head_dim is None):
            raise ValueError("give both num_kv_heads and head_dim, or neither")
        if num_kv_heads is not None:
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            self.k_pages = torch.zeros(shape, dtype=dtype, device=device or DEVICE)
            self.v_pages = torch.zeros(shape, dtype=dtype, device=device or DEVICE)

    # -- sequences ------------------------------------------------------------------------

    def add_sequence(self, seq_id) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} exists already")
        self.seqs[seq_id] = _Sequence()

    def _seq(self, seq_id) -> _Sequence:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r}") from None

    def length(self, seq_id) -> int:
        return self._seq(seq_id).length

    def blocks(self, seq_id) -> list[int]:
        """The sequence's block table (physical block of each logical block)."""
        return list(self._seq(seq_id).blocks)

    def slot(self, seq_id, position: int) -> tuple[int, int]:
        """(physical block, offset in it) of the sequence's token at ``position``."""
        seq = self._seq(seq_id)
        if not 0 <= position < seq.length:
            raise IndexError(f"position {position} is outside sequence {seq_id!r} "
                             f"of length {seq.length}")
        return seq.blocks[position // self.block_size], position % self.block_size

    def fork(self, parent, child) -> None:
        """``child`` starts as a copy of ``parent``, sharing all its blocks (no data copied)."""
        src = self._seq(parent)
        self.add_sequence(child)
        for block in src.blocks:
            self.allocator.incref(block)
        self.seqs[child] = _Sequence(list(src.blocks), src.length)

    def free(self, seq_id) -> None:
        """End a sequence: drop its references; blocks nobody else uses become free."""
        seq = self.seqs.pop(seq_id)
        for block in seq.blocks:
            self.allocator.decref(block)

    def can_append(self, seq_id, n: int = 1) -> bool:
        """Whether ``n`` more tokens fit without running out of blocks."""
        return self.blocks_needed(seq_id, n) <= self.allocator.num_free

    def blocks_needed(self, seq_id, n: int = 1) -> int:
        """New blocks that appending ``n`` tokens takes (a copy-on-write copy counts as one)."""
        seq = self._seq(seq_id)
        bs = self.block_size
        new = math.ceil((seq.length + n) / bs) - math.ceil(seq.length / bs)
        shared_tail = (seq.length % bs != 0 and seq.blocks
                       and self.allocator.refcount(seq.blocks[-1]) > 1)
        return new + (1 if shared_tail else 0)

    def append(self, seq_id, k: torch.Tensor | None = None, v: torch.Tensor | None = None
               ) -> tuple[int, int]:
        """Add one token; returns its (block, offset). ``k``, ``v``: (H_kv, D) when storing.

        A full (or no) last block: allocate a new one. A last block shared with another
        sequence: copy it first (copy-on-write), then write into the private copy.
        """
        seq = self._seq(seq_id)
        offset = seq.length % self.block_size
        if offset == 0:
            seq.blocks.append(self.allocator.allocate())
        else:
            last = seq.blocks[-1]
            if self.allocator.refcount(last) > 1:
                new = self.allocator.allocate()
                if self.k_pages is not None:
                    self.k_pages[new].copy_(self.k_pages[last])
                    self.v_pages[new].copy_(self.v_pages[last])
                self.allocator.decref(last)
                seq.blocks[-1] = new
                self.cow_copies += 1
        block = seq.blocks[-1]
        if self.k_pages is not None:
            if k is None or v is None:
                raise ValueError("this cache stores K/V: append needs k and v of shape (H_kv, D)")
            self.k_pages[block, offset] = k
            self.v_pages[block, offset] = v
        seq.length += 1
        return block, offset

    def extend(self, seq_id, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
               n: int | None = None) -> None:
        """Append several tokens: ``k``, ``v`` (n, H_kv, D), or just a count ``n``."""
        count = n if k is None else k.shape[0]
        for i in range(count):
            self.append(seq_id, None if k is None else k[i], None if v is None else v[i])

    # -- what the kernel needs ------------------------------------------------------------

    def block_table(self, seq_ids, pad: int = -1) -> torch.Tensor:
        """(B, max_blocks) int32 block table of ``seq_ids``; unused entries hold ``pad``."""
        tables = [self._seq(s).blocks for s in seq_ids]
        width = max(1, max(len(t) for t in tables))
        out = torch.full((len(tables), width), pad, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.k_pages.device if self.k_pages is not None else DEVICE
        return out.to(dev)

    def seqlens(self, seq_ids) -> torch.Tensor:
        """(B,) int32 lengths of ``seq_ids``."""
        dev = self.k_pages.device if self.k_pages is not None else DEVICE
        return torch.tensor([self._seq(s).length for s in seq_ids], dtype=torch.int32, device=dev)

    def usage(self) -> dict:
        """Blocks in use, tokens they hold, and the fraction of allocated slots with a token.

        Shared blocks count once: ``tokens`` is the number of distinct (block, slot) pairs used.
        """
        used_slots: dict[int, int] = {}
        for seq in self.seqs.values():
            for j, block in enumerate(seq.blocks):
                filled = min(self.block_size, seq.length - j * self.block_size)
                used_slots[block] = max(used_slots.get(block, 0), filled)
        tokens = sum(used_slots.values())
        allocated = self.allocator.num_used * self.block_size
        return {"blocks": self.allocator.num_used, "tokens": tokens, "allocated_slots": allocated,
                "utilization": tokens / allocated if allocated else 1.0}


# ------------------------------------------------------------------------------------------
# simulations
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """Requests with log-normally distributed prompt and output lengths (all arrive at t = 0).

    The default is *our* stand-in for a chat workload: log-normal lengths whose medians before
    capping are e^5 ≈ 148 prompt tokens and e^5.5 ≈ 245 output tokens, long tails, every
    request capped at ``max_len`` = 2048 tokens (a model's context). It is synthetic (no data
    set is loaded), chosen to be of the same scale as the ShareGPT traces the vLLM paper used.
    """

    n_requests: int = 500
    prompt_log_mean: float = 5.0   # exp(5.0) ≈ 148
    prompt_log_sigma: float = 1.0
    output_log_mean: float = 5.5   # exp(5.5) ≈ 245
    output_log_sigma: float = 0.8
    max_len: int = 2048
    seed: int = 0

    def sample(self) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_lens, output_lens), ints >= 1 with prompt + output <= max_len."""
        rng = np.random.default_rng(self.seed)
        prompt = np.exp(rng.normal(self.prompt_log_mean, self.prompt_log_sigma, self.n_requests))
        output = np.exp(rng.normal(self.output_log_mean, self.output_log_sigma, self.n_requests))
        prompt = np.clip(np.round(prompt), 1, self.max_len - 1).astype(int)
        output = np.clip(np.round(output), 1, self.max_len - prompt).astype(int)
        return prompt, output


POLICIES = ("max_len", "pow2", "oracle", "paged")
"""How much a request gets when it is admitted:

* ``max_len``: a contiguous region of ``max_len`` token slots (the model's context length);
* ``pow2``: contiguous, the next power of two >= prompt + output (an oracle that rounds up);
* ``oracle``: contiguous, exactly prompt + output (known in advance: impossible in practice);
* ``paged``: blocks of ``block_size`` slots, one more each time the sequence fills its last.

The three contiguous ones are the vLLM paper's Orca (Max), Orca (Pow2), Orca (Oracle) (its
Figure 2, and the baselines of §6.1).
"""


class _FirstFit:
    """A contiguous allocator over [0, capacity): free intervals, first fit, merge on free."""

    def __init__(self, capacity: int):
        self.starts = [0]
        self.sizes = [capacity]

    def allocate(self, size: int) -> int | None:
        for i, (start, free) in enumerate(zip(self.starts, self.sizes)):
            if free >= size:
                if free == size:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += size
                    self.sizes[i] -= size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, size)
        if i + 1 < len(self.starts) and start + size == self.starts[i + 1]:  # merge right
            self.sizes[i] += self.sizes.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # merge left
            self.sizes[i - 1] += self.sizes.pop(i)
            self.starts.pop(i)


@dataclass
class ServingResult:
    """What ``simulate_serving`` measured (sums over steps, and their ratios)."""

    policy: str
    steps: int
    token_steps: int        # Σ over steps of tokens held in the cache
    allocated_steps: int    # Σ over steps of slots allocated to running requests
    capacity_steps: int     # Σ over steps of the pool's capacity
    reserved_steps: int     # Σ of slots reserved for tokens a request will still write
    internal_steps: int     # Σ of slots allocated that no token will ever use
    batch_sizes: list = field(default_factory=list)
    preemptions: int = 0
    # the same sums over the *saturated* steps only: those where a request was left waiting
    # because its memory could not be found (the pool is "full"; free space is fragmentation)
    saturated: dict = field(default_factory=lambda: dict(steps=0, tokens=0, reserved=0,
                                                         internal=0, allocated=0, capacity=0))

    @property
    def utilization(self) -> float:
        """Fraction of allocated KV memory that holds a real token (time average)."""
        return self.token_steps / self.allocated_steps

    @property
    def waste(self) -> float:
        return 1.0 - self.utilization

    @property
    def pool_utilization(self) -> float:
        """Fraction of the whole pool holding real tokens (free space counts as waste)."""
        return self.token_steps / self.capacity_steps

    def pool_breakdown(self) -> dict:
        """Fractions of the whole pool while it is full (saturated steps): real tokens, slots
        reserved for later tokens, slots never to be used, and free slots too few or too
        scattered for the next request (external fragmentation)."""
        sat = self.saturated
        cap = sat["capacity"]
        if cap == 0:
            return {}
        out = {k: sat[k] / cap for k in ("tokens", "reserved", "internal")}
        out["free"] = 1.0 - sat["allocated"] / cap
        return out

    @property
    def mean_batch(self) -> float:
        return float(np.mean(self.batch_sizes)) if self.batch_sizes else 0.0


def simulate_serving(policy: str, workload: Workload = Workload(), capacity_tokens: int = 1 << 16,
                     block_size: int = BLOCK_SIZE, watermark: float = 0.01) -> ServingResult:
    """Serve ``workload`` from a KV pool of ``capacity_tokens`` slots with one ``policy``.

    Each step: admit waiting requests in order while their allocation fits (a request that
    does not fit blocks the ones behind it); every running request writes one token (its prompt
    is written when it is admitted); finished requests free their memory. With ``paged``, a
    request that needs a block when none is free preempts the latest admitted request, whose
    blocks are freed and which starts again later (vLLM's recomputation, §4.5); a request is
    admitted only if ``watermark`` (a fraction of the pool) stays free after it, as in vLLM.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    prompts, outputs = workload.sample()
    if policy != "paged" and workload.max_len > capacity_tokens:
        raise ValueError("capacity_tokens must hold at least one max_len request")
    total = prompts + outputs
    if policy == "max_len":
        reserve = np.full_like(total, workload.max_len)
    elif policy == "pow2":
        reserve = np.minimum(2 ** np.ceil(np.log2(total)).astype(int), workload.max_len)
    else:
        reserve = total.copy()

    waiting = list(range(workload.n_requests))  # FCFS queue (front = index 0)
    running: list[int] = []
    length = np.zeros(workload.n_requests, dtype=int)  # tokens written so far
    placement: dict[int, int] = {}
    pool = _FirstFit(capacity_tokens)
    cache = PagedKVCache(capacity_tokens // block_size, block_size) if policy == "paged" else None
    res = ServingResult(policy, 0, 0, 0, 0, 0, 0)

    while waiting or running:
        # admit in order
        while waiting:
            r = waiting[0]
            if cache is not None:
                need = math.ceil((prompts[r] + 1) / block_size)  # the prompt and the next token
                if need + watermark * cache.allocator.num_blocks > cache.allocator.num_free:
                    break
                cache.add_sequence(r)
                cache.extend(r, n=int(prompts[r]))
            else:
                start = pool.allocate(int(reserve[r]))
                if start is None:
                    break
                placement[r] = start
            length[r] = prompts[r]
            running.append(waiting.pop(0))
        if not running:
            raise RuntimeError("a request does not fit in an empty pool: raise capacity_tokens")
        full = bool(waiting)  # someone is waiting for memory
        # one decoding step: every running request writes a token
        for r in list(running):
            if r not in running:  # preempted earlier in this step
                continue
            if cache is not None:
                while not cache.can_append(r):
                    victim = running.pop()  # the latest admitted
                    cache.free(victim)
                    length[victim] = 0
                    waiting.insert(0, victim)
                    res.preemptions += 1
                    if victim == r:
                        break
                if r not in running:
                    continue
                cache.append(r)
            length[r] += 1
        # account for this step
        res.steps += 1
        tokens = int(sum(length[r] for r in running))
        res.token_steps += tokens
        res.capacity_steps += capacity_tokens
        res.batch_sizes.append(len(running))
        if cache is not None:
            allocated = cache.allocator.num_used * block_size
            reserved, internal = 0, allocated - tokens
        else:
            allocated = int(sum(reserve[r] for r in running))
            reserved = int(sum(total[r] - length[r] for r in running))
            internal = int(sum(reserve[r] - total[r] for r in running))
        res.allocated_steps += allocated
        res.reserved_steps += reserved
        res.internal_steps += internal
        if full:
            sat = res.saturated
            sat["steps"] += 1
            sat["capacity"] += capacity_tokens
            for key, val in (("tokens", tokens), ("reserved", reserved), ("internal", internal),
                             ("allocated", allocated)):
                sat[key] += val
        # finish
        for r in list(running):
            if length[r] >= total[r]:
                running.remove(r)
                if cache is not None:
                    cache.free(r)
                else:
                    pool.free(placement.pop(r), int(reserve[r]))
    return res


def sampling_memory(prompt_len: int, output_lens, block_size: int = BLOCK_SIZE) -> dict:
    """Blocks used by ``len(output_lens)`` parallel samples of one prompt, with and without
    sharing the prompt's blocks (copy-on-write for the shared partial last block).

    >>> m = sampling_memory(100, [50, 50, 50, 50])
    >>> m["separate_blocks"], m["shared_blocks"], m["cow_copies"]
    (40, 22, 3)
    """
    n = len(output_lens)
    longest = prompt_len + max(output_lens)
    pool = n * math.ceil(longest / block_size) + 1
    shared = PagedKVCache(pool, block_size)
    shared.add_sequence(0)
    shared.extend(0, n=prompt_len)
    for i in range(1, n):
        shared.fork(0, i)
    for i, out in enumerate(output_lens):
        shared.extend(i, n=int(out))
    separate_blocks = sum(math.ceil((prompt_len + out) / block_size) for out in output_lens)
    used = shared.allocator.num_used
    return {"samples": n, "separate_blocks": separate_blocks, "shared_blocks": used,
            "cow_copies": shared.cow_copies, "saving": 1.0 - used / separate_blocks}


def sampling_saving(workload: Workload = Workload(), n_samples: int = 4,
                    block_size: int = BLOCK_SIZE) -> dict:
    """Memory saved by prompt sharing over a workload: every request draws ``n_samples``
    outputs (lengths: the request's own output length and fresh draws from the workload)."""
    prompts, outputs = workload.sample()
    rng = np.random.default_rng(workload.seed + 1)
    separate = shared = 0
    for p, out in zip(prompts, outputs):
        extra = np.exp(rng.normal(workload.output_log_mean, workload.output_log_sigma,
                                  n_samples - 1))
        outs = [int(out)] + [int(np.clip(round(x), 1, workload.max_len - p)) for x in extra]
        m = sampling_memory(int(p), outs, block_size)
        separate += m["separate_blocks"]
        shared += m["shared_blocks"]
    return {"n_samples": n_samples, "separate_blocks": separate, "shared_blocks": shared,
            "saving": 1.0 - shared / separate}


# ------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------

def waste_figure(workload: Workload = Workload(), capacity_tokens: int = 1 << 16) -> Figure:
    """Where the KV memory goes under each policy (time-averaged over a whole run)."""
    results = [simulate_serving(p, workload, capacity_tokens) for p in POLICIES]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax0, ax1 = fig.subplots(1, 2, width_ratios=[3, 2])
    labels = ["contiguous,\nmax_len", "contiguous,\npow2", "contiguous,\noracle",
              f"paged,\nblock {BLOCK_SIZE}"]
    parts = [("tokens", "token_steps", "tab:green"),
             ("reserved for later tokens", "reserved_steps", "tab:orange"),
             ("never used (over-reservation, last block's slack)", "internal_steps",
              "tab:red")]
    left = np.zeros(len(results))
    for name, attr, color in parts:
        frac = np.array([getattr(r, attr) / r.allocated_steps for r in results])
        ax0.barh(labels, frac * 100, left=left * 100, color=color, label=name)
        left += frac
    for i, r in enumerate(results):
        ax0.text(2, i, f"{r.utilization:.1%} tokens", va="center", color="white",
                 fontweight="bold")
    ax0.invert_yaxis()
    ax0.set(xlabel="% of allocated KV memory", xlim=(0, 100),
            title="What the allocated KV cache holds")
    ax0.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    ax1.bar(labels, [r.mean_batch for r in results],
            color=["tab:gray"] * 3 + ["tab:blue"])
    ax1.set(ylabel="mean requests running per step", title="Batch the same memory holds")
    ax1.tick_params(axis="x", labelsize=10)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"13_kv_cache_waste": waste_figure}


# --------------------------------------------------------------------------------------------
# Paged and contiguous layouts of a cache (tests, benchmarks, lesson 13)
# --------------------------------------------------------------------------------------------

def pages_to_contiguous(k_pages, block_table, cache_seqlens, n_max=None):
    """Gather a paged cache into the contiguous (B, H_kv, N_max, D) layout (zeros past L_b)."""
    num_blocks, block_size, H_kv, D = k_pages.shape
    B = block_table.shape[0]
    lens = cache_seqlens.tolist()
    n_max = max(lens) if n_max is None else n_max
    out = torch.zeros((B, H_kv, max(n_max, 1), D), dtype=k_pages.dtype, device=k_pages.device)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        nb = math.ceil(n / block_size)
        blocks = k_pages[block_table[b, :nb].long()]  # (nb, block_size, H_kv, D)
        out[b, :, :n] = blocks.reshape(nb * block_size, H_kv, D)[:n].transpose(0, 1)
    return out


def contiguous_to_pages(k_cache, cache_seqlens=None, block_size=16, num_blocks=None,
                        generator=None):
    """Scatter a contiguous cache into pages in a random physical order.

    Returns (k_pages, block_table): k_pages (num_blocks, block_size, H_kv, D), block_table
    (B, max_blocks) int32 with every logical block of every sequence on its own physical block
    (a random permutation, so neighbouring logical blocks are far apart in memory). Any dtype,
    FP8 included (scattered as bytes: PyTorch's indexed writes do not take FP8).
    """
    if k_cache.dtype.is_floating_point and k_cache.element_size() == 1:
        pages, table = contiguous_to_pages(k_cache.view(torch.uint8), cache_seqlens, block_size,
                                           num_blocks, generator)
        return pages.view(k_cache.dtype), table
    B, H_kv, N_max, D = k_cache.shape
    max_blocks = math.ceil(N_max / block_size)
    needed = B * max_blocks
    num_blocks = needed if num_blocks is None else num_blocks
    if num_blocks < needed:
        raise ValueError(f"num_blocks={num_blocks} < {needed} blocks needed")
    perm = torch.randperm(num_blocks, generator=generator)[:needed]
    block_table = perm.view(B, max_blocks).to(torch.int32)
    padded = torch.zeros((B, H_kv, max_blocks * block_size, D), dtype=k_cache.dtype,
                         device=k_cache.device)
    padded[:, :, :N_max] = k_cache
    pages = torch.zeros((num_blocks, block_size, H_kv, D), dtype=k_cache.dtype,
                        device=k_cache.device)
    # (B, H_kv, max_blocks, block_size, D) -> (B·max_blocks, block_size, H_kv, D)
    src = padded.view(B, H_kv, max_blocks, block_size, D).permute(0, 2, 3, 1, 4)
    pages[perm.to(k_cache.device)] = src.reshape(needed, block_size, H_kv, D)
    return pages, block_table.to(k_cache.device)
