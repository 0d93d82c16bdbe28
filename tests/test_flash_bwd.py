"""FlashAttention-2 backward (course_lib.kernels.flash_bwd) against fp64 autograd, 2x rule.

The kernel's gradients must be within twice the error that PyTorch's own attention makes in the
same precision (``attention_same_precision`` under autograd), against an fp64 reference.
"""
import pytest
import torch

import course_lib
from course_lib.kernels import flash_bwd
from course_lib.kernels.flash_bwd import (
    GPU_CONFIGS,
    BwdConfig,
    default_config,
    flash_attn_v2_backward,
)
from course_lib.reference import attention
from course_lib.testing import KERNEL_DTYPES, assert_close_2x, attention_same_precision, fresh_randn

DTYPES = KERNEL_DTYPES

SHAPES = [  # B, H, H_kv, N_q, N_k, D
    (1, 2, 2, 1, 1, 32),
    (2, 2, 1, 17, 17, 16),
    (1, 4, 2, 97, 97, 64),
    (1, 2, 2, 130, 130, 32),
    (1, 4, 2, 17, 130, 32),    # N_q < N_k
    (1, 2, 1, 130, 97, 64),    # N_q > N_k: with causal, the first 33 rows see no key
    (1, 2, 2, 1, 130, 16),
    (1, 2, 2, 130, 1, 16),
]
HEAD_DIM_SHAPES = [(1, 2, 1, 40, 70, 128), (1, 1, 1, 33, 20, 256)]


def _ids(shape):
    return "x".join(map(str, shape))


def _inputs(B, H, H_kv, N_q, N_k, D, dtype):
    q = fresh_randn(B, H, N_q, D, dtype=dtype)
    k = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    v = fresh_randn(B, H_kv, N_k, D, dtype=dtype)
    do = fresh_randn(B, H, N_q, D, dtype=dtype)
    return q, k, v, do


def _grads(fn, q, k, v, do, dtype=None):
    """Gradients of ``fn(q, k, v)`` for output gradient ``do``, with inputs cast to ``dtype``."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    o = out[0] if isinstance(out, tuple) else out
    return out, torch.autograd.grad(o, leaves, do.to(o.dtype))


def _check_grads(got, q, k, v, do, causal, sm_scale=None, label=""):
    """Assert the 2x rule for (dq, dk, dv) against fp64 autograd of the reference."""
    _, ref = _grads(lambda a, b, c: attention(a, b, c, causal=causal, sm_scale=sm_scale),
                    q, k, v, do, torch.float64)
    _, base = _grads(lambda a, b, c: attention_same_precision(a, b, c, causal, sm_scale),
                     q, k, v, do)
    for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert g.dtype == b.dtype and g.shape == r.shape, (name, g.dtype, g.shape)
        assert not torch.isnan(g).any(), f"{name} has NaN (an element never written?)"
        # The floor is one ulp of the largest gradient in the stored dtype: at fp16 and a few
        # hundred elements, torch's own max error can be that small by luck (it failed the
        # rule once in 1,350 gradients with a floor of 1e-5, while the mean errors were equal).
        floor = max(1e-5, torch.finfo(g.dtype).eps * r.abs().max().item())
        assert_close_2x(g, r, b, name=f"{label}{name}", atol=floor)


def _saved_forward(q, k, v, causal, sm_scale=None):
    """O (in q's dtype) and the fp32 lse from the reference: the backward's saved inputs."""
    o, lse = attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    return o.to(q.dtype), lse.float()


# ---------------------------------------------------------------------------------------------
# the backward kernels on their own (o and lse from the reference)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_backward_matches_autograd(shape, causal, dtype, poisoned_allocations):
    q, k, v, do = _inputs(*shape, dtype)
    o, lse = _saved_forward(q, k, v, causal)
    got = flash_attn_v2_backward(do, q, k, v, o, lse, causal, shape[-1] ** -0.5)
    _check_grads(got, q, k, v, do, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", HEAD_DIM_SHAPES, ids=_ids)
def test_large_head_dims(shape, causal):
    q, k, v, do = _inputs(*shape, DTYPES[-1])
    o, lse = _saved_forward(q, k, v, causal)
    _check_grads(flash_attn_v2_backward(do, q, k, v, o, lse, causal, shape[-1] ** -0.5),
                 q, k, v, do, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [40, 72, 80, 96, 112, 160, 192, 256])
def test_any_head_dim_multiple_of_8(D, causal, poisoned_allocations):
    """Odd lengths and GQA at head dims that are multiples of 8, most not powers of two."""
    q, k, v, do = _inputs(1, 4, 2, 37, 53, D, DTYPES[-1])
    o, lse = _saved_forward(q, k, v, causal)
    _check_grads(flash_attn_v2_backward(do, q, k, v, o, lse, causal, D ** -0.5),
                 q, k, v, do, causal, label=f"D={D}")


CONFIGS = [  # odd block shapes: the stage boundaries must not depend on the table's choices
    BwdConfig(16, 32, 32, 16, 1, 4, 1, 4, 1, block_pre=16),
    BwdConfig(64, 32, 16, 64, 4, 4, 1, 4, 1, block_pre=32),
    BwdConfig(32, 128, 128, 32, 2, 4, 1, 4, 1),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.block_m1}-{c.block_n1}-"
                         f"{c.block_m2}-{c.block_n2}-f{c.mask_factor}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_q,n_k", [(97, 130), (130, 97), (64, 64), (1, 33), (64, 128),
                                     (128, 64)])
def test_other_block_configs(config, causal, n_q, n_k, poisoned_allocations):
    q, k, v, do = _inputs(1, 2, 1, n_q, n_k, 16, torch.float32)
    o, lse = _saved_forward(q, k, v, causal, sm_scale=0.3)
    got = flash_attn_v2_backward(do, q, k, v, o, lse, causal, 0.3, config=config)
    _check_grads(got, q, k, v, do, causal, sm_scale=0.3)


def _ragged_rows(n_q, n_k, block_m, block_n, mask_block_m, causal):
    """The rows the dK/dV kernel's ragged-end loop would visit, for every key block: its bounds
    computed as the kernel computes them."""
    q_offset, rows = n_k - n_q, 0
    for start_n in range(0, n_k, block_n):
        m_lo = m_full = 0
        if causal:
            m_lo = min(max(start_n - q_offset, 0), n_q)
            m_all = min(max(start_n + block_n - 1 - q_offset, 0), n_q)
            m_full = m_lo + -(-(m_all - m_lo) // mask_block_m) * mask_block_m
        m_tail = m_full + max(n_q - m_full, 0) // block_m * block_m
        rows += max(n_q - m_tail, 0)
    return rows


def test_dkdv_compiles_out_its_ragged_end_only_where_it_is_empty():
    """EVEN_M (the heuristic ``_no_ragged_rows``) drops the ragged-end loop: it may only do so where
    that loop would visit no row, for every shape, block and causal offset."""
    seen = {True: 0, False: 0}
    for block_m, block_n, factor in [(16, 32, 1), (32, 64, 2), (32, 128, 2), (64, 64, 2),
                                     (64, 128, 4), (64, 32, 4)]:
        for n_q in range(1, 200, 7):
            for n_k in range(1, 200, 11):
                for causal in (False, True):
                    args = dict(N_Q=n_q, N_K=n_k, BLOCK_M=block_m, BLOCK_N=block_n,
                                CAUSAL=causal)
                    even = flash_bwd._no_ragged_rows(args)
                    seen[even] += 1
                    if even:
                        assert _ragged_rows(n_q, n_k, block_m, block_n, block_m // factor,
                                            causal) == 0, args
    assert seen[True] and seen[False]


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_group_split_over_programs(splits, causal, poisoned_allocations):
    """dK/dV of a group summed in ``splits`` programs (fp32 partials) equals one program's."""
    q, k, v, do = _inputs(2, 8, 2, 70, 90, 32, DTYPES[-1])
    o, lse = _saved_forward(q, k, v, causal)
    got = flash_attn_v2_backward(do, q, k, v, o, lse, causal, 32 ** -0.5, splits=splits)
    _check_grads(got, q, k, v, do, causal)
    with pytest.raises(ValueError, match="splits"):
        flash_attn_v2_backward(do, q, k, v, o, lse, causal, 32 ** -0.5, splits=3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,splits", [((1, 4, 2, 97, 130, 32), None),
                                          ((1, 2, 1, 130, 97, 40), None),
                                          ((2, 8, 2, 70, 90, 16), 2)],
                         ids=["gqa", "padded-d", "split-group"])
def test_one_pass_matches_autograd(shape, splits, causal, poisoned_allocations):
    """``one_pass``: dQ added by the dK/dV kernel (atomic adds), no dQ kernel; GQA, ragged
    lengths, a padded head dim, a group split over programs."""
    q, k, v, do = _inputs(*shape, DTYPES[-1])
    o, lse = _saved_forward(q, k, v, causal)
    got = flash_attn_v2_backward(do, q, k, v, o, lse, causal, shape[-1] ** -0.5, splits=splits,
                                 one_pass=True)
    _check_grads(got, q, k, v, do, causal, label="one pass ")


def test_rows_that_see_no_key_get_zero_gradient():
    """Bottom-right causal with N_q > N_k: rows i < N_q - N_k see nothing (lse = -inf)."""
    q, k, v, do = _inputs(1, 2, 2, 50, 20, 16, torch.float32)
    o, lse = _saved_forward(q, k, v, True)
    assert torch.isinf(lse[..., :30]).all()
    dq, dk, dv = flash_attn_v2_backward(do, q, k, v, o, lse, True, 0.25)
    assert torch.equal(dq[:, :, :30], torch.zeros_like(dq[:, :, :30]))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_large_logits_do_not_overflow():
    """Scores near a hundred: P is recomputed as exp2(s·log2e - lse·log2e), never exp(s).

    Recomputing from the lse costs accuracy at such scores: s and lse are each rounded to fp32
    (relative 6e-8 of ~100), so P carries a relative error of ~1e-5 that torch's softmax, which
    subtracts the row max exactly, does not. So this test asks for finite gradients within a
    relative error of 1e-4 rather than the 2x rule.
    """
    q, k, v, do = _inputs(1, 2, 2, 45, 77, 32, torch.float32)
    q = q * 20
    for causal in (False, True):
        o, lse = _saved_forward(q, k, v, causal)
        assert lse.abs().max() > 50
        got = flash_attn_v2_backward(do, q, k, v, o, lse, causal, 32 ** -0.5)
        _, ref = _grads(lambda a, b, c: attention(a, b, c, causal=causal), q, k, v, do,
                        torch.float64)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            rel = ((g.double() - r).norm() / r.norm()).item()
            print(f"{name}: relative error {rel:.2e}")
            assert torch.isfinite(g).all() and rel < 1e-4, name


def test_backward_input_errors():
    q, k, v, do = _inputs(1, 2, 1, 8, 8, 16, torch.float32)
    o, lse = _saved_forward(q, k, v, False)
    with pytest.raises(ValueError, match="do"):
        flash_attn_v2_backward(do[:, :, :4], q, k, v, o, lse, False, 0.25)
    with pytest.raises(ValueError, match="lse"):
        flash_attn_v2_backward(do, q, k, v, o, lse[:, :1], False, 0.25)
    with pytest.raises(ValueError, match="heads"):
        flash_attn_v2_backward(do, q, k.expand(1, 3, 8, 16), v.expand(1, 3, 8, 16), o, lse,
                               False, 0.25)
    with pytest.raises(ValueError, match="power of two"):
        flash_attn_v2_backward(do, q, k, v, o, lse, False, 0.25,
                               config=BwdConfig(24, 32, 32, 16, 1, 4, 1, 4, 1))
    with pytest.raises(ValueError, match="mask_factor"):
        flash_attn_v2_backward(do, q, k, v, o, lse, False, 0.25,
                               config=BwdConfig(16, 32, 32, 16, 2, 4, 1, 4, 1))


def test_every_head_dim_has_a_named_gpu_config():
    from course_lib.validate import HEAD_DIMS

    for d in HEAD_DIMS:  # D 80 runs D 128's tiles: the config of the padded dim
        flash_bwd.gpu_config(d).check()
    assert default_config(64) == (flash_bwd.INTERPRETER_CONFIG if course_lib.INTERPRET
                                  else GPU_CONFIGS[64])


def test_autotune_lists_keep_three_valid_configs_per_head_dim():
    for d in (16, 32, 64, 128, 256):
        for configs, mask in ((flash_bwd.DKDV_CONFIGS, "MASK_BLOCK_M"),
                              (flash_bwd.DQ_CONFIGS, "MASK_BLOCK_N")):
            kept = flash_bwd.keep_bwd_config_for_head_dim(configs, {"HEAD_DIM": d})
            assert len(kept) == 3
            for c in kept:
                blocks = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs[mask])
                assert all(b >= 16 and b & (b - 1) == 0 for b in blocks), (d, c)
                streamed = c.kwargs["BLOCK_M"] if mask == "MASK_BLOCK_M" else c.kwargs["BLOCK_N"]
                assert c.kwargs[mask] <= streamed


@pytest.mark.skipif(not course_lib.INTERPRET, reason="bf16 is refused only in the interpreter")
def test_bf16_refused_in_interpreter():
    q, k, v, do = _inputs(1, 1, 1, 4, 4, 16, torch.float32)
    o, lse = _saved_forward(q, k, v, False)
    with pytest.raises(TypeError, match="bfloat16"):
        flash_attn_v2_backward(do.bfloat16(), q.bfloat16(), k.bfloat16(), v.bfloat16(),
                               o.bfloat16(), lse, False, 0.25)


# ---------------------------------------------------------------------------------------------
# end to end: flash_attn_v2 is differentiable
# ---------------------------------------------------------------------------------------------
E2E_SHAPES = [(1, 2, 2, 17, 17, 32), (1, 4, 2, 97, 130, 64), (1, 2, 1, 130, 97, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", E2E_SHAPES, ids=_ids)
def test_flash_attn_v2_is_differentiable(shape, causal, dtype):
    from course_lib.ops import flash_attn_v2

    q, k, v, do = _inputs(*shape, dtype)
    (o, lse), got = _grads(lambda a, b, c: flash_attn_v2(a, b, c, causal=causal,
                                                         return_lse=True), q, k, v, do)
    assert o.grad_fn is not None and not lse.requires_grad  # the lse is not differentiable
    _check_grads(got, q, k, v, do, causal, label="flash_attn_v2 ")


def test_flash_attn_v2_grad_of_a_loss_and_no_grad_paths():
    """A scalar loss through O (non-contiguous dO from .sum()), and inputs without grad."""
    from course_lib.ops import flash_attn_v2

    q, k, v, _ = _inputs(1, 2, 1, 33, 40, 32, torch.float32)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attn_v2(qg, kg, vg, causal=True).sum().backward()
    do = torch.ones(1, 2, 33, 32, device=q.device)
    _check_grads((qg.grad, kg.grad, vg.grad), q, k, v, do, True)

    kg2 = k.clone().requires_grad_()  # only k needs a gradient
    (dk,) = torch.autograd.grad(flash_attn_v2(q, kg2, v).sum(), (kg2,))
    k64 = k.double().requires_grad_()
    (dk_ref,) = torch.autograd.grad(attention(q.double(), k64, v.double()).sum(), (k64,))
    torch.testing.assert_close(dk.double(), dk_ref, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        assert flash_attn_v2(qg, kg, vg).grad_fn is None


# ---------------------------------------------------------------------------------------------
# gradcheck in float64 (interpreter): reference forward, Triton backward
# ---------------------------------------------------------------------------------------------
class _ReferenceForwardTritonBackward(torch.autograd.Function):
    """The fp64 reference as forward (finite differences need fp64 all the way; the forward
    kernel accumulates in fp32) and the Triton backward kernels, run in fp64, as backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_v2_backward(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


@pytest.mark.skipif(not course_lib.INTERPRET, reason="fp64 tl.dot is checked in the interpreter")
@pytest.mark.parametrize("n_q,n_k,h,h_kv", [(5, 7, 2, 1), (7, 3, 1, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_float64(n_q, n_k, h, h_kv, causal):
    gen = torch.Generator().manual_seed(n_q * 10 + n_k + causal)
    q = torch.randn(1, h, n_q, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, h_kv, n_k, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, h_kv, n_k, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: _ReferenceForwardTritonBackward.apply(a, b, c, causal, 0.3),
        (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


# ---------------------------------------------------------------------------------------------
# GPU: real sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_long_sequences(D, causal, dtype):
    from course_lib.ops import flash_attn_v2

    q, k, v, do = _inputs(2, 4, 2, 1000, 1537, D, dtype)
    _, got = _grads(lambda a, b, c: flash_attn_v2(a, b, c, causal=causal), q, k, v, do)
    _check_grads(got, q, k, v, do, causal, label=f"D={D} ")


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_autotuned_path(D, causal):
    """N >= AUTOTUNE_MIN_N: the autotuned kernels (every candidate runs while tuning)."""
    q, k, v, do = _inputs(1, 4, 2, 2100, 2049, D, torch.float16)
    o, lse = _saved_forward(q, k, v, causal)
    _check_grads(flash_attn_v2_backward(do, q, k, v, o, lse, causal, D ** -0.5),
                 q, k, v, do, causal, label="autotuned ")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_one_pass_autotuned(causal):
    """The one-pass form's autotuner zeroes dQ before every candidate it times."""
    q, k, v, do = _inputs(1, 4, 2, 2100, 2049, 64, torch.float16)
    o, lse = _saved_forward(q, k, v, causal)
    got = flash_attn_v2_backward(do, q, k, v, o, lse, causal, 64 ** -0.5, one_pass=True)
    _check_grads(got, q, k, v, do, causal, label="one pass, autotuned ")


@pytest.mark.gpu
def test_gpu_the_backward_gives_the_same_bits_every_run():
    """The default backward adds nothing atomically: five runs, the same bits."""
    q, k, v, do = _inputs(2, 8, 2, 2100, 2049, 128, torch.float16)
    o, lse = _saved_forward(q, k, v, True)
    first = flash_attn_v2_backward(do, q, k, v, o, lse, True, 128 ** -0.5)
    for _ in range(4):
        again = flash_attn_v2_backward(do, q, k, v, o, lse, True, 128 ** -0.5)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_gpu_function_used_by_flash_attn_v2():
    from course_lib.ops import flash_attn_v2

    q, k, v, _ = _inputs(1, 2, 2, 256, 256, 64, torch.float16)
    q.requires_grad_()
    o = flash_attn_v2(q, k, v)
    assert "course::flash_attn_fwd" in o.grad_fn.name() or "Backward" in type(o.grad_fn).__name__
    dq, = torch.autograd.grad(o.float().sum(), q)
    assert dq.shape == q.shape and torch.isfinite(dq).all()


# ---------------------------------------------------------------------------------------------
# the lesson's exercises: the reference solutions pass their checkers, stubs get a hint
# ---------------------------------------------------------------------------------------------
def test_exercise_solutions_pass_their_checkers(capsys):
    from course_lib.exercises import backward as ex

    assert ex.check_attention_backward(ex.attention_backward_solution)
    assert ex.check_delta(ex.delta_solution)
    assert ex.check_standard_backward_elements(ex.standard_backward_elements_solution)
    assert ex.check_delta_kernel(ex._delta_solution)
    assert ex.check_dkdv(ex._dkdv_solution)

    def stub(*args):
        raise NotImplementedError

    for checker in (ex.check_attention_backward, ex.check_delta,
                    ex.check_standard_backward_elements):
        assert checker(stub).status == "todo"
    for checker, kernel in ((ex.check_delta_kernel, ex.delta_kernel),
                            (ex.check_dkdv, ex.dkdv_kernel)):
        assert checker(kernel).status == "todo"
        assert not checker(stub)  # a Python function is not a kernel
    assert not ex.check_delta(lambda o, do: (o * do).sum(-2))  # wrong axis: a message, no crash
    assert "Nudge" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# python -m course_lib.bench memory
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(course_lib.DEVICE == "cuda", reason="checks the CPU message")
def test_memory_benchmark_needs_a_gpu():
    from course_lib.bench import memory

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        memory.main(["--seq-lens", "128"])


def test_memory_table_and_figure_from_a_result():
    from course_lib.bench import memory

    rows = [{"N": n, "B": 1, "H": 2, "D": 16, "causal": False,
             **memory.predicted_bytes(1, 2, n, 16),
             "results": {"sdpa-MATH": {"peak_bytes": 3 * n * n, "saved_bytes": n * n},
                         "flash_attn_v2": None if n > 512 else {"peak_bytes": 90 * n,
                                                                "saved_bytes": 40 * n}}}
            for n in (256, 512, 1024)]
    result = {"dtype": "fp16", "providers": ["sdpa-MATH", "flash_attn_v2"], "rows": rows}
    text = memory.table(result)
    assert "flash_attn_v2 peak" in text and text.count("\n") == 4
    fig = memory.plot_memory(result)
    assert len(fig.axes[0].lines) == 5  # 2 providers x (peak, kept) + the P line


@pytest.mark.gpu
def test_gpu_memory_flash_keeps_no_n_squared_matrix():
    from course_lib.bench import memory

    math_ = memory.measure("sdpa-MATH", 1, 4, 2048, 64)
    ours = memory.measure("flash_attn_v2", 1, 4, 2048, 64)
    p_bytes = memory.predicted_bytes(1, 4, 2048, 64)["p_bytes"]
    assert math_["saved_bytes"] >= p_bytes  # MATH keeps P (at least) for the backward
    assert ours["saved_bytes"] < p_bytes / 4 and ours["peak_bytes"] < math_["peak_bytes"]
