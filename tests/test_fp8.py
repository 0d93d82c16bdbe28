"""course_lib.fp8: FP8 attention's rounding, emulated (lesson 09, section 7)."""
import pytest
import torch

from course_lib.fp8 import (
    E4M3,
    E4M3_MAX,
    attention_lowp,
    error_table,
    fake_quantize,
    load_table,
    random_rotation,
)
from course_lib.reference import attention


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_e4m3_rounding_is_within_half_a_step_and_the_scale_reaches_448():
    x = _randn(2, 3, 97, 40)
    for per_tensor, block in ((True, None), (False, 16)):
        r = fake_quantize(x, E4M3, block, per_tensor)
        rel = ((r - x) / x).abs()
        assert float(rel[x.abs() > 1e-2].max()) <= 2 ** -4
    # one scale per 16 rows of each (batch, head): every block's largest |x| lands on 448 exactly
    blocks = torch.nn.functional.pad(x, (0, 0, 0, 112 - 97)).reshape(2, 3, 7, 16, 40)
    scale = blocks.abs().amax(dim=(-2, -1), keepdim=True) / E4M3_MAX
    q8 = (blocks / scale).to(E4M3).double()
    assert torch.equal(q8.abs().amax(dim=(-2, -1)), torch.full((2, 3, 7), E4M3_MAX,
                                                                dtype=torch.float64))
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(fake_quantize(x, dtype), x.to(dtype).double())
    with pytest.raises(ValueError, match="block"):
        fake_quantize(x, E4M3)


def test_random_rotation_is_orthogonal_and_leaves_qk_unchanged():
    for d in (1, 2, 64, 128):
        m = random_rotation(d, seed=3)
        assert float((m @ m.T - torch.eye(d, dtype=torch.float64)).abs().max()) < 1e-12
    q, k = _randn(50, 64, seed=1), _randn(70, 64, seed=2)
    m = random_rotation(64)
    assert float((q @ k.T - (q @ m) @ (k @ m).T).abs().max()) < 1e-10
    assert not torch.equal(random_rotation(64, seed=0), random_rotation(64, seed=1))
    # FlashAttention-3's order, signs then Hadamard: a row of ones spreads (H alone would send
    # it to one entry of sqrt(d)), and another seed changes the magnitudes, hence the rounding
    ones = torch.ones(1, 128, dtype=torch.float64)
    assert float((ones @ random_rotation(128)).abs().max()) < 8  # H alone: one entry of 11.3
    a, b = (ones @ random_rotation(128, seed=s) for s in (0, 1))
    assert not torch.equal(a.abs().sort().values, b.abs().sort().values)
    with pytest.raises(ValueError, match="d must be a power of two"):
        random_rotation(80)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(37, 37), (17, 45), (45, 17)])
def test_nothing_rounded_is_exact_attention(causal, n_q, n_k):
    q, k, v = _randn(1, 2, n_q, 32, seed=1), _randn(1, 2, n_k, 32, seed=2), _randn(1, 2, n_k, 32,
                                                                                  seed=3)
    out = attention_lowp(q, k, v, causal=causal, rounded="")
    ref = attention(q, k, v, causal=causal)  # rows that see no key: 0 in both
    assert float((out - ref).abs().max()) < 1e-12
    # rotating changes nothing but the rounding
    rot = attention_lowp(q, k, v, causal=causal, rotate=True, rounded="")
    assert float((rot - ref).abs().max()) < 1e-12


def test_rounding_costs_what_the_format_says():
    q, k, v = (_randn(1, 2, 64, 32, seed=s) for s in (1, 2, 3))
    ref = attention(q, k, v, causal=True)
    err = {name: float((attention_lowp(q, k, v, dtype, causal=True) - ref).abs().max())
           for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("e4m3", E4M3))}
    print(err)
    assert err["fp16"] < err["bf16"] < err["e4m3"] < 0.2
    with pytest.raises(ValueError, match="rounded"):
        attention_lowp(q, k, v, rounded="qx")


def test_the_stored_table_is_what_the_code_computes():
    stored, fresh = load_table(), error_table()
    assert stored["shape"] == fresh["shape"]
    for group in ("schemes", "parts"):
        assert stored[group].keys() == fresh[group].keys()
        for name, errs in fresh[group].items():
            for kind, err in errs.items():
                assert stored[group][name][kind] == pytest.approx(err, rel=1e-6), (name, kind)


def test_what_lesson_09_says_of_the_table():
    s = load_table()["schemes"]
    block, tensor = s["fp8, one scale per block"], s["fp8, one scale per tensor"]
    rotated = s["fp8, per block + rotation"]
    for kind in block:
        assert 8 < block[kind] / s["bf16"][kind] < 30  # about an order of magnitude above bf16
        assert 0.8 < tensor[kind] / block[kind] < 1.25  # the scale's granularity changes little
    assert 0.9 < block["normal"] / rotated["normal"] < 1.1  # no outliers: nothing to spread
    assert block["outliers"] / rotated["outliers"] > 1.2
    assert block["outlier channels"] / rotated["outlier channels"] > 1.5
    parts = load_table()["parts"]
    for kind in ("outliers", "outlier channels"):
        assert parts["q and k only"][kind] > max(parts["v only"][kind], parts["p only"][kind])
