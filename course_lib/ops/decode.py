"""Flash-Decoding and PagedAttention as functions to call, as PyTorch operators, and as plan/run.

Introduced in notebooks/12_flash_decoding.ipynb (``flash_decode``, and the section on host
overhead: ``plan_decode``) and notebooks/13_paged_attention.ipynb (``paged_decode``). The
kernels and their launch plan are in ``course_lib.kernels.decode``.

One mechanism serves every call: a ``DecodePlan``, in the manner of FlashInfer's
``plan()``/``run()``. A plan fixes the split count, the launch config and the scratch buffers
for one batch shape. Its first step goes through Triton and binds the launch
(``course_lib._launch.bind``); later steps, while only addresses, the cache's strides and its
length change, are one call into Triton's C launcher per kernel.

* ``plan = plan_decode(q, k_cache, v_cache)``, then ``plan.run(q, k_cache, v_cache,
  cache_seqlens)`` at every step: the checks once, and ``run`` writes into the plan's own
  output, which a CUDA graph can capture.
* ``flash_decode`` and ``paged_decode``: the names and arguments of FlashAttention's
  ``flash_attn_with_kvcache``, with its variants' keywords (lesson 15). A call runs the plan
  kept under its arguments' key (``_plan_key``) and returns a new output; a call with no plan
  yet is checked first, and makes one.
* ``torch.ops.course.flash_decode`` and ``torch.ops.course.paged_decode``: the same as
  ``torch.library`` operators. The functions call them while ``torch.compile`` traces, so a
  compiled decode step keeps the kernels in its graph.

Each takes an 8-bit cache too (int8 or FP8 e4m3, ``course_lib.kvquant``) with its per-token
scales, ``k_scale`` and ``v_scale``, which the kernel applies as it reads the cache, and a token
tree's mask among the new queries, ``tree_mask`` (speculative decoding's verification: Miao et
al., "SpecInfer", ASPLOS 2024, section 4.2, https://arxiv.org/abs/2305.09781), which reaches the
kernel as one int64 of bits per node (``tree_bits``).

``validate`` decides whether the values of the lengths and block ids are read and checked
(each function's docstring says when). The default reads nothing on a GPU, so it makes no
synchronisation; there the kernel clamps a bad value: a wrong answer, never a read outside
the cache.
"""
from __future__ import annotations

import torch
from torch import Tensor

from course_lib._device import DEVICE
from course_lib._launch import hooks_installed, int_classes
from course_lib.kernels import decode as kd
from course_lib.kernels.attention_common import empty_like_is_output, empty_output
from course_lib.masks import NO_WINDOW, Variant, check_variants
from course_lib.ops.library import operator
from course_lib.validate import (
    GPU_DTYPES,
    KV_QUANT_DTYPES,
    check_attention_inputs,
    check_block_table,
    check_int_tensor,
    check_kv_scale,
    check_sm_scale,
    check_tensor,
)

# ---------------------------------------------------------------------------------------------
# checks of the arguments (shapes, dtypes, devices; the values where ``validate`` says)
# ---------------------------------------------------------------------------------------------


def _check_num_splits(num_splits) -> None:
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= kd.MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {kd.MAX_SPLITS}], got {num_splits}")


def _check_config(config, head_dim: int) -> dict | None:
    """``config`` completed from the default for ``head_dim``, or None for the default."""
    if config is None:
        return None
    if not isinstance(config, dict) or not set(config) <= {"BLOCK_N", "num_warps", "num_stages"}:
        raise ValueError("config must be a dict with keys among BLOCK_N, num_warps, num_stages, "
                         f"got {config!r}")
    cfg = kd.pick_config(head_dim)
    cfg.update(config)
    bn = cfg["BLOCK_N"]
    if not isinstance(bn, int) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"config['BLOCK_N'] must be a power of two >= 16, got {bn}")
    return cfg


def _check_cache(q, k, v, lens, table, paged, num_splits, sm_scale, variant_args,
                 kv_scales=None, lens_required=True, tree=None) -> tuple:
    """(sm_scale, ``Variant``, D) of a call on a contiguous cache k, v (B, H_kv, N_max, D), or
    (``paged``) on pages (num_blocks, block_size, H_kv, D) and their ``table``, 8-bit with
    ``kv_scales`` (k_scale, v_scale) or in q's dtype, with a token tree's mask ``tree`` or
    none; TypeError or ValueError naming the argument. A plan is made before any lengths
    exist: it passes ``lens_required=False``."""
    quantized = isinstance(k, torch.Tensor) and k.dtype in KV_QUANT_DTYPES
    if not paged:
        B, _, _, _, _, D = check_attention_inputs(q, k, v, quantized_kv=quantized)
    else:
        check_tensor("q", q, 4)
        for name, t in (("k_pages", k), ("v_pages", v)):
            check_tensor(name, t, 4, KV_QUANT_DTYPES if quantized else GPU_DTYPES)
        B = q.shape[0]
        if k.shape != v.shape:
            raise ValueError(f"k_pages and v_pages must have one shape, got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        _, block_size, H_kv, D = k.shape
        # the shared checks, on a (B, H_kv, block_size, D) view of the pages' shape
        check_attention_inputs(q, *(t[:1].permute(0, 2, 1, 3).expand(B, H_kv, block_size, D)
                                    for t in (k, v)), quantized_kv=quantized)
        check_int_tensor("block_table", table, B, q.device, ndim=2,
                         shape=f"(B={B}, max_blocks)")
        if lens is None and lens_required:
            raise ValueError("cache_seqlens is required for paged_decode (one length per "
                             "sequence)")
    k_name = "k_pages" if paged else "k_cache"
    for name, t in (("q", q), (k_name, k), ("v" + k_name[1:], v)):  # rows of D at unit stride
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), "
                             f"got strides {tuple(t.stride())}")
    _check_scales(k_name, k, v, kv_scales)
    if lens is not None:
        check_int_tensor("cache_seqlens", lens, B, q.device)
    _check_num_splits(num_splits)
    variant = check_variants(q, True, *variant_args)  # causal: the window's right is 0
    tensors = {"alibi_slopes": variant.alibi_slopes, "sinks": variant.sinks}
    variant = variant._replace(**{n: t.contiguous() for n, t in tensors.items() if t is not None})
    _check_tree(tree, q, variant)
    return check_sm_scale(sm_scale, D), variant, D


MAX_TREE_NODES = 64  # a node's row of the tree mask travels as the bits of one int64


def _check_tree(tree_mask, q, variant: Variant) -> None:
    """A token tree's mask (``tree_mask``, or None): bool (N_q, N_q) for the whole batch or
    (B, N_q, N_q), on q's device, N_q <= ``MAX_TREE_NODES``, with no window and no ALiBi (their
    distances assume the queries form a chain); TypeError or ValueError naming it."""
    if tree_mask is None:
        return
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask must be a bool torch.Tensor or None, got "
                        f"{type(tree_mask).__name__}")
    if tree_mask.dtype != torch.bool:
        raise TypeError(f"tree_mask must be bool (True where node i sees node j), got "
                        f"{tree_mask.dtype}")
    B, _, N_q, _ = q.shape
    if tuple(tree_mask.shape) not in ((N_q, N_q), (B, N_q, N_q)):
        raise ValueError(f"tree_mask must be ({N_q}, {N_q}) or ({B}, {N_q}, {N_q}) for q's "
                         f"B = {B} and N_q = {N_q} tree nodes, got {tuple(tree_mask.shape)}")
    if N_q > MAX_TREE_NODES:
        raise ValueError(f"tree_mask: a tree of at most {MAX_TREE_NODES} nodes (a node's row "
                         f"is one int64 of bits), got N_q = {N_q}")
    if tree_mask.device != q.device:
        raise ValueError(f"tree_mask must be on q's device {q.device}, got {tree_mask.device}")
    if variant.window[0] >= 0:
        raise ValueError(f"tree_mask cannot be combined with window_size {variant.window}: a "
                         "sliding window over a token tree is not supported")
    if variant.alibi_slopes is not None:
        raise ValueError("tree_mask cannot be combined with alibi_slopes: ALiBi's distances "
                         "are those of a chain of queries, not of a tree's depths")


def check_tree_values(tree_mask: torch.Tensor) -> None:
    """ValueError unless every node sees itself (the diagonal set) and no node sees one after
    it (nothing above the diagonal: parents come before their children). Reads the mask back
    to the host: on a GPU one synchronisation (what ``validate=True`` adds)."""
    diagonal = tree_mask.diagonal(dim1=-2, dim2=-1)
    if not bool(diagonal.all()):
        i = int((~diagonal).nonzero()[0, -1])
        raise ValueError(f"tree_mask must have its diagonal set (a node sees itself): "
                         f"tree_mask[..., {i}, {i}] is False")
    above = torch.triu(tree_mask, diagonal=1)
    if bool(above.any()):
        i, j = (int(x) for x in above.nonzero()[0, -2:])
        raise ValueError(f"tree_mask[..., {i}, {j}] is True: a node sees only itself and its "
                         "ancestors, which come before it (j <= i)")


def tree_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    """A tree mask (..., N_q, N_q) bool as the kernel's bitmasks (..., N_q) int64: bit j of
    entry i set iff node i sees node j. Computed on the mask's device (nothing read back).

    >>> tree_bits(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)).tolist()
    [1, 3, 5]
    """
    n = tree_mask.shape[-1]
    weights = torch.arange(n, device=tree_mask.device, dtype=torch.int64)
    return (tree_mask.to(torch.int64) << weights).sum(-1)  # (..., N_q); bit 63 makes it < 0


def _check_scales(k_name: str, k, v, kv_scales) -> None:
    """An 8-bit cache's scales (``kv_scales``: (k_scale, v_scale) or None): required with one,
    refused without (``validate.check_kv_scale``)."""
    k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
    check_kv_scale("k_scale", k_scale, k_name, k)
    check_kv_scale("v_scale", v_scale, "v" + k_name[1:], v)


def _scales(k_scale, v_scale):
    """A call's ``kv_scales``: None where it gives neither."""
    return None if k_scale is None and v_scale is None else (k_scale, v_scale)


def _same_scales(a, b) -> bool:
    """Whether two ``kv_scales`` are the same tensors (or both None)."""
    return a is b or (a is not None and b is not None and a[0] is b[0] and a[1] is b[1])


def _sizes(k, table) -> tuple:
    """(num_blocks, page_size, n_max) of a checked cache: its pages', or 1, 1 and its length."""
    if table is None:
        return 1, 1, k.shape[2]
    return k.shape[0], k.shape[1], table.shape[1] * k.shape[1]


def check_cache_seqlens(cache_seqlens, n_max: int) -> None:
    """ValueError if a length lies outside [0, n_max]. Reads the lengths back to the host: on a
    GPU one device→host synchronisation (what ``validate=True`` adds to a call there)."""
    lo, hi = (int(x) for x in torch.aminmax(cache_seqlens))
    if lo < 0 or hi > n_max:
        raise ValueError(f"cache_seqlens must lie in [0, {n_max}] (the cache's N_max), "
                         f"got values in [{lo}, {hi}]")


# Where reading a tensor's values costs nothing: the CPU (the interpreter's tensors are in host
# memory). There ``validate=None`` checks them; on a GPU a read waits for every queued kernel.
_FREE_READS = DEVICE == "cpu"


def _checks_values(validate) -> bool:
    """Whether a call reads its lengths and block ids to check them: ``validate=True`` always,
    None where the read is free (``_FREE_READS``, not while torch.compile traces), False never.
    (Callers test ``validate or _FREE_READS`` first: a GPU's default call does not get here.)"""
    if validate is None:
        return _FREE_READS and not torch.compiler.is_compiling()
    if not validate:
        return False
    if torch.compiler.is_compiling():
        where, instead = "a compiled graph", "outside torch.compile"
    elif kd.capturing():
        where, instead = "a CUDA-graph capture", "before capturing"
    else:
        return True
    raise ValueError(f"validate=True reads cache_seqlens back to the host, which {where} cannot "
                     f"do: validate once {instead}, or leave validate at None or False (the "
                     "kernel clamps lengths and block ids into range)")


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.int32 and t.stride()[-1] == 1 else t.to(torch.int32).contiguous()


def _stream_id(device_index: int) -> int:
    """The current stream of the GPU ``device_index`` (``Tensor.get_device()``; -1: the CPU).
    Buffers reused by two streams at once would race: each stream gets its own plans."""
    if device_index < 0:
        return 0
    return torch._C._cuda_getCurrentRawStream(device_index)


def _capturing(stream: int) -> bool:
    """Whether the current stream, ``stream`` (``_stream_id``), is being captured. CUDA refuses
    to capture the default stream (0), so a call on it asks the driver nothing."""
    return stream != 0 and kd.capturing()


# ---------------------------------------------------------------------------------------------
# the plan: decided once per batch shape, then each step only launches
# ---------------------------------------------------------------------------------------------

class _Bound:
    """A plan's last step, bound (``DecodePlan._launch``): the split kernel's launch
    ``split(*addresses, *geometry, values, *scale_args)``, the merge kernel's (``merges``: none
    or one), and what they were bound for: the cache, its scales (None, or an 8-bit cache's
    (k_scale, v_scale)) and the variant, the cache's length and ``geometry`` (the arguments
    after the addresses), the scales' strides, what the compiled kernel depends on (the
    integers' classes, q's strides, the block table's row stride, whether there are lengths,
    a tree's bitmasks' row stride or None), the (out, lse) addresses. Slots: read at every
    step, faster than a NamedTuple's fields."""

    __slots__ = ("k", "v", "scales", "variant", "values", "n_max", "geometry", "scale_geometry",
                 "classes", "q_stride", "table_stride", "no_lens", "tree_stride", "split",
                 "merges", "outs")

    def __init__(self, *fields):
        for name, value in zip(self.__slots__, fields, strict=True):
            setattr(self, name, value)


class DecodePlan:
    """A decode step planned once per batch shape; ``run`` then only launches the kernels.

    Made by ``plan_decode``. It holds the split count (``num_splits``), the launch config, the
    splits' scratch buffers and the output ``out`` (B, H, N_q, D) with its ``lse``. Each ``run``
    overwrites ``out`` and ``lse``, as FlashInfer's ``run`` does: copy a result you want to
    keep. Every pointer it launches with is yours or the plan's, so a ``run`` can be captured
    in a CUDA graph and replayed.
    """

    def __init__(self, split: kd.SplitPlan, q, sm_scale: float, variant: Variant, kv_dtype):
        self.plan, self.sm_scale, self.num_splits = split, sm_scale, split.num_splits
        self.paged, self.dtype, self.device = split.paged, q.dtype, q.device
        self.kv_dtype = kv_dtype  # q's, or an 8-bit cache's (then every run takes its scales)
        self._variant = variant  # (its tensors: the plan's, or the last call's)
        self._device_index = q.get_device()
        self.out = self.lse = self._shapes = self._outs = None  # (``_outs``: their addresses)
        self.out_like = False  # whether torch.empty_like(q) is O's layout (``_run``)
        self.tree_shape = None  # the shape of a planned token tree's mask (``plan_decode``)
        self._bound: _Bound | None = None  # the launches of the last step

    def _launch(self, q, k, v, lens, table, out, lse, n_max, variant, stream,
                kv_scales=None, bits=None) -> None:
        """One step into ``out``, ``lse`` on ``stream`` (``kv_scales``: an 8-bit cache's
        (k_scale, v_scale); ``bits``: a token tree's bitmasks, ``tree_bits``, (N_q,) or
        (B, N_q)). The last step's bound launches are repeated when only addresses,
        the strides of the cache (and of its scales) and its length changed within the
        specialization classes the compiled kernel depends on (16-byte aligned addresses, each
        integer's class), with q's strides and variant, no profiler hooks and no CUDA-graph
        capture; a bound merge kernel only for the same ``out`` and ``lse``."""
        b = self._bound
        p, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        op, sp = (self._outs if out is self.out and lse is self.lse else
                  (out.data_ptr(), lse.data_ptr()))  # (a plan's own buffers: known addresses)
        lp = p if lens is None else lens.data_ptr()
        tp = p if table is None else table.data_ptr()
        table_stride = None if table is None else table.stride(0)
        if (b is not None and b.k is k and b.v is v and b.n_max == n_max
                and _same_scales(b.scales, kv_scales)):  # the same cache: as computed then
            geometry, scale_geometry, classes = b.geometry, b.scale_geometry, b.classes
        else:
            geometry = (*kd.cache_geometry(self.paged, k, v), n_max)
            scale_geometry = () if kv_scales is None else kd.cache_geometry(self.paged,
                                                                             *kv_scales)
            classes = int_classes((*geometry, *scale_geometry))
        scale_args, sa = (), 0
        if kv_scales is not None:  # an 8-bit cache: its scales' addresses and strides, too
            ksp, vsp = kv_scales[0].data_ptr(), kv_scales[1].data_ptr()
            scale_args, sa = (ksp, vsp, *scale_geometry), ksp | vsp
        elif bits is not None:  # a tree without scales: what the launch gave in their place
            scale_args = (p, p, 0, 0, 0, 0, 0, 0)
        tree_stride = None
        if bits is not None:  # a token tree: its bitmasks' address, after the scales'
            tree_stride, bp = bits.stride(0) if bits.dim() == 2 else 0, bits.data_ptr()
            scale_args, sa = (*scale_args, bp), sa | bp
        if b is not None and b.variant is variant:
            values, aligned = b.values, True
        else:  # (a plan's variants differ from call to call in their tensors only)
            values, aligned = kd.variant_addresses(variant)
        if (b is not None and aligned and classes == b.classes and q.stride() == b.q_stride
                and table_stride == b.table_stride and (lens is None) is b.no_lens
                and (kv_scales is None) is (b.scales is None) and tree_stride == b.tree_stride
                and (not b.merges or b.outs == (op, sp))
                and not (p | kp | vp | lp | tp | op | sp | sa) & 15
                and not hooks_installed() and not _capturing(stream)):
            b.split(p, kp, vp, lp, tp, op, sp, *geometry, values, *scale_args)
            for merge in b.merges:
                merge()
            return
        bind = not _capturing(stream)
        launches = kd.run_plan(self.plan, q, k, v, lens, table, self.sm_scale, out, lse,
                               bind=bind, n_max=n_max, variant=variant, kv_scales=kv_scales,
                               tree_bits=bits)
        self._bound = (None if not bind or launches is None else
                       _Bound(k, v, kv_scales, variant, values, n_max, geometry, scale_geometry,
                              classes, q.stride(), table_stride, lens is None, tree_stride,
                              launches[0], tuple(launches[1:]), (op, sp)))

    def run(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None, return_lse=False,
            *, validate=None, k_scale=None, v_scale=None, tree_mask=None):
        """One decode step into the plan's buffers: returns ``self.out`` (and ``self.lse``).

        ``cache_seqlens`` (B,) int32 (None: every sequence uses all N_max keys); paged plans
        need ``block_table`` (B, max_blocks) as planned and ``cache_seqlens``, int32 and
        contiguous (``run`` converts nothing). A plan of an 8-bit cache needs ``k_scale`` and
        ``v_scale`` at every step, as ``flash_decode`` does (checked where they are not the
        last step's). A plan of a token tree needs its ``tree_mask`` (bool, the planned shape,
        on q's device) at every step, and a plan without one refuses it.

        ``validate`` as in ``flash_decode`` and ``paged_decode``: None (the default) checks the
        lengths and block table where that is free, on the CPU, at every step (their kind,
        dtype and shape, then every length within the plan's N_max and every block id in use
        within the pool: a ValueError or TypeError naming the argument); on a GPU a step does
        nothing more than launch. True checks on every device (on a GPU one synchronisation;
        refused in a CUDA-graph capture), False never: the kernel then clamps what is out of
        range, as the functions' docstrings say."""
        q_shape, kv_shape, _ = self._shapes
        b = self._bound  # (the caches of the last step, if these are they, had their shapes)
        if (q.shape != q_shape or q.dtype != self.dtype
                or not (b is not None and b.k is k_cache and b.v is v_cache)
                and (k_cache.shape != kv_shape or v_cache.shape != kv_shape
                     or k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype)):
            raise ValueError(f"this plan is for q {q_shape} of {self.dtype} and caches "
                             f"{kv_shape} of {self.kv_dtype}, got q {tuple(q.shape)} {q.dtype} "
                             f"and k_cache {tuple(k_cache.shape)} {k_cache.dtype}: make a new "
                             "plan")
        kv_scales = _scales(k_scale, v_scale)
        if ((kv_scales is not None or self.kv_dtype in KV_QUANT_DTYPES)
                and not (b is not None and b.scales is not None and b.k is k_cache
                         and b.v is v_cache and _same_scales(b.scales, kv_scales))):
            _check_scales("k_pages" if self.paged else "k_cache", k_cache, v_cache, kv_scales)
        if self.paged and (block_table is None or cache_seqlens is None):
            raise ValueError("a paged plan's run needs block_table and cache_seqlens")
        if tree_mask is not None or self.tree_shape is not None:
            self._check_planned_tree(tree_mask)
        if (validate or _FREE_READS) and _checks_values(validate):
            self._check_values(cache_seqlens, block_table)
            if tree_mask is not None:
                check_tree_values(tree_mask)
        self._launch(q, k_cache, v_cache, cache_seqlens, block_table, self.out, self.lse,
                     self.plan.n_max, self._variant, _stream_id(self._device_index), kv_scales,
                     None if tree_mask is None else tree_bits(tree_mask))
        return (self.out, self.lse) if return_lse else self.out

    def _check_planned_tree(self, tree_mask) -> None:
        """ValueError unless ``tree_mask`` is what the plan was made for: a bool mask of the
        planned shape on its device, or None for a plan without a tree."""
        if (self.tree_shape is None or not isinstance(tree_mask, torch.Tensor)
                or tuple(tree_mask.shape) != self.tree_shape or tree_mask.dtype != torch.bool
                or tree_mask.device != self.device):
            planned = ("no tree_mask" if self.tree_shape is None else
                       f"a bool tree_mask {self.tree_shape} on {self.device}")
            got = (type(tree_mask).__name__ if not isinstance(tree_mask, torch.Tensor) else
                   f"{tuple(tree_mask.shape)} {tree_mask.dtype} on {tree_mask.device}")
            raise ValueError(f"this plan is for {planned}, got tree_mask {got}: make a new plan")

    def _check_values(self, cache_seqlens, block_table) -> None:
        """``run``'s checks of the lengths and the block table (``validate``): what the launch
        takes as it is (int32, unit stride, the planned shapes), then the values."""
        plan, table_shape = self.plan, self._shapes[2]
        if cache_seqlens is not None:
            check_int_tensor("cache_seqlens", cache_seqlens, plan.B, self.device)
            _refuse_conversion("cache_seqlens", cache_seqlens)
            if not self.paged:
                check_cache_seqlens(cache_seqlens, plan.n_max)
        if not self.paged:
            return
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor of int32, got "
                            f"{type(block_table).__name__}")
        if tuple(block_table.shape) != table_shape or block_table.device != self.device:
            raise ValueError(f"this plan's block_table is {table_shape} on {self.device}, "
                             f"got {tuple(block_table.shape)} on {block_table.device}")
        _refuse_conversion("block_table", block_table)
        check_block_table(block_table, cache_seqlens, plan.num_blocks, plan.page_size,
                          plan.n_max)


def _refuse_conversion(name: str, t: torch.Tensor) -> None:
    """TypeError unless ``t`` is what a plan's run launches with as it is (int32, unit stride)."""
    if t.dtype != torch.int32 or t.stride(-1) != 1:
        raise TypeError(f"{name} must be int32 with unit stride in a plan's run (it converts "
                        f"nothing), got {t.dtype} with strides {tuple(t.stride())}")


def plan_decode(q, k_cache, v_cache, *, block_table=None, num_splits=None, sm_scale=None,
                config=None, merge="auto", window_size=NO_WINDOW, softcap=0.0,
                alibi_slopes=None, sinks=None, k_scale=None, v_scale=None,
                tree_mask=None) -> DecodePlan:
    """Plan decode steps shaped like these tensors (see ``DecodePlan``).

    The arguments are those of ``flash_decode`` (or, with ``block_table``, of ``paged_decode``,
    k_cache and v_cache then being the pages); only their shapes, dtypes and device are used.
    ``config``: a launch config, dict(BLOCK_N, num_warps, num_stages), instead of the
    kernel's choice (tuning). ``merge`` ("auto", "fused" or "kernel"): how the splits are merged
    (``course_lib.kernels.decode.MERGES``). The variants (``flash_decode``'s keywords) are fixed
    by the plan: a window sets the split count for the keys it reads, and the plan holds the
    ALiBi slopes and sinks it was given (contiguous ones as they are, read at every step; a
    strided one is copied once), so layers that differ in them need plans of their own. An 8-bit
    cache is planned with its scales (``k_scale``, ``v_scale``, checked as ``flash_decode``
    checks them), and every ``run`` takes them; so with a token tree's ``tree_mask``: the plan
    fixes its shape, and every ``run`` takes a mask of that shape (its values may change).

        plan = plan_decode(q, k_cache, v_cache)        # once per batch shape
        for step in range(n_steps):                      # then every step: only launches
            o = plan.run(q, k_cache, v_cache, cache_seqlens)

    (On the CPU each ``run`` also checks the lengths' values, and a paged plan's block ids:
    ``DecodePlan.run``'s ``validate``.)
    """
    sm_scale, variant, D = _check_cache(q, k_cache, v_cache, None, block_table,
                                        block_table is not None, num_splits, sm_scale,
                                        (window_size, softcap, alibi_slopes, sinks),
                                        _scales(k_scale, v_scale), False, tree_mask)
    plan = _plan(None, q, k_cache, block_table, num_splits, sm_scale, variant, merge=merge,
                 config=_check_config(config, D))
    plan.tree_shape = None if tree_mask is None else tuple(tree_mask.shape)
    plan.out = empty_output(q)
    plan.lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    plan._outs = (plan.out.data_ptr(), plan.lse.data_ptr())
    plan._shapes = (tuple(q.shape), tuple(k_cache.shape),
                    None if block_table is None else tuple(block_table.shape))
    return plan


# ---------------------------------------------------------------------------------------------
# the plans the functions keep: one per batch shape, a new output per call
# ---------------------------------------------------------------------------------------------

_PLANS: dict = {}  # the functions' plans, by ``_plan_key``, oldest first
_MAX_PLANS = 32


def forget_plans() -> None:
    """Drop the plans the functions keep (their scratch buffers with them)."""
    _PLANS.clear()


def _length_bucket(n: int) -> int:
    """``n`` rounded up to a multiple of an eighth of the largest power of two not above it
    (at least 64): 2049 and 2304 share 2304, so a cache that grows one token per step changes
    plans every few hundred steps, not every step, and a plan is at most 1/8 longer."""
    step = max(64, (1 << (max(n, 1).bit_length() - 1)) // 8)
    return -(-n // step) * step


def _plan_key(q, k, v, lens, table, sm_scale, num_splits, variant_args,
              operator=False, kv_scales=None, tree=None) -> tuple:
    """The key of the plan a call runs: everything the checks and the plan depend on, read off
    the arguments as given, so that a call whose key has a plan passes the checks that made it.
    The stream first (buffers are per stream; ``_run`` takes it from here), then the tensors'
    layouts (a contiguous cache's length by its ``_length_bucket``), the scale, and the other
    options with their types (True equals 1 but is no count), None where all are defaults;
    then an 8-bit cache's scales (``kv_scales``): their dtypes, devices and whether their shape
    is the cache's without D (their strides, as the cache's, are the launch's to take); last a
    token tree's mask (``tree``, or its bits in an operator's call): shape, dtype, device.
    TypeError, AttributeError or IndexError for what is no tensor, pair or dict: the checks
    then name it."""
    ks, dev = k.shape, q.get_device()
    window_size, softcap, alibi_slopes, sinks = variant_args
    if (num_splits is None and window_size is NO_WINDOW
            and type(softcap) is float and not softcap and alibi_slopes is None and sinks is None):
        options = None
    else:
        options = (type(num_splits), num_splits,
                   None if window_size is NO_WINDOW else tuple((type(w), w) for w in window_size),
                   type(softcap), softcap,
                   tuple(None if t is None else (t.shape, t.dtype, t.get_device())
                         for t in (alibi_slopes, sinks)))
    return (_stream_id(dev), q.shape, q.stride(), q.dtype, dev, len(ks), ks[0], ks[1], ks[3],
            ks[2] if table is not None else _length_bucket(ks[2]), ks == v.shape,
            k.stride()[-1], v.stride()[-1], k.dtype, v.dtype, k.get_device(), v.get_device(),
            None if lens is None else (lens.shape, lens.dtype, lens.get_device()),
            None if table is None else (table.shape, table.dtype, table.get_device()),
            type(sm_scale), sm_scale, options, operator,
            None if kv_scales is None else tuple((t.dtype, t.get_device(), t.shape == ks[:3])
                                                 for t in kv_scales),
            None if tree is None else (tree.shape, tree.dtype, tree.get_device()))


def _plan(key, q, k, table, num_splits, sm_scale, variant, operator=False, merge="auto",
          config=None) -> DecodePlan:
    """A new plan for checked arguments, kept under ``key`` (None: not kept; a kept plan of a
    contiguous cache serves the lengths of its ``_length_bucket``). ``operator``: a plan of the
    operators, whose buffers must be the call's own (under torch.compile's CUDA graphs every
    allocation belongs to the graph's memory pool): it is kept only where it holds no buffer
    (one split)."""
    (B, H, N_q, D), (num_blocks, page_size, n_max) = q.shape, _sizes(k, table)
    split = kd.make_plan(B, H, k.shape[1 if table is None else 2], N_q, D,
                         n_max if key is None or table is not None else _length_bucket(n_max),
                         q.device, num_splits=num_splits, config=config, paged=table is not None,
                         page_size=page_size, num_blocks=num_blocks, merge=merge,
                         window=variant.window, kv_bytes=k.element_size())
    plan = DecodePlan(split, q, sm_scale, variant, k.dtype)
    plan.out_like = empty_like_is_output(q)  # (the key holds q's strides)
    if key is not None and (not operator or split.num_splits == 1):
        _PLANS[key] = plan
        if len(_PLANS) > _MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]
    return plan


def _run(plan, q, k, v, lens, table, n_max, alibi_slopes, sinks, return_lse, stream,
         kv_scales=None, bits=None):
    """(o, lse) of one call by ``plan`` on ``stream`` (``_stream_id``): o new, and lse new
    unless it is not returned (then a buffer of the plan). ``n_max``: the cache's true length
    (the plan's may be longer); ``kv_scales``: an 8-bit cache's (k_scale, v_scale); ``bits``:
    a token tree's bitmasks (``tree_bits``)."""
    out = torch.empty_like(q) if plan.out_like else empty_output(q)
    if return_lse or plan.lse is None:
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        if not return_lse:
            plan.lse = lse  # the scratch lse of the calls that do not return it
    else:
        lse = plan.lse
    variant = plan._variant
    if alibi_slopes is not variant.alibi_slopes or sinks is not variant.sinks:  # the call's own
        variant = plan._variant = variant._replace(
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.contiguous(),
            sinks=None if sinks is None else sinks.contiguous())
    plan._launch(q, k, v, lens, table, out, lse, n_max, variant, stream, kv_scales, bits)
    return out, lse


# ---------------------------------------------------------------------------------------------
# the functions
# ---------------------------------------------------------------------------------------------

def flash_decode(q, k_cache, v_cache, cache_seqlens=None, num_splits=None, *, sm_scale=None,
                 return_lse=False, validate=None, window_size=NO_WINDOW, softcap=0.0,
                 alibi_slopes=None, sinks=None, k_scale=None, v_scale=None, tree_mask=None):
    """Flash-Decoding: attention of a few query tokens to a KV cache, split over the keys.

    q (B, H, N_q, D); k_cache, v_cache (B, H_kv, N_max, D) with H a multiple of H_kv (GQA);
    cache_seqlens (B,) int32: sequence b uses its first L_b keys (None: all N_max). With
    N_q > 1 the queries are causal among themselves, bottom-right aligned: query i sees keys
    j <= L_b − N_q + i. Returns o (B, H, N_q, D) in q's dtype, and with ``return_lse`` also the
    natural-log log-sum-exp (B, H, N_q) fp32 (−inf for a row that sees no key; its o is 0).

    The variants, as FlashAttention's (lesson 15; ``course_lib.masks``), query i sitting at key
    position p = L_b − N_q + i: ``window_size=(left, right)`` lets it see keys p − left <= j
    (−1: unbounded), and the splits then read only those keys (about left + N_q per sequence,
    not L_b); the decode is causal, so ``right`` is 0 whatever is given (FlashAttention's
    ``causal=True``). ``softcap`` c > 0: scores s = c·tanh(s / c), s taken after ``sm_scale``.
    ``alibi_slopes`` (H,) or (B, H) fp32: s −= slope·|p − j|. ``sinks`` (H,) fp32: a logit per
    head in the softmax's denominator with no value, o = Σ e^s v / (e^sink + Σ e^s); the lse
    includes it, and a row that sees no key gets o = 0 and lse = sink.

    num_splits: key splits per sequence (None: chosen from the SM count and the work).

    An 8-bit cache: k_cache and v_cache int8 or torch.float8_e4m3fn, with ``k_scale`` and
    ``v_scale`` (B, H_kv, N_max) fp32, one scale per token and head (key n of head g is
    k_cache[b, g, n] · k_scale[b, g, n]; ``course_lib.kvquant.quantize_kv`` makes them). q stays
    fp16, bf16 or fp32 and o comes in its dtype; the kernel converts each tile to q's dtype
    (exactly) and applies the scales outside its products. Scales are required with an 8-bit
    cache and refused with any other.

    A token tree (speculative decoding's verification, ``course_lib.serving.speculative``):
    ``tree_mask`` bool (N_q, N_q) for every sequence, or (B, N_q, N_q), N_q <= 64, as
    ``speculative.tree_mask`` makes it. The N_q queries are the tree's nodes, whose keys are the
    last N_q of each sequence's cache, in node order (parents before children); node i sees
    every key before them and, of theirs, node j where tree_mask[i, j] (j is i or one of its
    ancestors). The mask of a chain is the causal mask and gives the plain call's answer bit
    for bit. Not with a window or ALiBi (a ValueError).

    validate: whether the lengths' values are checked, every L_b in [0, N_max] (else a
    ValueError naming cache_seqlens). None (the default): where that costs nothing, on the CPU
    (not while torch.compile traces); on a GPU the call reads nothing back, so it makes no
    synchronisation. True: on every device; on a GPU it reads the lengths back (one
    synchronisation), and it is refused under torch.compile and in a CUDA-graph capture.
    False: never. A length nothing checked is clamped into [0, N_max] by the kernel:
    L_b > N_max gives the attention over all N_max keys of the sequence's cache (queries
    aligned to its end), L_b < 0 that over no key (o = 0, lse = −inf, or the sink's logit).
    A wrong answer without an error, but never a read outside the cache. A tree mask's values
    are checked when the lengths' are: every node sees itself and none sees a later node (a
    ValueError naming tree_mask); unchecked, a bit above the diagonal is ignored (causal).
    """
    return _decode(q, k_cache, v_cache, cache_seqlens, None, num_splits, sm_scale, return_lse,
                   validate, (window_size, softcap, alibi_slopes, sinks),
                   kv_scales=_scales(k_scale, v_scale), tree=tree_mask)


def paged_decode(q, k_pages, v_pages, block_table, cache_seqlens, num_splits=None, *,
                 sm_scale=None, return_lse=False, validate=None, window_size=NO_WINDOW,
                 softcap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None,
                 tree_mask=None):
    """PagedAttention decode: like ``flash_decode``, with K/V stored in fixed-size pages.

    q (B, H, N_q, D); k_pages, v_pages (num_blocks, block_size, H_kv, D), the layout of vLLM and
    of ``flash_attn_with_kvcache`` (block_size 16 by default in ``course_lib.kvcache``);
    block_table (B, max_blocks) int32 maps sequence b's logical block j (keys j·block_size …)
    to a physical block; cache_seqlens (B,) int32. Entries past a sequence's last block are
    ignored. Returns what ``flash_decode`` returns on the same logical data, with the same
    variants' keywords (a window reads only the pages that hold its keys) and ``tree_mask``
    (the tree's nodes: the last N_q keys of each sequence's pages). An 8-bit cache's
    ``k_scale`` and ``v_scale`` are paged as it is: (num_blocks, block_size, H_kv) fp32.

    validate: as ``flash_decode``'s, for the lengths, within [0, max_blocks·block_size], and
    for every block id in use, those of the first ceil(L_b / block_size) entries of row b,
    within [0, num_blocks) (else a ValueError naming the block_table entry). What nothing
    checked, the kernel clamps: a length into [0, max_blocks·block_size], a block id into
    [0, num_blocks − 1], so a negative id reads block 0 and an id past the pool its last block:
    that block's keys and values (another sequence's, or none written) stand in for the
    sequence's own. A wrong answer without an error, but never a read outside the pages.
    """
    return _decode(q, k_pages, v_pages, cache_seqlens, block_table, num_splits, sm_scale,
                   return_lse, validate, (window_size, softcap, alibi_slopes, sinks), paged=True,
                   kv_scales=_scales(k_scale, v_scale), tree=tree_mask)


def _decode(q, k, v, lens, table, num_splits, sm_scale, return_lse, validate, variant_args,
            paged=False, kv_scales=None, tree=None):
    """``flash_decode`` and (``paged``) ``paged_decode``: the plan kept under the call's key,
    or the checks and a new plan; then one step by it (by the operator under torch.compile).
    ``kv_scales``: an 8-bit cache's (k_scale, v_scale), or None; ``tree``: a token tree's
    bool mask, or None."""
    compiling, key, plan = torch.compiler.is_compiling(), None, None
    if not compiling:
        try:
            key = _plan_key(q, k, v, lens, table, sm_scale, num_splits, variant_args,
                            kv_scales=kv_scales, tree=tree)
            plan = _PLANS.get(key)
        except (AttributeError, IndexError, TypeError):  # the checks below name the argument
            key = None
    if plan is None:  # the checks (a plan is kept only for a key whose checks passed)
        sm_scale, variant, _ = _check_cache(q, k, v, lens, table, paged, num_splits, sm_scale,
                                            variant_args, kv_scales, True, tree)
    num_blocks, page_size, n_max = _sizes(k, table)
    if (validate or _FREE_READS) and _checks_values(validate):
        if paged:
            check_block_table(table, lens, num_blocks, page_size, n_max)
        elif lens is not None:
            check_cache_seqlens(lens, n_max)
        if tree is not None:
            check_tree_values(tree)
    bits = None if tree is None else tree_bits(tree)
    if lens is not None:
        lens = _int32(lens)
    if paged:
        table = _int32(table)
    if compiling:
        args = (q, k, v, table, lens) if paged else (q, k, v, lens)
        op = torch.ops.course.paged_decode if paged else torch.ops.course.flash_decode
        o, lse = op(*args, num_splits or 0, sm_scale, variant.window[0], variant.softcap,
                    variant.alibi_slopes, variant.sinks, *(kv_scales or (None, None)), bits)
    else:
        plan = plan or _plan(key, q, k, table, num_splits, sm_scale, variant)
        o, lse = _run(plan, q, k, v, lens, table, n_max, variant_args[2], variant_args[3],
                      return_lse, _stream_id(q.get_device()) if key is None else key[0],
                      kv_scales, bits)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# the operators: typed functions (``course_lib.ops.library``); every call returns new tensors
# ---------------------------------------------------------------------------------------------

def _op_call(q, k, v, lens, table, num_splits, sm_scale, window_left, softcap, alibi_slopes,
             sinks, k_scale=None, v_scale=None, bits=None):
    """(o, lse) of an operator's checked arguments; num_splits 0: chosen; ``bits``: a token
    tree's bitmasks (``tree_bits``)."""
    variant = Variant((window_left, 0), softcap, alibi_slopes, sinks)
    kv_scales = _scales(k_scale, v_scale)
    key = _plan_key(q, k, v, lens, table, sm_scale, num_splits, variant, operator=True,
                    kv_scales=kv_scales, tree=bits)
    plan = _PLANS.get(key) or _plan(key, q, k, table, num_splits or None, sm_scale, variant,
                                    operator=True)
    n_max = _sizes(k, table)[2]
    return _run(plan, q, k, v, lens, table, n_max, alibi_slopes, sinks, True, key[0],
                kv_scales, bits)


def _fake_outputs(q, *_):
    return empty_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@operator(_fake_outputs)
def _flash_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor | None,
                  num_splits: int, sm_scale: float, window_left: int = -1,
                  softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                  sinks: Tensor | None = None, k_scale: Tensor | None = None,
                  v_scale: Tensor | None = None,
                  tree_bits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(o, lse) of ``flash_decode`` on checked inputs (an 8-bit cache with its scales; a token
    tree as its int64 bitmasks, ``tree_bits`` of its mask)."""
    return _op_call(q, k_cache, v_cache, cache_seqlens, None, num_splits, sm_scale, window_left,
                    softcap, alibi_slopes, sinks, k_scale, v_scale, tree_bits)


@operator(_fake_outputs)
def _paged_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                  cache_seqlens: Tensor, num_splits: int, sm_scale: float,
                  window_left: int = -1, softcap: float = 0.0,
                  alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
                  k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                  tree_bits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(o, lse) of ``paged_decode`` on checked inputs (an 8-bit cache with its scales; a token
    tree as its int64 bitmasks, ``tree_bits`` of its mask)."""
    return _op_call(q, k_pages, v_pages, cache_seqlens, block_table, num_splits, sm_scale,
                    window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, tree_bits)


__all__ = ["DecodePlan", "MAX_TREE_NODES", "check_cache_seqlens", "check_tree_values",
           "flash_decode", "forget_plans", "paged_decode", "plan_decode", "tree_bits"]
