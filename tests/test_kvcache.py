"""The paged KV-cache manager, waste simulation, prompt sharing, FlashDecoding++'s unified max."""
import numpy as np
import pytest
import torch

from course_lib import kvcache, unified_max
from course_lib.exercises import decode as ex
from course_lib.kvcache import (
    BlockAllocator,
    OutOfBlocks,
    PagedKVCache,
    Workload,
    pages_to_contiguous,
    sampling_memory,
    sampling_saving,
    simulate_serving,
)
from course_lib.ops import flash_decode, paged_decode
from course_lib.testing import fresh_randn

# ------------------------------------------------------------------------------ allocator


def test_allocator_free_list_and_refcounts():
    a = BlockAllocator(3)
    blocks = [a.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and a.num_free == 0
    with pytest.raises(OutOfBlocks):
        a.allocate()
    a.incref(blocks[1])
    a.decref(blocks[1])
    assert a.num_free == 0 and a.refcount(blocks[1]) == 1
    a.decref(blocks[1])
    assert a.num_free == 1 and a.refcount(blocks[1]) == 0
    assert a.allocate() == blocks[1]  # the freed block is reused
    with pytest.raises(ValueError, match="not in"):
        a.decref(99)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def test_allocator_rejects_freeing_a_free_block():
    a = BlockAllocator(2)
    b = a.allocate()
    a.decref(b)
    with pytest.raises(ValueError, match="is free"):
        a.decref(b)


def test_sequences_grow_block_by_block():
    c = PagedKVCache(10, block_size=4)
    c.add_sequence("a")
    c.extend("a", n=9)
    assert c.length("a") == 9 and len(c.blocks("a")) == 3
    assert c.slot("a", 8) == (c.blocks("a")[2], 0)
    assert c.usage()["tokens"] == 9 and c.usage()["allocated_slots"] == 12
    with pytest.raises(IndexError):
        c.slot("a", 9)
    c.free("a")
    assert c.allocator.num_free == 10


def test_fork_shares_and_copy_on_write_copies_only_the_partial_block():
    c = PagedKVCache(20, block_size=4)
    c.add_sequence(0)
    c.extend(0, n=6)  # blocks: [full, half]
    c.fork(0, 1)
    c.fork(0, 2)
    assert c.blocks(1) == c.blocks(0) and c.allocator.num_used == 2
    assert all(c.allocator.refcount(b) == 3 for b in c.blocks(0))
    c.append(1)  # writes into the shared half block: copy
    assert c.cow_copies == 1 and c.blocks(1)[0] == c.blocks(0)[0]
    assert c.blocks(1)[1] != c.blocks(0)[1]
    c.append(2)  # still shared by 0 and 2: copy again
    c.append(0)  # now private to 0: written in place
    assert c.cow_copies == 2 and c.allocator.refcount(c.blocks(0)[1]) == 1
    assert c.allocator.refcount(c.blocks(0)[0]) == 3  # the full block stays shared
    for s in (0, 1, 2):
        c.free(s)
    assert c.allocator.num_free == 20


def test_blocks_needed_counts_the_copy():
    c = PagedKVCache(4, block_size=4)
    c.add_sequence(0)
    c.extend(0, n=2)
    c.fork(0, 1)
    assert c.blocks_needed(0, 1) == 1  # a copy of the shared block
    assert c.blocks_needed(0, 3) == 2  # the copy and one more block
    c.extend(1, n=2)
    assert c.blocks_needed(0, 1) == 0  # 1 copied: block 0 is private again


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_stored_kv_with_copy_on_write_runs_through_paged_decode(dtype):
    """Parallel samples share a prompt; paged_decode on the manager's pages equals
    flash_decode on each sample's contiguous K/V."""
    H, H_kv, D, bs = 4, 2, 32, 16
    cache = PagedKVCache(24, block_size=bs, num_kv_heads=H_kv, head_dim=D, dtype=dtype)
    prompt_k = fresh_randn(37, H_kv, D, dtype=dtype)
    prompt_v = fresh_randn(37, H_kv, D, dtype=dtype)
    cache.add_sequence("p")
    cache.extend("p", prompt_k, prompt_v)
    samples = ["s0", "s1", "s2"]
    own = {}
    for i, s in enumerate(samples):
        cache.fork("p", s)
        n = [5, 20, 1][i]
        own[s] = (fresh_randn(n, H_kv, D, dtype=dtype), fresh_randn(n, H_kv, D, dtype=dtype))
        cache.extend(s, *own[s])
    cache.free("p")
    assert cache.cow_copies == 3  # every sample copied the prompt's partial third block
    table, lens = cache.block_table(samples), cache.seqlens(samples)
    assert table.dtype == torch.int32 and lens.tolist() == [42, 57, 38]
    q = fresh_randn(3, H, 1, D, dtype=dtype)
    o_paged = paged_decode(q, cache.k_pages, cache.v_pages, table, lens)
    n_max = int(lens.max())
    k = torch.zeros(3, H_kv, n_max, D, dtype=dtype, device=q.device)
    v = torch.zeros_like(k)
    for b, s in enumerate(samples):
        seq_k = torch.cat([prompt_k, own[s][0]])  # (L, H_kv, D)
        seq_v = torch.cat([prompt_v, own[s][1]])
        k[b, :, :seq_k.shape[0]] = seq_k.transpose(0, 1)
        v[b, :, :seq_v.shape[0]] = seq_v.transpose(0, 1)
    assert torch.equal(pages_to_contiguous(cache.k_pages, table, lens), k)
    o_flash = flash_decode(q, k, v, lens)
    torch.testing.assert_close(o_paged, o_flash, atol=0, rtol=0)


def test_storing_cache_needs_k_and_v():
    c = PagedKVCache(2, block_size=4, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    c.add_sequence(0)
    with pytest.raises(ValueError, match="needs k and v"):
        c.append(0)


# ------------------------------------------------------------------------------ simulations

@pytest.fixture(scope="module")
def serving():
    w = Workload(n_requests=300)
    return {p: simulate_serving(p, w) for p in kvcache.POLICIES}


def test_contiguous_max_len_reservation_wastes_most_of_the_cache(serving):
    r = serving["max_len"]
    print(f"max_len: {r.utilization:.1%} of allocated memory holds tokens; "
          f"pool while full {r.pool_breakdown()}")
    assert 0.20 <= r.utilization <= 0.38  # the vLLM paper's range for existing systems
    assert 0.20 <= r.pool_breakdown()["tokens"] <= 0.38


def test_paging_wastes_under_four_percent(serving):
    r = serving["paged"]
    print(f"paged: waste {r.waste:.2%}, pool while full {r.pool_breakdown()}")
    assert r.waste < 0.04
    assert r.pool_breakdown()["tokens"] > 0.94


def test_paging_runs_bigger_batches_and_finishes_sooner(serving):
    batch = {p: r.mean_batch for p, r in serving.items()}
    assert batch["paged"] > batch["oracle"] > batch["max_len"]
    assert serving["paged"].steps < serving["max_len"].steps
    for r in serving.values():  # breakdown adds up
        assert r.token_steps + r.reserved_steps + r.internal_steps == r.allocated_steps


def test_workload_is_stated_and_bounded():
    w = Workload(n_requests=1000)
    p, o = w.sample()
    assert (p >= 1).all() and (o >= 1).all() and (p + o <= w.max_len).all()
    assert 100 < np.median(p) < 200 and 150 < np.median(o) < 350
    assert np.array_equal(w.sample()[0], p)  # seeded
    with pytest.raises(ValueError, match="policy"):
        simulate_serving("buddy", w)


def test_sharing_a_prompt_saves_memory():
    m = sampling_memory(100, [50, 50, 50, 50])
    assert (m["separate_blocks"], m["shared_blocks"], m["cow_copies"]) == (40, 22, 3)
    s = sampling_saving(Workload(n_requests=200), n_samples=4)
    print(s)
    assert 0.2 < s["saving"] < 0.75
    assert sampling_saving(Workload(n_requests=200), n_samples=1)["saving"] == 0.0


# ------------------------------------------------------------------------------ exercises

def test_exercise_solutions_pass_their_checkers():
    assert ex.check_kv_cache_bytes(ex.kv_cache_bytes_solution)
    assert ex.check_merge_partials(ex.merge_partials_solution)
    assert ex.check_physical_slot(ex.physical_slot_solution)
    assert ex.check_shared_blocks(ex.shared_blocks_solution)


def test_exercise_stubs_read_not_done_yet(capsys):
    def stub(*args):
        raise NotImplementedError

    for checker in (ex.check_kv_cache_bytes, ex.check_merge_partials,
                    ex.check_physical_slot, ex.check_shared_blocks):
        assert not checker(stub)
    out = capsys.readouterr().out
    assert out.count("not done yet") == 4 and "Nudge" not in out  # no hint before an attempt


def test_kv_cache_bytes_solution_agrees_with_the_iomodel():
    """The exercise's configs give the model shapes of lesson 11's table, byte for byte."""
    from course_lib.iomodel import decode as io

    for name, config in (("Llama-3-8B", "meta-llama/Meta-Llama-3-8B"),
                         ("Llama-2-13B", "meta-llama/Llama-2-13b-hf"),
                         ("Llama-2-70B", "meta-llama/Llama-2-70b-hf")):
        assert ex.kv_cache_bytes_solution(ex.CONFIGS[config], 4096, 3) == \
            io.kv_cache_bytes(io.MODELS[name], 4096, batch=3)
    opt = ex.kv_cache_bytes_solution(ex.CONFIGS["facebook/opt-13b"], 1)
    assert opt == io.VLLM_OPT13B_BYTES  # the vLLM paper's 800 KB per token


def test_shared_blocks_solution_agrees_with_the_manager():
    rng = np.random.default_rng(0)
    for _ in range(200):
        prompt = int(rng.integers(1, 80))
        outs = [int(x) for x in rng.integers(0, 40, int(rng.integers(1, 5)))]
        assert ex.shared_blocks_solution(prompt, outs) == sampling_memory(prompt, outs)[
            "shared_blocks"]


def test_physical_slot_solution_agrees_with_the_manager():
    c = PagedKVCache(30, block_size=16)
    c.add_sequence(0)
    c.add_sequence(1)
    for _ in range(3):  # interleave two sequences so their blocks are not in order
        c.extend(0, n=16)
        c.extend(1, n=16)
    for pos in (0, 15, 16, 47):
        assert ex.physical_slot_solution(c.blocks(1), pos) == c.slot(1, pos)


# ------------------------------------------------------------------------------ unified max

def test_unified_max_equals_the_synchronized_merge_when_in_range():
    rng = np.random.default_rng(0)
    s = rng.standard_normal(1000) * 3
    v = rng.standard_normal((1000, 8))
    want, lse = unified_max.synchronized_split_attention(s, v, 1)
    p = np.exp(s - s.max())
    np.testing.assert_allclose(want, p @ v / p.sum(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, s.max() + np.log(p.sum()))
    for n_splits in (1, 4, 7):
        o, fell_back = unified_max.unified_max_attention(s, v, phi=8.0, n_splits=n_splits,
                                                         dtype=np.float32)
        assert not fell_back
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
        o16, fell_back = unified_max.unified_max_attention(s, v, phi=8.0, n_splits=n_splits)
        assert not fell_back and np.abs(o16 - want).max() < 2e-3  # fp16 exponentials


def test_unified_max_falls_back_outside_the_window():
    rng = np.random.default_rng(1)
    s = rng.standard_normal(500) * 3
    v = rng.standard_normal((500, 4))
    want, _ = unified_max.synchronized_split_attention(s, v, 3)
    lo, hi = unified_max.safe_window(np.float16)
    for phi in (s.max() - hi - 1, s.max() - lo + 1):  # overflow, then underflow
        o, fell_back = unified_max.unified_max_attention(s, v, phi=phi, n_splits=3)
        assert fell_back
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12)
    with np.errstate(over="ignore"):  # what the fallback prevents: e^{x-φ} overflows in fp16
        assert not np.isfinite(np.exp((s - (s.max() - hi - 1)).astype(np.float16))).all()
    assert unified_max.fallback_rate(5.0) == 0.0
    assert unified_max.fallback_rate(-20.0) == 1.0


def test_figures_draw():
    from matplotlib.figure import Figure

    for mod in (kvcache, unified_max):
        for name, make in mod.FIGURES.items():
            assert name.startswith("13_")
            assert isinstance(make(), Figure)
