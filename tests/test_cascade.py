"""Cascade attention (ops.cascade): the merge of two partial attentions, and a shared prefix
attended once plus each request's paged suffix, against attention over the whole context."""
import pytest
import torch

from course_lib.kvcache import contiguous_to_pages
from course_lib.ops.cascade import cascade_decode, merge_state
from course_lib.reference import attention, decode_reference
from course_lib.testing import fresh_randn


def test_merge_state_equals_attention_over_both_key_sets():
    q, k, v = fresh_randn(2, 3, 5, 16), fresh_randn(2, 3, 29, 16), fresh_randn(2, 3, 29, 16)
    o_a, lse_a = attention(q, k[:, :, :11], v[:, :, :11], return_lse=True)
    o_b, lse_b = attention(q, k[:, :, 11:], v[:, :, 11:], return_lse=True)
    o, lse = merge_state(o_a, lse_a, o_b, lse_b)
    ref_o, ref_lse = attention(q, k, v, return_lse=True)
    torch.testing.assert_close(o, ref_o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-5)


def test_merge_state_keeps_rows_that_saw_no_key():
    o_a, o_b = fresh_randn(4, 8), fresh_randn(4, 8)
    inf = float("inf")
    lse_a = torch.tensor([0.5, -inf, -inf, 2.0], device=o_a.device)
    lse_b = torch.tensor([-inf, 1.5, -inf, 2.0], device=o_a.device)
    o, lse = merge_state(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o[0], o_a[0])
    torch.testing.assert_close(o[1], o_b[1])
    assert torch.equal(o[2], torch.zeros_like(o[2])) and lse[2] == -inf
    torch.testing.assert_close(o[3], (o_a[3] + o_b[3]) / 2)
    assert not torch.isnan(o).any()


def test_merge_state_names_mismatched_shapes():
    with pytest.raises(ValueError, match="merge_state takes o"):
        merge_state(fresh_randn(4, 8), fresh_randn(4), fresh_randn(4, 8), fresh_randn(3))


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_cascade_equals_attention_over_prefix_and_suffix(n_q, dtype, splits):
    """B requests of suffix lengths 3 to 40 (one of them only its new tokens) after a shared
    48-token prefix (whole, or in 3 chunks merged); GQA 4 heads on 2, D 32; pages of 16 in a
    random order."""
    B, H, H_kv, P, D = 5, 4, 2, 48, 32
    lens = torch.tensor([3, 17, 40, n_q, 25], dtype=torch.int32)
    prefix_k, prefix_v = fresh_randn(H_kv, P, D, dtype=dtype), fresh_randn(H_kv, P, D, dtype=dtype)
    k, v = fresh_randn(B, H_kv, 40, D, dtype=dtype), fresh_randn(B, H_kv, 40, D, dtype=dtype)
    q = fresh_randn(B, H, n_q, D, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    k_pages, table = contiguous_to_pages(k, block_size=16, generator=g)
    v_pages, _ = contiguous_to_pages(v, block_size=16, generator=torch.Generator().manual_seed(3))
    lens = lens.to(q.device)
    o, lse = cascade_decode(q, prefix_k, prefix_v, k_pages, v_pages, table, lens,
                            return_lse=True, num_prefix_splits=splits)
    # the reference: each request's whole context, prefix then suffix, in fp32
    whole_k = torch.cat([prefix_k[None].expand(B, -1, -1, -1), k], dim=2).float()
    whole_v = torch.cat([prefix_v[None].expand(B, -1, -1, -1), v], dim=2).float()
    ref_o, ref_lse = decode_reference(q.float(), whole_k, whole_v, lens + P, return_lse=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(o.float(), ref_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert o.dtype == dtype and o.shape == q.shape


def test_cascade_names_a_bad_prefix():
    q = fresh_randn(2, 4, 1, 16)
    pages = fresh_randn(4, 16, 2, 16)
    table = torch.zeros(2, 1, dtype=torch.int32, device=q.device)
    lens = torch.ones(2, dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match="prefix_k and prefix_v"):
        cascade_decode(q, fresh_randn(2, 8, 16), fresh_randn(2, 9, 16), pages, pages, table, lens)
    with pytest.raises(ValueError, match="must be \\(H_kv, P, D\\)"):
        cascade_decode(q, fresh_randn(3, 8, 16), fresh_randn(3, 8, 16), pages, pages, table, lens)
    with pytest.raises(ValueError, match="must divide the prefix's 8 keys"):
        cascade_decode(q, fresh_randn(2, 8, 16), fresh_randn(2, 8, 16), pages, pages, table, lens,
                       num_prefix_splits=3)


def test_prefix_splits_fill_the_gpu_with_whole_chunks():
    from course_lib.ops import cascade

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cascade, "sm_count", lambda interpret=False: 132)
        assert cascade.prefix_splits(256, 8, 4096) == 8  # 32 programs a chunk: 8 chunks, 256
        assert cascade.prefix_splits(256, 8, 1024) == 4  # chunks of 256 keys at least
        assert cascade.prefix_splits(256, 8, 4095) == 1  # an odd prefix: one chunk
        assert cascade.prefix_splits(8192, 8, 4096) == 1  # rows enough already
