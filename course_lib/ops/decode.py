"""Flash-Decoding and PagedAttention as functions to call, as PyTorch operators, and as plan/run.

Introduced in notebooks/12_flash_decoding.ipynb (``flash_decode``, and the section on host
overhead: ``plan_decode``) and notebooks/13_paged_attention.ipynb (``paged_decode``). The
kernels and their launch plan are in ``course_lib.kernels.decode``.

Three ways to call the same kernels (the split kernel, which also merges the splits when
called eagerly, and the merge kernel used inside CUDA-graph captures: ``kernels.decode.MERGES``):

* ``flash_decode(q, k_cache, v_cache, cache_seqlens)`` and ``paged_decode(...)``: the functions
  (the names and arguments of FlashAttention's ``flash_attn_with_kvcache``, its variants'
  keywords included: ``window_size``, ``softcap``, ``alibi_slopes``, and GPT-OSS's ``sinks``,
  notebooks/15_attention_variants.ipynb; the decode is causal, so the window's right is 0).
  They always check shapes, dtypes and devices. The values of the lengths and of the block
  ids in use are checked where reading them costs nothing (``validate=None``, the default: on
  the CPU, outside torch.compile), always with ``validate=True`` (on a GPU a device→host read:
  one synchronisation; refused under torch.compile and in a CUDA-graph capture) and never with
  ``validate=False``; a bad value is then a ``ValueError`` that names the argument. So the
  default call on a GPU makes no synchronisation, and there a value nothing checked is clamped
  by the kernel: a length into the cache, a block id into the pool. The output is then wrong,
  but nothing is read outside memory (``flash_decode`` and ``paged_decode`` say what each
  clamp gives).
  Called eagerly, the split buffers (and the lse, unless it is returned) are kept per shape and
  stream and reused; the output is new each call. A call with the default ``num_splits``,
  ``config`` and ``return_lse`` and ``validate`` None or False, shaped like an earlier one
  (shapes, strides, dtypes, devices, scale; the variants' values, their tensors' layouts and
  addresses), repeats that call's checked, bound launch (``_Repeat``): a model's layers, after
  the first of a step, make such calls. On the CPU, with ``validate=None``, such a repeat
  still checks the lengths' values first.
* ``torch.ops.course.flash_decode`` and ``torch.ops.course.paged_decode``: the same, as
  ``torch.library`` custom operators with fake implementations. The functions go through them
  when ``torch.compile`` traces, so a compiled decode step keeps the kernels in its graph (and
  in its CUDA graph with ``mode="reduce-overhead"``).
* ``plan = plan_decode(q, k_cache, v_cache)``, then ``plan.run(q, k_cache, v_cache,
  cache_seqlens)`` at every step, in the manner of FlashInfer's ``plan()``/``run()``: the plan
  checks the inputs once and fixes the split count, the launch config and every buffer; ``run``
  only launches into the plan's buffers, which is what a CUDA graph captures. From the second
  step on, a step with the same cache tensors repeats the launches bound by the first
  (``course_lib._launch.bind``): one call into Triton's C launcher per kernel. The variants are
  the plan's: ``plan_decode(..., window_size=, softcap=, alibi_slopes=, sinks=)``. ``run``
  checks the lengths and block ids as the functions do (``validate``): at every step on the
  CPU, never by default on a GPU.
"""
from __future__ import annotations

import collections

import torch

from course_lib._device import DEVICE
from course_lib._launch import hooks_installed, int_classes
from course_lib.kernels import decode as kd
from course_lib.kernels.attention_common import OutputLike, call_key, empty_output, keep
from course_lib.validate import (
    check_attention_inputs,
    check_block_table,
    check_int_vector,
    check_sm_scale,
    check_tensor,
    check_variants,
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


def _check_contiguous(q, k, v, k_name: str) -> None:
    # The kernels read rows of D numbers at unit stride.
    for name, t in (("q", q), (k_name, k), ("v" + k_name[1:], v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), "
                             f"got strides {tuple(t.stride())}")


def _check_cache(q, k_cache, v_cache, cache_seqlens):
    """(B, H, H_kv, N_q, N_max, D) of a contiguous cache; TypeError/ValueError naming the
    argument."""
    B, H, H_kv, N_q, N_max, D = check_attention_inputs(q, k_cache, v_cache)
    _check_contiguous(q, k_cache, v_cache, "k_cache")
    if cache_seqlens is not None:
        check_int_vector("cache_seqlens", cache_seqlens, B, q.device)
    return B, H, H_kv, N_q, N_max, D


def _check_pages(q, k_pages, v_pages, block_table, cache_seqlens, seqlens_required=True):
    """(B, H, H_kv, N_q, D, num_blocks, block_size, max_blocks) of a paged cache. A plan is made
    before any lengths exist: it passes ``seqlens_required=False``."""
    check_tensor("q", q, 4)
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        check_tensor(name, t, 4)
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have one shape, got {tuple(k_pages.shape)} "
                         f"and {tuple(v_pages.shape)}")
    num_blocks, block_size, H_kv, D = k_pages.shape
    B = q.shape[0]
    # The shared checks, on a (B, H_kv, block_size, D) view of the pages' shape.
    k_view = k_pages[:1].permute(0, 2, 1, 3).expand(B, H_kv, block_size, D)
    v_view = v_pages[:1].permute(0, 2, 1, 3).expand(B, H_kv, block_size, D)
    _, H, _, N_q, _, _ = check_attention_inputs(q, k_view, v_view)
    _check_contiguous(q, k_pages, v_pages, "k_pages")
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor of int32, got "
                        f"{type(block_table).__name__}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must hold integers (int32), got {block_table.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must have shape (B={B}, max_blocks), "
                         f"got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
    if cache_seqlens is None:
        if seqlens_required:
            raise ValueError("cache_seqlens is required for paged_decode (one length per "
                             "sequence)")
    else:
        check_int_vector("cache_seqlens", cache_seqlens, B, q.device)
    return B, H, H_kv, N_q, D, num_blocks, block_size, block_table.shape[1]


def check_cache_seqlens(cache_seqlens, n_max: int) -> None:
    """ValueError if a length lies outside [0, n_max]. Reads the lengths back to the host: on a
    GPU one device→host synchronisation (what ``validate=True`` adds to a call there)."""
    lo, hi = (int(x) for x in torch.aminmax(cache_seqlens.to(torch.int64)))
    if lo < 0 or hi > n_max:
        raise ValueError(f"cache_seqlens must lie in [0, {n_max}] (the cache's N_max), "
                         f"got values in [{lo}, {hi}]")


# Where reading a tensor's values costs nothing: the CPU (the interpreter's tensors are in host
# memory). There ``validate=None`` checks them; on a GPU a read waits for every queued kernel.
_FREE_READS = DEVICE == "cpu"


def _checks_values(validate) -> bool:
    """Whether a call reads its lengths and block ids to check them: ``validate=True`` always
    (refused under torch.compile and in a CUDA-graph capture, which cannot read), None where the
    read is free (``_FREE_READS``, and not while torch.compile traces), False never. The call
    sites test ``(validate or _FREE_READS)`` first, so a GPU's default call does not get here."""
    if validate is None:
        return _FREE_READS and not torch.compiler.is_compiling()
    if validate:
        _refuse_validate_when_compiling()
        if kd.capturing():
            raise ValueError("validate=True reads cache_seqlens back to the host, which a "
                             "CUDA-graph capture cannot do: validate once before capturing, or "
                             "leave validate at None or False (the kernel clamps lengths and "
                             "block ids into range)")
        return True
    return False


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.stride(-1) == 1 else t.to(torch.int32).contiguous()


# The variants' defaults: a call that passes these very objects is plain attention, known as such
# without a check (the repeated calls of ``flash_decode``).
FULL_WINDOW, NO_CAP = (-1, -1), 0.0
_PLAIN = ((-1, 0), 0.0, None, None)  # (window, softcap, alibi_slopes, sinks) of plain attention


def _variants(q, window_size, softcap, alibi_slopes, sinks):
    """The variants of a decode call, checked (``validate.check_variants``, causal: the window's
    right is 0): (window, softcap, alibi_slopes, sinks), the tensors contiguous, or None for plain
    attention (every keyword at its default, or one that changes nothing)."""
    if window_size is FULL_WINDOW and softcap is NO_CAP and alibi_slopes is None and sinks is None:
        return None  # the defaults themselves: nothing to check (a plain call's host time)
    window, softcap = check_variants(q, True, window_size, softcap, alibi_slopes, sinks)
    if window[0] < 0 and softcap == 0.0 and alibi_slopes is None and sinks is None:
        return None
    return (window, softcap, *(None if t is None else t.contiguous()
                               for t in (alibi_slopes, sinks)))


def _variants_key(window_size, softcap, alibi_slopes, sinks):
    """What the variants' checks and launch read of their arguments (None at the defaults):
    values with their types, as ``call_key`` holds the scale's; the tensors' layouts and addresses.
    TypeError or AttributeError for what is no pair or tensor."""
    if window_size is FULL_WINDOW and softcap is NO_CAP and alibi_slopes is None and sinks is None:
        return None
    return (type(window_size), *((type(w), w) for w in window_size), type(softcap), softcap,
            *(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device())
              for t in (alibi_slopes, sinks)))


def _op_variants(variants) -> tuple:
    """The operators' variant arguments: (window_left, softcap, alibi_slopes, sinks)."""
    window, softcap, alibi_slopes, sinks = variants or _PLAIN
    return window[0], softcap, alibi_slopes, sinks


# ---------------------------------------------------------------------------------------------
# the shared launch path: the split buffers reused per shape and stream, a new output per call
# ---------------------------------------------------------------------------------------------

class _PlanCache(collections.OrderedDict):
    """The eager calls' plans, least recently made first. A plan forgotten (evicted, or all of
    them cleared) takes the repeated launches (``_REPEATS``) with it: a repeat never outlives
    its plan's place here."""

    def clear(self):
        super().clear()
        _REPEATS.clear()

    def popitem(self, last=True):
        _REPEATS.clear()
        return super().popitem(last)


_PLANS: _PlanCache = _PlanCache()
_MAX_PLANS = 32


def _stream_id(device_index: int) -> int:
    """The current stream of the GPU ``device_index`` (``Tensor.get_device()``; -1: the CPU).
    Buffers reused by two streams at once would race: each stream gets its own."""
    if device_index < 0:
        return 0
    return torch._C._cuda_getCurrentRawStream(device_index)


def _capturing(stream: int) -> bool:
    """Whether the current stream, ``stream`` (``_stream_id``), is being captured. CUDA refuses
    to capture the default stream (0), so an eager call on it asks the driver nothing."""
    return stream != 0 and kd.capturing()


def _keep_plan(key, plan) -> None:
    _PLANS[key] = plan
    if len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)


def _decode(q, k, v, seqlens, block_table, n_max, page_size, num_blocks, num_splits,
            sm_scale, cfg, paged, reuse=True, need_lse=True, repeat_key=None, variants=None):
    """Launch on checked inputs; returns a new (out, lse). ``variants``: ``_variants``'s.

    ``repeat_key`` (an eager ``flash_decode`` with default arguments, ``_repeat_key``): a
    launch that ends bound is remembered under that key (``attention_common.keep``) for the
    calls shaped like this one (``_Repeat``).

    ``need_lse=False`` (an eager call that does not return it): the lse goes to a buffer of
    the plan, reused, and is not to be kept.
    ``reuse``: keep the split buffers per shape and stream (eager calls). The operators pass
    False: under torch.compile's CUDA graphs every allocation must belong to the graph's own
    memory pool, and a buffer kept alive between calls would not. A plan of one split holds no
    tensor (it writes the answer directly), so the operators keep those plans too: a compiled
    prefill through a static cache (many queries, one split) then launches like an eager
    call."""
    B, H, N_q, D = q.shape
    H_kv = k.shape[2] if paged else k.shape[1]
    window, softcap, alibi, sinks = variants or _PLAIN
    tensors = kd.variant_tensors(alibi, sinks)

    # A cache that grows by a token per step (transformers' DynamicCache) reuses one plan for a
    # while: one plan serves a range of lengths (at most 1/8 longer than the cache), and the
    # kernel is told the true length.
    n_plan = n_max if paged else _length_bucket(n_max)

    out = empty_output(q, kd._empty)  # laid out as q is: a transposed q's O needs no copy
    dev = q.get_device()  # (an int: cheaper than q.device in a key)
    stream = _stream_id(dev)
    key = (B, H, H_kv, N_q, D, n_plan, paged, page_size, num_blocks, num_splits,
           None if cfg is None else tuple(sorted(cfg.items())), dev, stream, reuse,
           variants and (window, softcap, None if alibi is None else alibi.ndim, sinks is None))
    plan, once = _PLANS.get(key), False
    if plan is None:
        # a plan made for one call knows whether it is being captured (no counters to zero)
        merge = "auto" if reuse else "kernel" if _capturing(stream) else "fused"
        plan = kd.make_plan(B, H, H_kv, N_q, D, n_plan, q.device, num_splits=num_splits,
                            config=cfg, paged=paged, page_size=page_size, num_blocks=num_blocks,
                            merge=merge, window=window, softcap=softcap)
        once = not reuse and plan.num_splits > 1  # an operator's plan with buffers: this call's
        if not once:
            _keep_plan(key, plan)
    scratch = reuse and not need_lse  # the lse goes to a buffer of the plan
    if scratch and plan.lse_scratch is not None:
        lse = plan.lse_scratch  # an allocation fewer per call
    else:
        lse = kd._empty((B, H, N_q), device=q.device, dtype=torch.float32)
        if scratch:
            plan.lse_scratch = lse
    if once:
        kd.run_plan(plan, q, k, v, seqlens, block_table, sm_scale, out, lse, n_max=n_max,
                    alibi_slopes=alibi, sinks=sinks)
        return out, lse
    # The launch bound by the last call with this plan is repeated when everything but the
    # addresses, the cache's strides and its length is as it was, and those have the
    # specialization classes they had (what the compiled kernel depends on): dtype, scale,
    # q's strides, every address 16-byte aligned, no profiler hooks, no capture. The addresses of
    # the ALiBi slopes and sinks, where given, are free too: they follow the geometry.
    geometry = (*kd.cache_geometry(paged, k, v), n_max, *(t.data_ptr() for t in tensors))
    sig = (q.dtype, sm_scale, q.stride(), seqlens is None,
           None if block_table is None else block_table.stride(0), int_classes(geometry))
    bound = plan.bound
    has_lens, has_table = seqlens is not None, block_table is not None
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), seqlens.data_ptr() if has_lens else 0,
            block_table.data_ptr() if has_table else 0, out.data_ptr(), lse.data_ptr())
    if (bound is not None and bound[0] == sig and not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]
                                                       | ptrs[4] | ptrs[5] | ptrs[6]) & 15
            and not hooks_installed() and not _capturing(stream)):
        bound[1](ptrs[0], ptrs[1], ptrs[2], ptrs[3] if has_lens else ptrs[0],
                 ptrs[4] if has_table else ptrs[0], ptrs[5], ptrs[6], *geometry)
    else:
        bind = not _capturing(stream)
        launches = kd.run_plan(plan, q, k, v, seqlens, block_table, sm_scale, out, lse,
                               bind=bind, n_max=n_max, alibi_slopes=alibi, sinks=sinks)
        if not (bind and launches is not None and len(launches) == 1):
            return out, lse
        plan.bound = (sig, launches[0])
    if repeat_key is not None and scratch and not ptrs[6] & 15:
        keep(_REPEATS, repeat_key, _Repeat(plan, geometry, out, q, dev, stream), _MAX_REPEATS)
    return out, lse


# ---------------------------------------------------------------------------------------------
# a call shaped like an earlier one: that call's checked, bound launch again
# ---------------------------------------------------------------------------------------------

# An eager ``flash_decode`` with default arguments whose inputs have the shapes, strides, dtypes
# and devices of an earlier call's, with the same scale and lengths' layout, would pass the same
# checks and get the same plan and bound launch: it repeats that launch (``_Repeat``) with no
# checks (but the lengths' values on the CPU, where reading them is free), no plan key, one
# allocation (o) and one call into Triton's C launcher. A transformers model makes that call
# once per layer, so from the second layer of a step on every call does.
_REPEATS: dict = {}
_MAX_REPEATS = 64
_PLAIN_EMPTY = kd._empty


def _repeat_key(q, k, v, lens, sm_scale, variants_key=None) -> tuple:
    """What the checks and the plan of a call depend on (``call_key``, the lengths' layout and
    ``_variants_key``). AttributeError for a non-tensor."""
    return (call_key(q, k, v, sm_scale),
            None if lens is None else (lens.shape, lens.stride(), lens.dtype, lens.get_device()),
            variants_key)


class _Repeat:
    """The launch of a checked eager call, bound, for calls with the same ``_repeat_key``:
    ``self(q, k, v, lens)`` is that call's result for new tensors, or None where the launch
    cannot be repeated (the plan was bound anew or forgotten, a profiler hook or a CUDA-graph
    capture is on, another stream is current, an address is not 16-byte aligned): the caller
    then takes the checked path."""

    __slots__ = ("plans", "plan", "bound", "geometry", "new_out", "dev", "stream")

    def __init__(self, plan, geometry, out, q, dev, stream):
        self.plans, self.plan, self.bound, self.geometry = _PLANS, plan, plan.bound, geometry
        self.new_out, self.dev, self.stream = OutputLike(out, q), dev, stream

    def __call__(self, q, k, v, lens):
        plan = self.plan
        stream = _stream_id(self.dev)
        if (plan.bound is not self.bound or _PLANS is not self.plans or stream != self.stream
                or hooks_installed() or _capturing(stream)):
            return None
        p, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        lp = p if lens is None else lens.data_ptr()
        if (p | kp | vp | lp) & 15:
            return None
        empty = kd._empty  # the tests' poisoned allocator where they installed one
        out = self.new_out(None if empty is _PLAIN_EMPTY else empty, q)
        self.bound[1](p, kp, vp, lp, p, out.data_ptr(), plan.lse_scratch.data_ptr(),
                      *self.geometry)
        return out


def _length_bucket(n: int) -> int:
    """``n`` rounded up to a multiple of an eighth of the largest power of two not above it
    (at least 64): 2049 and 2304 share 2304, so a cache that grows one token per step changes
    plans every few hundred steps, not every step, and a plan is at most 1/8 longer."""
    step = max(64, (1 << (max(n, 1).bit_length() - 1)) // 8)
    return -(-n // step) * step


def _config_list(cfg) -> list[int]:
    return [] if cfg is None else [cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]]


def _config_dict(config: list[int]):
    if not config:
        return None
    return dict(BLOCK_N=config[0], num_warps=config[1], num_stages=config[2])


# ---------------------------------------------------------------------------------------------
# the functions
# ---------------------------------------------------------------------------------------------

def flash_decode(q, k_cache, v_cache, cache_seqlens=None, num_splits=None, *, sm_scale=None,
                 return_lse=False, config=None, validate=None, window_size=FULL_WINDOW,
                 softcap=NO_CAP, alibi_slopes=None, sinks=None):
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

    num_splits: key splits per sequence (None: chosen from the SM count and the work);
    config: override of dict(BLOCK_N, num_warps, num_stages).

    validate: whether the lengths' values are checked, every L_b in [0, N_max] (else a
    ValueError naming cache_seqlens). None (the default): where that costs nothing, on the CPU
    (not while torch.compile traces); on a GPU the call reads nothing back, so it makes no
    synchronisation. True: on every device; on a GPU it reads the lengths back (one
    synchronisation), and it is refused under torch.compile and in a CUDA-graph capture.
    False: never. A length nothing checked is clamped into [0, N_max] by the kernel:
    L_b > N_max gives the attention over all N_max keys of the sequence's cache (queries
    aligned to its end), L_b < 0 that over no key (o = 0, lse = −inf, or the sink's logit).
    A wrong answer without an error, but never a read outside the cache.
    """
    repeat_key = None
    if (not torch.compiler.is_compiling() and num_splits is None and config is None
            and not validate and not return_lse):
        try:
            repeat_key = _repeat_key(q, k_cache, v_cache, cache_seqlens, sm_scale,
                                     _variants_key(window_size, softcap, alibi_slopes, sinks))
            repeat = _REPEATS.get(repeat_key)
        except (AttributeError, TypeError):  # not a tensor or a pair: the checks name it
            repeat_key = None
        else:
            if repeat is not None:
                # (on a GPU ``_FREE_READS`` is False and ends the test: the repeat checks nothing)
                if _FREE_READS and validate is None and cache_seqlens is not None:
                    check_cache_seqlens(cache_seqlens, k_cache.shape[2])  # free on the CPU
                o = repeat(q, k_cache, v_cache, cache_seqlens)
                if o is not None:
                    return o
    B, H, H_kv, N_q, N_max, D = _check_cache(q, k_cache, v_cache, cache_seqlens)
    _check_num_splits(num_splits)
    sm_scale = check_sm_scale(sm_scale, D)
    cfg = _check_config(config, D)
    variants = _variants(q, window_size, softcap, alibi_slopes, sinks)
    if variants is not None and (variants[2] is not alibi_slopes or variants[3] is not sinks):
        repeat_key = None  # made contiguous: a call like this one copies them again
    if cache_seqlens is not None:
        if (validate or _FREE_READS) and _checks_values(validate):
            check_cache_seqlens(cache_seqlens, N_max)
        lens = _int32(cache_seqlens)
        if lens is not cache_seqlens:  # converted: a call like this one converts again
            repeat_key, cache_seqlens = None, lens
    if torch.compiler.is_compiling():
        o, lse = torch.ops.course.flash_decode(q, k_cache, v_cache, cache_seqlens,
                                               num_splits or 0, sm_scale, _config_list(cfg),
                                               *_op_variants(variants))
    else:
        o, lse = _decode(q, k_cache, v_cache, cache_seqlens, None, N_max, 1, 1, num_splits,
                         sm_scale, cfg, paged=False, need_lse=return_lse, repeat_key=repeat_key,
                         variants=variants)
    return (o, lse) if return_lse else o


def paged_decode(q, k_pages, v_pages, block_table, cache_seqlens, num_splits=None, *,
                 sm_scale=None, return_lse=False, config=None, validate=None,
                 window_size=FULL_WINDOW, softcap=NO_CAP, alibi_slopes=None, sinks=None):
    """PagedAttention decode: like ``flash_decode``, with K/V stored in fixed-size pages.

    q (B, H, N_q, D); k_pages, v_pages (num_blocks, block_size, H_kv, D), the layout of vLLM and
    of ``flash_attn_with_kvcache`` (block_size 16 by default in ``course_lib.kvcache``);
    block_table (B, max_blocks) int32 maps sequence b's logical block j (keys j·block_size …)
    to a physical block; cache_seqlens (B,) int32. Entries past a sequence's last block are
    ignored. Returns what ``flash_decode`` returns on the same logical data, with the same
    variants' keywords (a window reads only the pages that hold its keys).

    validate: whether the values are checked: every length within [0, max_blocks·block_size]
    (else a ValueError naming cache_seqlens) and every block id in use, those of the first
    ceil(L_b / block_size) entries of row b, within [0, num_blocks) (else a ValueError naming
    the block_table entry). None (the default): where that costs nothing, on the CPU (not while
    torch.compile traces); on a GPU the call reads nothing back. True: on every device (on a
    GPU a read back: one synchronisation; refused under torch.compile and in a CUDA-graph
    capture). False: never. What nothing checked, the kernel clamps: a length into
    [0, max_blocks·block_size] (as ``flash_decode`` clamps into [0, N_max]), a block id into
    [0, num_blocks − 1], so a negative id reads block 0 and an id past the pool its last block:
    that block's keys and values (another sequence's, or none written) stand in for the
    sequence's own. A wrong answer without an error, but never a read outside the pages.
    """
    B, H, H_kv, N_q, D, num_blocks, block_size, max_blocks = _check_pages(
        q, k_pages, v_pages, block_table, cache_seqlens)
    _check_num_splits(num_splits)
    sm_scale = check_sm_scale(sm_scale, D)
    cfg = _check_config(config, D)
    variants = _variants(q, window_size, softcap, alibi_slopes, sinks)
    capacity = max_blocks * block_size
    if (validate or _FREE_READS) and _checks_values(validate):
        check_block_table(block_table, cache_seqlens, num_blocks, block_size, capacity)
    block_table, cache_seqlens = _int32(block_table), _int32(cache_seqlens)
    if torch.compiler.is_compiling():
        o, lse = torch.ops.course.paged_decode(q, k_pages, v_pages, block_table, cache_seqlens,
                                               num_splits or 0, sm_scale, _config_list(cfg),
                                               *_op_variants(variants))
    else:
        o, lse = _decode(q, k_pages, v_pages, cache_seqlens, block_table, capacity, block_size,
                         num_blocks, num_splits, sm_scale, cfg, paged=True, need_lse=return_lse,
                         variants=variants)
    return (o, lse) if return_lse else o


def _refuse_validate_when_compiling():
    if torch.compiler.is_compiling():
        raise ValueError("validate=True reads cache_seqlens back to the host, which a compiled "
                         "graph cannot do: validate once outside torch.compile, or leave "
                         "validate at None or False (the kernel clamps lengths and block ids "
                         "into range)")


# ---------------------------------------------------------------------------------------------
# the operators
# ---------------------------------------------------------------------------------------------

# torch.library.Library, not the ``custom_op`` decorator, as in course_lib.ops.attention (why
# there); every call returns fresh tensors (``reuse=False``).
_LIB = torch.library.Library("course", "FRAGMENT")
# The variants (the decode is causal: a window is its left side alone, -1 for none).
_VARIANTS = ("int window_left=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
             "Tensor? sinks=None")
_LIB.define("flash_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens, "
            f"int num_splits, float sm_scale, int[] config, {_VARIANTS}) -> (Tensor, Tensor)")
_LIB.define("paged_decode(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, "
            "Tensor cache_seqlens, int num_splits, float sm_scale, int[] config, "
            f"{_VARIANTS}) -> (Tensor, Tensor)")


def _op_variants_of(window_left, softcap, alibi_slopes, sinks):
    """``_variants``'s tuple from the operators' arguments (checked by the functions)."""
    if window_left < 0 and softcap == 0.0 and alibi_slopes is None and sinks is None:
        return None
    return (window_left, 0), softcap, alibi_slopes, sinks


def _flash_decode_op(q, k_cache, v_cache, cache_seqlens, num_splits, sm_scale, config,
                     window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None):
    """(o, lse) of ``flash_decode`` on checked inputs; num_splits 0: chosen; config [] default."""
    return _decode(q, k_cache, v_cache, cache_seqlens, None, k_cache.shape[2], 1, 1,
                   num_splits or None, sm_scale, _config_dict(config), paged=False, reuse=False,
                   variants=_op_variants_of(window_left, softcap, alibi_slopes, sinks))


def _paged_decode_op(q, k_pages, v_pages, block_table, cache_seqlens, num_splits, sm_scale,
                     config, window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None):
    """(o, lse) of ``paged_decode`` on checked inputs."""
    num_blocks, block_size = k_pages.shape[:2]
    return _decode(q, k_pages, v_pages, cache_seqlens, block_table,
                   block_table.shape[1] * block_size, block_size, num_blocks,
                   num_splits or None, sm_scale, _config_dict(config), paged=True, reuse=False,
                   variants=_op_variants_of(window_left, softcap, alibi_slopes, sinks))


def _fake_outputs(q, *_):
    B, H, N_q, D = q.shape
    return empty_output(q), q.new_empty((B, H, N_q), dtype=torch.float32)


for _name, _impl in (("flash_decode", _flash_decode_op), ("paged_decode", _paged_decode_op)):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"course::{_name}", _fake_outputs, lib=_LIB)


# ---------------------------------------------------------------------------------------------
# plan and run
# ---------------------------------------------------------------------------------------------

class DecodePlan:
    """A decode step planned once per batch shape; ``run`` then only launches the kernels.

    Made by ``plan_decode``. It holds the split count, the launch config and its buffers: the
    splits' partial outputs and lses, and the output ``out`` (B, H, N_q, D) with its ``lse``.
    ``run`` checks the shapes it was planned for (and, where ``validate`` says, the lengths and
    the block table: by default at every step on the CPU, never on a GPU) and writes into
    ``out``/``lse``, overwriting the previous step's result (FlashInfer's ``run`` does the same
    with the buffers of its ``plan``): copy a result you want to keep. Every pointer it launches
    with is either yours or the plan's, so a ``run`` can be captured in a CUDA graph and
    replayed.
    """

    def __init__(self, q, k_cache, v_cache, *, block_table=None, num_splits=None,
                 sm_scale=None, config=None, merge="auto", window_size=FULL_WINDOW,
                 softcap=NO_CAP, alibi_slopes=None, sinks=None):
        self.paged = block_table is not None
        if self.paged:
            B, H, H_kv, N_q, D, num_blocks, page_size, max_blocks = _check_pages(
                q, k_cache, v_cache, block_table, None, seqlens_required=False)
            n_max = max_blocks * page_size
        else:
            B, H, H_kv, N_q, n_max, D = _check_cache(q, k_cache, v_cache, None)
            num_blocks, page_size = 1, 1
        _check_num_splits(num_splits)
        self.sm_scale = check_sm_scale(sm_scale, D)
        cfg = _check_config(config, D)
        window, softcap, self._alibi, self._sinks = (
            _variants(q, window_size, softcap, alibi_slopes, sinks) or _PLAIN)
        self._q_shape, self._kv_shape = tuple(q.shape), tuple(k_cache.shape)
        self._table_shape = None if block_table is None else tuple(block_table.shape)
        self.dtype, self.device = q.dtype, q.device
        self.plan = kd.make_plan(B, H, H_kv, N_q, D, n_max, q.device, num_splits=num_splits,
                                 config=cfg, paged=self.paged, page_size=page_size,
                                 num_blocks=num_blocks, merge=merge, window=window,
                                 softcap=softcap)
        self.num_splits = self.plan.num_splits
        self.out = empty_output(q, kd._empty)
        self.lse = kd._empty((B, H, N_q), device=q.device, dtype=torch.float32)
        self._q_stride, self._device_index = tuple(q.stride()), q.get_device()
        self._out_ptrs = (self.out.data_ptr(), self.lse.data_ptr())
        self._variant_ptrs = tuple(t.data_ptr()
                                   for t in kd.variant_tensors(self._alibi, self._sinks))
        self._bound = None  # the launches of the last step, bound (``run``)

    def run(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None, return_lse=False,
            *, validate=None):
        """One decode step into the plan's buffers: returns ``self.out`` (and ``self.lse``).

        ``cache_seqlens`` (B,) int32 (None: every sequence uses all N_max keys); paged plans
        need ``block_table`` (B, max_blocks) as planned and ``cache_seqlens``, int32 and
        contiguous (``run`` converts nothing).

        ``validate`` as in ``flash_decode`` and ``paged_decode``: None (the default) checks the
        lengths and block table where that is free, on the CPU, at every step (their kind,
        dtype and shape, then every length within the plan's N_max and every block id in use
        within the pool: a ValueError or TypeError naming the argument); on a GPU a step does
        nothing more than launch. True checks on every device (on a GPU one synchronisation;
        refused in a CUDA-graph capture), False never: the kernel then clamps what is out of
        range, as the functions' docstrings say."""
        if (q.shape != self._q_shape or k_cache.shape != self._kv_shape
                or v_cache.shape != self._kv_shape or q.dtype != self.dtype):
            raise ValueError(f"this plan is for q {self._q_shape} and caches {self._kv_shape} "
                             f"of {self.dtype}, got q {tuple(q.shape)} {q.dtype} and "
                             f"k_cache {tuple(k_cache.shape)}: make a new plan")
        if self.paged and (block_table is None or cache_seqlens is None):
            raise ValueError("a paged plan's run needs block_table and cache_seqlens")
        if (validate or _FREE_READS) and _checks_values(validate):
            self._check_values(cache_seqlens, block_table)
        bound = self._bound
        # The launches bound by the last step are repeated when only q's contents and address
        # changed: the same cache, lengths and block-table tensors, q with the planned strides,
        # device and 16-byte alignment (what the compiled kernels are specialised on), no
        # profiler hooks and no CUDA-graph capture. A step is then one call into Triton's C
        # launcher per kernel: no key, no Triton binding (lesson 12, section 8).
        stream = _stream_id(self._device_index)
        if (bound is not None and bound[0] is k_cache and bound[1] is v_cache
                and bound[2] is cache_seqlens and bound[3] is block_table
                and q.stride() == self._q_stride and q.get_device() == self._device_index
                and not q.data_ptr() & 15 and not hooks_installed() and not _capturing(stream)):
            p = q.data_ptr()
            bound[4](p, k_cache.data_ptr(), v_cache.data_ptr(),
                     p if cache_seqlens is None else cache_seqlens.data_ptr(),
                     p if block_table is None else block_table.data_ptr(), *bound[6])
            for merge in bound[5]:
                merge()
        else:
            bind = not _capturing(stream)
            launches = kd.run_plan(self.plan, q, k_cache, v_cache, cache_seqlens, block_table,
                                   self.sm_scale, self.out, self.lse, bind=bind,
                                   alibi_slopes=self._alibi, sinks=self._sinks)
            # (k_cache, v_cache, cache_seqlens, block_table, the split kernel's launch, the
            # merge kernel's, the split launch's fixed tail: O, lse, the caches' geometry, the
            # variants' tensors)
            self._bound = (None if not bind or launches is None else
                           (k_cache, v_cache, cache_seqlens, block_table, launches[0],
                            tuple(launches[1:]),
                            (*self._out_ptrs, *kd.cache_geometry(self.paged, k_cache, v_cache),
                             self.plan.n_max, *self._variant_ptrs)))
        return (self.out, self.lse) if return_lse else self.out

    def _check_values(self, cache_seqlens, block_table) -> None:
        """``run``'s checks of the lengths and the block table (``validate``): what the launch
        takes as it is (int32, unit stride, the planned shapes), then the values."""
        plan = self.plan
        if cache_seqlens is not None:
            check_int_vector("cache_seqlens", cache_seqlens, plan.B, self.device)
            _refuse_conversion("cache_seqlens", cache_seqlens)
        if not self.paged:
            if cache_seqlens is not None:
                check_cache_seqlens(cache_seqlens, plan.n_max)
            return
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor of int32, got "
                            f"{type(block_table).__name__}")
        if tuple(block_table.shape) != self._table_shape or block_table.device != self.device:
            raise ValueError(f"this plan's block_table is {self._table_shape} on {self.device}, "
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
                config=None, merge="auto", window_size=FULL_WINDOW, softcap=NO_CAP,
                alibi_slopes=None, sinks=None) -> DecodePlan:
    """Plan decode steps shaped like these tensors (see ``DecodePlan``).

    The arguments are those of ``flash_decode`` (or, with ``block_table``, of ``paged_decode``,
    k_cache and v_cache then being the pages); only their shapes, dtypes and device are used.
    ``merge`` ("auto", "fused" or "kernel"): how the splits are merged
    (``course_lib.kernels.decode.MERGES``). The variants (``flash_decode``'s keywords) are fixed
    by the plan: a window sets the split count for the keys it reads, and the plan holds the
    ALiBi slopes and sinks it was given (contiguous ones as they are, read at every step; a
    strided one is copied once), so layers that differ in them need plans of their own.

        plan = plan_decode(q, k_cache, v_cache)        # once per batch shape
        for step in range(n_steps):                      # then every step: only launches
            o = plan.run(q, k_cache, v_cache, cache_seqlens)

    (On the CPU each ``run`` also checks the lengths' values, and a paged plan's block ids:
    ``DecodePlan.run``'s ``validate``.)
    """
    return DecodePlan(q, k_cache, v_cache, block_table=block_table, num_splits=num_splits,
                      sm_scale=sm_scale, config=config, merge=merge, window_size=window_size,
                      softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


__all__ = ["DecodePlan", "check_cache_seqlens", "flash_decode", "paged_decode", "plan_decode"]
