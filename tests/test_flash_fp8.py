"""The FP8 forward (kernels.flash_fp8, ops.flash_attn_fp8) against the exact emulation of what
it rounds (course_lib.fp8.attention_lowp with the kernel's blocks) and the fp32 reference:
its error is the model's, on odd lengths, N_q != N_k, GQA, causal, with and without the
rotation; poisoned outputs; the e4m3 rounding; bad input named."""
import pytest
import torch

from course_lib import ops
from course_lib._device import DEVICE
from course_lib.fp8 import E4M3, attention_lowp, fake_quantize, rms_error
from course_lib.kernels import flash_fp8
from course_lib.reference import attention
from course_lib.testing import fresh_randn, poison_

SHAPES = [  # B, H, H_kv, N_q, N_k, D
    (1, 2, 2, 37, 37, 64),
    (2, 4, 2, 20, 45, 64),   # GQA, a chunk of new queries against a longer cache
    (1, 2, 1, 50, 23, 64),   # N_q > N_k: causal rows that see no key
    (1, 2, 2, 33, 33, 128),
]


def _inputs(B, H, H_kv, N_q, N_k, D, dtype=torch.float32):
    return (fresh_randn(B, H, N_q, D, dtype=dtype), fresh_randn(B, H_kv, N_k, D, dtype=dtype),
            fresh_randn(B, H_kv, N_k, D, dtype=dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_the_error_is_the_emulations(shape, causal, rotate):
    B, H, H_kv, N_q, N_k, D = shape
    q, k, v = _inputs(*shape)
    x = flash_fp8.prepare_fp8(q, k, v, rotate=rotate, seed=3)
    out = (poison_(torch.empty(B, H, N_q, D, device=q.device)),
           poison_(torch.empty(B, H, N_q, device=q.device)))
    o, lse = flash_fp8.forward_fp8(x, causal, D ** -0.5, torch.float32, out=out)
    g = H // H_kv
    kr, vr = (t.repeat_interleave(g, 1).double() for t in (k, v))
    ref = attention(q.double(), kr, vr, causal=causal)
    block_m, block_n = flash_fp8.fp8_blocks(D)
    model = attention_lowp(q, kr, vr, causal=causal, block_m=block_m, block_n=block_n,
                           rotate=rotate, seed=3)
    err, model_err = rms_error(o, ref), rms_error(model, ref)
    print(f"rms error {err:.3e}, the emulation's {model_err:.3e}")
    assert err <= 1.25 * model_err
    assert rms_error(o, model) <= 0.5 * model_err  # the same roundings, not just as large
    # the lse of the scores the kernel multiplies: of its e4m3 q and k times their scales
    def dequantized(t8, scale, block):
        return t8.double() * scale.double().repeat_interleave(block, -1)[..., :t8.shape[2], None]

    qq = dequantized(x.q, x.q_scale, block_m)
    kq = dequantized(x.k, x.k_scale, block_n).repeat_interleave(g, 1)
    s = qq @ kq.transpose(-1, -2) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(N_q, N_k, dtype=torch.bool, device=s.device)
                          .tril(N_k - N_q).logical_not(), float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "a row that sees no key: lse is -inf"
    assert (lse[seen].double() - ref_lse[seen]).abs().max() < 1e-3  # (a GPU's exp2: 2e-4)
    assert (o[~seen] == 0).all()


def test_p_is_cast_to_e4m3_as_the_hardware_casts():
    """The kernel rounds P · 256 to e4m3 (round to nearest, ties to even) exactly as torch's cast
    does, at every scale down to e4m3's subnormals: the interpreter's own cast does not."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, flash_fp8._e4m3_grid(tl.load(X + offs)).to(tl.float8e4nv))

    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # every value >= 0
    mids = (grid[1:] + grid[:-1]) / 2  # the ties
    rest = 1024 - grid.numel() - mids.numel()  # (tl.arange: a power of two in all)
    x = torch.cat([grid, mids, fresh_randn(rest // 2, device="cpu").abs() * 100,
                   fresh_randn(rest - rest // 2, device="cpu").abs() * 0.01])
    x = x.to(DEVICE)
    y = torch.empty(x.numel(), dtype=E4M3, device=DEVICE)
    cast[(1,)](x, y, x.numel())
    assert torch.equal(y.float(), x.to(E4M3).float())


def test_block_quantization_is_the_models():
    x = fresh_randn(2, 3, 45, 64) * 3
    x8, scale = flash_fp8.to_e4m3_blocks(x, 16)
    assert x8.dtype == E4M3 and scale.shape == (2, 3, 3)
    back = x8.double() * scale.double().repeat_interleave(16, -1)[..., :45, None]
    model = fake_quantize(x, E4M3, block=16)
    assert (back - model).abs().max() <= 2 ** -4 * x.abs().max()  # at most a rounding apart
    assert (back - x.double()).abs().max() <= 2 ** -4 * x.abs().max()


def test_the_public_call_checks_and_returns_q_dtype():
    q, k, v = _inputs(1, 2, 1, 20, 20, 64, dtype=torch.float16)
    o, lse = ops.flash_attn_fp8(q, k, v, causal=True, return_lse=True)
    assert o.dtype == torch.float16 and o.shape == q.shape and lse.shape == (1, 2, 20)
    ref = attention(q.double(), k.repeat_interleave(2, 1).double(),
                    v.repeat_interleave(2, 1).double(), causal=True)
    assert rms_error(o, ref) < 0.05
    with pytest.raises(ValueError, match="head dim 32"):
        ops.flash_attn_fp8(*_inputs(1, 2, 1, 20, 20, 32))
    with pytest.raises(TypeError, match="causal"):
        ops.flash_attn_fp8(q, k, v, causal=1)


@pytest.mark.gpu
def test_the_gpus_own_cast_rounds_as_the_kernel_assumes():
    """On a GPU the kernel casts P with the hardware's conversion alone: it must round to
    nearest, ties to even, as torch's cast and ``_e4m3_grid`` do."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs).to(tl.float8e4nv))

    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2,
                   fresh_randn(1024 - 253, device="cpu").abs() * 50])
    x = x.to(DEVICE)
    y = torch.empty(x.numel(), dtype=E4M3, device=DEVICE)
    cast[(1,)](x, y, x.numel())
    assert torch.equal(y.float(), x.to(E4M3).float())


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_a_gpu_shape_against_the_emulation(D, causal):
    """Blocks of the GPU's tiles (``FP8_CONFIGS``), N 1000 (a ragged last tile), GQA."""
    q, k, v = _inputs(2, 8, 2, 1000, 1000, D, dtype=torch.float16)
    o = ops.flash_attn_fp8(q, k, v, causal=causal)
    kr, vr = (t.repeat_interleave(4, 1).double() for t in (k, v))
    ref = attention(q.double(), kr, vr, causal=causal)
    block_m, block_n = flash_fp8.fp8_blocks(D)
    model = attention_lowp(q.cpu(), kr.cpu(), vr.cpu(), causal=causal, block_m=block_m,
                           block_n=block_n, rotate=True)
    err, model_err = rms_error(o.cpu(), ref.cpu()), rms_error(model, ref.cpu())
    print(f"rms error {err:.3e}, the emulation's {model_err:.3e}")
    assert err <= 1.25 * model_err and rms_error(o.cpu(), model) <= 0.5 * model_err
