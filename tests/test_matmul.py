"""The course's Triton matmul: correct for awkward shapes, clear errors, GPU dtypes."""
import pytest
import torch

import course_lib
from course_lib.kernels.matmul import _gpu_configs, _prune_configs, matmul
from course_lib.testing import assert_close_2x, fresh_randn

# (M, N, K): 1s, primes, shapes that are not multiples of any tile, K smaller than a tile
SHAPES = [(1, 1, 1), (17, 33, 29), (64, 48, 80), (97, 1, 130), (5, 70, 3), (128, 96, 64),
          (33, 65, 17)]


def _check(M, N, K, dtype, seed=0):
    a = fresh_randn(M, K, dtype=dtype, seed=seed)
    b = fresh_randn(K, N, dtype=dtype, seed=seed + 1)
    out = matmul(a, b)
    assert out.shape == (M, N) and out.dtype == dtype and out.device == a.device
    ref = a.double() @ b.double()
    baseline = (a.float() @ b.float()).to(dtype) if dtype != torch.float32 else a @ b
    assert_close_2x(out, ref, baseline, name=f"matmul {M}x{N}x{K} {dtype}",
                    atol=1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_matches_torch(shape, dtype):
    _check(*shape, dtype)


def test_matmul_any_strides():
    a = fresh_randn(40, 30, seed=3).t()          # (30, 40), column-major
    b = fresh_randn(40, 50, seed=4)[:, ::2]      # (40, 25), every other column
    torch.testing.assert_close(matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)


def test_matmul_empty_and_k_zero():
    a = fresh_randn(3, 0, seed=5)
    b = fresh_randn(0, 4, seed=6)
    assert torch.equal(matmul(a, b), torch.zeros(3, 4, device=a.device))
    assert matmul(fresh_randn(0, 5), fresh_randn(5, 2)).shape == (0, 2)


def test_matmul_errors_name_the_argument():
    a = fresh_randn(4, 8)
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        matmul(a, [[1.0]])
    with pytest.raises(ValueError, match="a must have 2 dimensions"):
        matmul(fresh_randn(2, 4, 8), a)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        matmul(a, fresh_randn(7, 3))
    with pytest.raises(TypeError, match="share one dtype"):
        matmul(a, fresh_randn(8, 3, dtype=torch.float16))
    with pytest.raises(TypeError, match="b has dtype torch.int64"):
        matmul(a, torch.ones(8, 3, dtype=torch.int64, device=a.device))


@pytest.mark.skipif(not course_lib.INTERPRET, reason="bf16 is refused only in the interpreter")
def test_bf16_refused_in_interpreter():
    a = fresh_randn(4, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="a is bfloat16"):
        matmul(a, a)


@pytest.mark.skipif(course_lib.DEVICE != "cpu", reason="device check needs CPU mode")
def test_wrong_device_is_refused():
    meta = torch.empty(4, 4, device="meta")
    with pytest.raises(ValueError, match="a is on meta"):
        matmul(meta, meta)


def test_prune_keeps_small_tiles_for_small_problems():
    a = torch.empty(16, 16, dtype=torch.float16)
    kept = _prune_configs(_gpu_configs(), {"M": 16, "N": 16, "K": 16, "a_ptr": a})
    assert kept and all(c.kwargs["BLOCK_M"] <= 32 and c.kwargs["BLOCK_N"] <= 32 for c in kept)
    big = _prune_configs(_gpu_configs(), {"M": 4096, "N": 4096, "K": 4096, "a_ptr": a})
    assert any(c.kwargs["BLOCK_M"] >= 128 for c in big)


GPU_SHAPES = [(512, 512, 512), (1000, 777, 1029), (4096, 4096, 4096), (1, 4096, 4096),
              (4096, 1, 333)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_on_gpu(shape, dtype):
    _check(*shape, dtype, seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_on_gpu_fp32_within_the_dot_product_bound(shape):
    # fp32 on a GPU runs full-precision FMAs ("ieee"), summed in order along K. Its error is
    # that of a sequential sum, a few times cuBLAS's (which sums in a tree), so the check is the
    # classical bound for any summation order (Higham, Accuracy and Stability, §3.1):
    # |error| <= γ_K · (|A|·|B|), γ_K = K·u / (1 - K·u), u = 2^-24.
    M, N, K = shape
    a, b = fresh_randn(M, K, seed=11), fresh_randn(K, N, seed=12)
    out = matmul(a, b)
    ref = a.double() @ b.double()
    u = 2.0 ** -24
    bound = K * u / (1 - K * u) * (a.double().abs() @ b.double().abs())
    err = (out.double() - ref).abs()
    print(f"fp32 {M}x{N}x{K}: max err {err.max().item():.3e}, max err / bound "
          f"{(err / bound).max().item():.3f}, torch's max err "
          f"{((a @ b).double() - ref).abs().max().item():.3e}")
    assert torch.isfinite(out).all()
    assert (err <= bound).all()


def test_grouped_order_is_a_permutation_and_saves_panels():
    from course_lib.kernels.matmul import panels_touched, program_tile

    for pm, pn, g in ((7, 5, 3), (32, 32, 8), (1, 9, 8), (9, 1, 4)):
        tiles = {program_tile(p, pm, pn, g) for p in range(pm * pn)}
        assert tiles == {(i, j) for i in range(pm) for j in range(pn)}
    # 4096² output in 128² tiles, one wave of 132 programs (an H100's SMs)
    assert panels_touched(32, 32, 1, 132) == 37 and panels_touched(32, 32, 8, 132) == 25
