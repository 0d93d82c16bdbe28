"""flash_attn_v1 (FlashAttention v1's loop order) against the fp32 reference, 2x rule."""
import pytest
import torch

import course_lib
from course_lib.iomodel.attention import flash_v1_io
from course_lib.kernels.flash_v1 import (
    _flash_attn_v1_forward,
    allocate_buffers,
    block_sizes,
    flash_attn_v1,
)
from course_lib.reference import attention
from course_lib.testing import (
    KERNEL_DTYPES,
    assert_close_2x,
    attention_same_precision,
    check_extreme_logits,
    fresh_randn,
    poison_,
)

DTYPES = KERNEL_DTYPES
SEQ = (1, 17, 64, 97, 130)
SHAPES = [  # B, H, H_kv, N_q, N_k, D: every N of SEQ, N_q = N_k and N_q != N_k, GQA
    (1, 2, 2, 1, 1, 32),
    (2, 2, 2, 17, 17, 32),
    (1, 4, 2, 64, 64, 64),
    (1, 2, 1, 97, 97, 32),
    (1, 2, 2, 130, 130, 16),
    (1, 2, 2, 17, 130, 64),   # N_q < N_k: new queries against a longer cache
    (1, 4, 1, 130, 97, 32),   # N_q > N_k: causal leaves the first 33 rows with no key
    (2, 2, 2, 64, 1, 32),
    (1, 2, 2, 1, 97, 128),
    (1, 1, 1, 97, 64, 256),
]


def _inputs(B, H, H_kv, N_q, N_k, D, dtype, scale=1.0):
    return (fresh_randn(B, H, N_q, D, dtype=dtype, scale=scale),
            fresh_randn(B, H_kv, N_k, D, dtype=dtype), fresh_randn(B, H_kv, N_k, D, dtype=dtype))


def _run_poisoned(q, k, v, causal, sm_scale=None, **blocks):
    """The kernel with its output *and* its O/l/m scratch filled with NaN beforehand."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    buffers = tuple(poison_(b) for b in allocate_buffers(q))
    return _flash_attn_v1_forward(q, k, v, causal, sm_scale, buffers=buffers, **blocks)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(shape, causal, dtype):
    q, k, v = _inputs(*shape, dtype)
    o = _run_poisoned(q, k, v, causal)
    assert not torch.isnan(o).any(), "an output element was never written (or is NaN)"
    assert_close_2x(o, attention(q, k, v, causal=causal),
                    attention_same_precision(q, k, v, causal=causal), name="O v1")


@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
def test_every_head_dim(D):
    q, k, v = _inputs(1, 2, 1, 45, 70, D, torch.float16)
    for causal in (False, True):
        assert_close_2x(_run_poisoned(q, k, v, causal), attention(q, k, v, causal=causal),
                        attention_same_precision(q, k, v, causal=causal), name=f"D={D}")


@pytest.mark.parametrize("blocks", [(16, 16), (16, 64), (64, 16)])
def test_block_sizes_do_not_change_the_answer(blocks):
    # unequal BLOCK_M and BLOCK_N move the causal block boundaries against each other
    q, k, v = _inputs(1, 2, 2, 97, 83, 32, torch.float32)
    for causal in (False, True):
        o = _run_poisoned(q, k, v, causal, block_m=blocks[0], block_n=blocks[1])
        assert_close_2x(o, attention(q, k, v, causal=causal),
                        attention_same_precision(q, k, v, causal=causal), name=f"{blocks}")


def test_rows_that_see_no_key_are_zero_not_nan():
    q, k, v = _inputs(1, 2, 2, 90, 10, 32, torch.float16)  # 80 blind rows: 2.5 blocks of 32
    o = _run_poisoned(q, k, v, causal=True)
    blind = 90 - 10  # bottom-right: query i sees keys j <= i - 80
    assert torch.all(o[:, :, :blind] == 0)
    assert torch.isfinite(o).all()
    assert_close_2x(o, attention(q, k, v, causal=True),
                    attention_same_precision(q, k, v, causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_logits(dtype):
    q, k, v = _inputs(1, 2, 2, 70, 70, 32, dtype)
    for causal in (False, True):
        o = _run_poisoned(q, k, v, causal, sm_scale=1e4)
        # softmax is all but one-hot: O picks rows of V, up to the output's rounding, except
        # where two scores nearly tie (see course_lib.testing.check_extreme_logits)
        compared = check_extreme_logits(o, q, k, v, causal, 1e4,
                                        atol=2e-3 if dtype != torch.float32 else 1e-4)
        assert compared >= 0.8 * q.shape[1] * q.shape[2]


def test_public_api_defaults_and_strides():
    # (B, N, H, D) storage seen as (B, H, N, D), as Hugging Face models hand it over
    q, k, v = (fresh_randn(1, 37, 2, 64, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    o = flash_attn_v1(q, k, v, causal=True)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert_close_2x(o, attention(q, k, v, causal=True),
                    attention_same_precision(q, k, v, causal=True))
    torch.testing.assert_close(flash_attn_v1(q, k, v, sm_scale=0.3),
                               flash_attn_v1(q.contiguous(), k.contiguous(), v.contiguous(),
                                             sm_scale=0.3), atol=0, rtol=0)


def test_bad_input_names_the_argument():
    q, k, v = _inputs(1, 2, 2, 16, 16, 64, torch.float16)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        flash_attn_v1(q[0], k, v)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attn_v1(q, k.tolist(), v)
    with pytest.raises(ValueError, match="head dim"):
        flash_attn_v1(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_v1(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match="batch"):
        flash_attn_v1(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attn_v1(q, k.float(), v)
    with pytest.raises(ValueError, match="on one device|course's kernels run on"):
        flash_attn_v1(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="multiple of"):
        flash_attn_v1(fresh_randn(1, 3, 16, 64, dtype=torch.float16), k, v)
    with pytest.raises(ValueError, match="not supported"):
        flash_attn_v1(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="sm_scale"):
        flash_attn_v1(q, k, v, sm_scale=-1.0)
    with pytest.raises(TypeError, match="causal"):
        flash_attn_v1(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="q has dtype"):
        flash_attn_v1(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        flash_attn_v1(q, k, v, block_n=24)


@pytest.mark.skipif(not course_lib.INTERPRET, reason="bf16 is refused only in the interpreter")
def test_bf16_refused_in_interpreter():
    q, k, v = _inputs(1, 1, 1, 16, 16, 64, torch.bfloat16)
    with pytest.raises(TypeError, match="q is bfloat16"):
        flash_attn_v1(q, k, v)


def test_traffic_model_matches_the_loops():
    """The IO model's count of this kernel, checked against its defining loop at Figure 2."""
    bm, bn = block_sizes(64, on_gpu=True)[:2]
    B, H, N, d = 64, 16, 1024, 64
    io = flash_v1_io(N, N, d, bm, bn, B, H, 2, kernel_bookkeeping=True)
    steps = (N // bn) * (N // bm)  # every (j, i) pair, per head
    carried = steps - N // bm  # steps after which O, l, m go back to HBM
    q_k_v = steps * bm * d * 2 + 2 * N * d * 2
    state = carried * bm * (d * 4 + 8)  # fp32 O_acc, l, m
    assert io["read_bytes"] == B * H * (q_k_v + state)
    assert io["write_bytes"] == B * H * (state + N * d * 2)
    assert io["hbm_bytes"] > 15 * 4 * B * H * N * d * 2  # >15x the minimum: the lesson's point


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_longer_sequences(dtype, D, causal):
    q, k, v = _inputs(2, 4, 2, 1000 + 17, 1500 + 3, D, dtype)
    o = _run_poisoned(q, k, v, causal)
    assert_close_2x(o, attention(q, k, v, causal=causal),
                    attention_same_precision(q, k, v, causal=causal), name=f"D={D}")


@pytest.mark.gpu
def test_gpu_fp32_and_extreme_logits():
    q, k, v = _inputs(1, 2, 2, 300, 200, 64, torch.float32)
    assert_close_2x(_run_poisoned(q, k, v, True), attention(q, k, v, causal=True),
                    attention_same_precision(q, k, v, causal=True), name="fp32")
    q, k, v = _inputs(1, 2, 2, 300, 200, 64, torch.float16)
    o = _run_poisoned(q, k, v, True, sm_scale=1e4)
    assert torch.isfinite(o).all() and torch.all(o[:, :, :100] == 0)


def test_exercise_solution_passes_its_checker():
    from course_lib.exercises.triton_flash_v1 import check_v1_state_bytes, v1_state_bytes_solution

    assert check_v1_state_bytes(v1_state_bytes_solution)
    assert not check_v1_state_bytes(lambda N, D, block_n: 0)
