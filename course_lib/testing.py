"""Numerics testing helpers: the fp32 reference, the 2x error rule, poisoned outputs.

Used by tests/ and by the notebooks' "check" cells (introduced in notebooks/00_setup.ipynb).

The rule (from flash-attention's test-suite): a kernel's error against an fp32 (or fp64)
reference must be at most twice the error that PyTorch makes in the *same* precision, plus
a small absolute floor. Errors are printed before the assertion so a failure explains itself.

Printing numbers that come from rounding. The error of a lower-precision computation against a
high-precision reference measures that precision: it is printed with two significant digits.
A difference between two computations of the same thing in the same precision is zero up to
rounding: its last bits change from one CPU to the next, so it is shown against a bound
(``below``), never by its bits.
"""
from __future__ import annotations

import torch

from course_lib._device import DEVICE

# Dtypes a kernel test covers: the interpreter computes bf16 dots wrongly, so CPU runs use fp32
# and fp16; a GPU runs the dtypes used in practice.
KERNEL_DTYPES = ([torch.float32, torch.float16] if DEVICE == "cpu"
                 else [torch.float16, torch.bfloat16])


def fresh_randn(*shape, dtype=torch.float32, device=None, seed=None, scale=1.0):
    """Fresh random normal input (never zeros: zeros hide unwritten outputs)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float32) * scale
    return x.to(device=device or DEVICE, dtype=dtype)


def below(err: float, bound: float) -> str:
    """``"< bound"``: a difference that is zero up to rounding, stated against its bound.

    The last bits of such a difference (2.8e-17 on one CPU, 5.6e-17 on the next) depend on
    which SIMD code paths the CPU takes, so a lesson, a figure or a printed check shows the
    bound, never the bits. Raises AssertionError when ``err`` is not below ``bound`` (NaN
    included): then the difference is not rounding, and that is the news.

    >>> below(3e-17, 1e-12)
    '< 1e-12'
    """
    if not err < bound:
        raise AssertionError(f"{err:.2g} is not below the rounding bound {bound:.0e}")
    return f"< {bound:.0e}"


def reads_back(fn) -> int:
    """How many values ``fn()`` reads back from the device to the host (``.item()``,
    ``.tolist()``, a tensor's truth value: each one ``aten._local_scalar_dense``): a call that
    reads none makes no synchronisation on a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Count.reads += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.reads


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a tensor with NaN in place so any element a kernel forgets to write fails the test."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-(2**30))
    return t


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max, mean) absolute error of ``out`` against ``ref``, computed in fp64 on the CPU.

    Positions where both are -inf (e.g. the LSE of a row that sees no key) count as exact.
    """
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"shapes differ: {tuple(o.shape)} vs {tuple(r.shape)}")
    both_inf = torch.isinf(o) & torch.isinf(r) & (torch.sign(o) == torch.sign(r))
    diff = (o - r).abs().masked_fill(both_inf, 0.0)
    if diff.numel() == 0:
        return 0.0, 0.0
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return diff.max().item(), diff.mean().item()


def assert_close_2x(out, ref, baseline, name="out", atol=1e-5, factor=2.0, verbose=True):
    """Assert err(out, ref) <= factor * err(baseline, ref) + atol, with errors printed first.

    ``ref`` is the high-precision reference; ``baseline`` is PyTorch's computation of the same
    thing in the kernel's own precision.
    """
    max_err, mean_err = errors(out, ref)
    base_max, base_mean = errors(baseline, ref)
    if verbose:
        print(f"{name}: max err {max_err:.2g} (torch in the same precision {base_max:.2g}), "
              f"mean err {mean_err:.2g} (torch {base_mean:.2g})")
    bound = factor * base_max + atol
    assert max_err <= bound, (
        f"{name}: max error {max_err:.3e} exceeds {factor}x torch's {base_max:.3e} + {atol:g}"
    )
    return max_err, base_max


def attention_same_precision(q, k, v, causal=False, sm_scale=None):
    """PyTorch's plain attention computed in the inputs' own dtype: the 2x rule's baseline.

    Same conventions as ``course_lib.reference.attention`` (GQA, bottom-right causal, rows that
    see no key give 0), but every op runs in q's dtype, as a naive PyTorch user would get.
    """
    from course_lib.reference import causal_mask, expand_kv

    H, N_q, D = q.shape[1], q.shape[2], q.shape[3]
    N_k = k.shape[2]
    scale = D ** -0.5 if sm_scale is None else sm_scale
    k, v = expand_kv(k, H), expand_kv(v, H)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(N_q, N_k, s.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all -inf rows: NaN -> 0
    return torch.matmul(p, v)


def variants_same_precision(q, k, v, **variants):
    """``reference.attention_variants`` with every op in the inputs' own dtype (scores, cap, bias,
    softmax and P·V): the 2x rule's baseline for the variants' kernels."""
    from course_lib.reference import attention_variants

    return attention_variants(q, k, v, compute_dtype=q.dtype, **variants)


def check_extreme_logits(o, q, k, v, causal, sm_scale, atol, gap=16.0):
    """The check for huge logits (sm_scale ~ 1e4), where softmax is all but one-hot.

    There a score is q·k times 1e4, so fp32 rounding in q·k moves it by far more than one unit,
    and in a row whose two largest scores nearly tie, any two correct implementations may weigh
    the two keys differently. A fixed tolerance on every row is therefore flaky on fresh random
    inputs. Checked instead: every output is finite and inside the convex hull of V's rows
    (softmax weights are >= 0 and sum to 1); and rows whose top-two score gap exceeds ``gap``
    (well-conditioned) equal the fp32 reference within ``atol``. Returns how many rows were
    compared with the reference.

    Why gap = 16: a score error δ moves the output by about e^(-gap)·|v₁ - v₂|·δ. The fp32 error
    of a 32-term q·k is bounded by 32·u·Σ|q_i k_i|, about 6e-5 for unit normal rows, so δ reaches
    about 0.6 once scaled by 1e4, in the kernel and in the reference alike. Below 1e-4 then needs
    gap >= 12 (a gap of 10 let one CI run reach 1.4e-4); 16 leaves a margin. At this scale the
    gaps of random rows are in the thousands, so nearly every row is compared.
    """
    from course_lib.reference import attention, causal_mask, expand_kv

    assert torch.isfinite(o).all(), "non-finite output for extreme logits"
    H, N_q, N_k = q.shape[1], q.shape[2], k.shape[2]
    kk, vv = expand_kv(k.double(), H), expand_kv(v.double(), H)
    s = torch.matmul(q.double(), kk.transpose(-1, -2)) * sm_scale  # (B, H, N_q, N_k)
    if causal:
        s = s.masked_fill(~causal_mask(N_q, N_k, s.device), float("-inf"))
    visible = torch.isfinite(s)[..., None]  # (B, H, N_q, N_k, 1)
    rows = vv.unsqueeze(2)  # (B, H, 1, N_k, D)
    big = torch.finfo(torch.float64).max
    v_min = torch.where(visible, rows, big).amin(dim=3)  # (B, H, N_q, D)
    v_max = torch.where(visible, rows, -big).amax(dim=3)
    seen = visible.any(3)  # (B, H, N_q, 1)
    od = o.double()
    inside = (od >= v_min - atol) & (od <= v_max + atol)
    assert torch.all(~seen | inside), "an output lies outside the convex hull of V's rows"
    top2 = torch.topk(s, k=min(2, N_k), dim=-1).values
    well = seen[..., 0] & ((top2[..., 0] - top2[..., -1] > gap) if N_k > 1 else True)
    ref = attention(q, k, v, causal=causal, sm_scale=sm_scale)
    err = (od - ref.double()).abs().amax(-1)  # (B, H, N_q)
    assert torch.all(err[well] <= atol), f"max error {err[well].max():.3e} > {atol:g}"
    return int(well.sum())
