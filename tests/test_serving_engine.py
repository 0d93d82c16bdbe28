"""course_lib.serving: the scheduler (pure Python) and the engine that runs it through a model.

The scheduler, with a stand-in model whose next token is a function of the whole sequence: the
token budget, decodes before prefill chunks, a long prompt split over steps, arrivals and the
running limit, prefix blocks shared by hash (reference counts, counted as computed, chained
names, the last prompt token always recomputed), eviction of cached blocks, preemption of the
newest request and its recomputation, and every block free at the end.

The engine: its attention function against an fp64 reference over the pages (2x rule; the
pages poisoned with NaN past each request's keys), then greedy tokens identical to
``model.generate``'s with eager attention, request by request, for tiny random-weight LLaMA,
Mistral (sliding window) and Gemma 2 (window, softcap, scaling): requests of random lengths
arriving at random steps, some sharing a prefix longer than a block, prefills chunked by a small
token budget, and a pool small enough to force preemptions. GPT-OSS's sinks are refused.
"""
import collections
import random
import types

import pytest
import torch

from course_lib import DEVICE
from course_lib.serving.scheduler import (
    FINISHED,
    RUNNING,
    WAITING,
    Scheduler,
    block_hash,
)

# ------------------------------------------------------------------------------ scheduler


def fake_next(tokens) -> int:
    """A stand-in model: the next token is a function of every token before it."""
    return sum(i * t for i, t in enumerate(tokens, 1)) % 97


def run_fake(s: Scheduler, check=None, max_steps=1000) -> dict:
    """Run the scheduler to the end with ``fake_next``; ``check(s, batch)`` sees every batch."""
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        batch = s.step()
        if check:
            check(s, batch)
        s.update(batch, [fake_next(c.request.tokens) for c in batch.chunks if c.samples])
    assert not s.has_unfinished()
    return {r.request_id: r.output for r in s.requests.values()}


def expected(s: Scheduler) -> dict:
    """What ``run_fake`` must give: each request decoded alone."""
    out = {}
    for r in s.requests.values():
        tokens = list(r.prompt)
        for _ in range(r.max_new_tokens):
            tokens.append(fake_next(tokens))
        out[r.request_id] = tokens[len(r.prompt):]
    return out


def random_requests(s: Scheduler, n, seed=0, shared_every=3):
    rng = random.Random(seed)
    shared = [rng.randrange(100) for _ in range(2 * s.block_size + 3)]
    for i in range(n):
        prompt = [rng.randrange(100) for _ in range(rng.randint(3, 40))]
        if i % shared_every == 0:
            prompt = shared + prompt[:rng.randint(1, 8)]
        s.add_request(prompt, rng.randint(1, 8), arrival_step=rng.randint(0, 12))


def assert_all_free(s: Scheduler):
    """Every block free, or held by the prefix cache alone (and free once it is cleared)."""
    a = s.allocator
    if s.cache is not None:
        assert a.num_free + len(s.cache) == a.num_blocks
        assert s.num_available_blocks() == a.num_blocks
        s.cache.clear()
    assert a.num_free == a.num_blocks and len(s.cache or ()) == 0


def check_batch(s: Scheduler, batch):
    """The invariants of every step."""
    n = sum(c.num_tokens for c in batch.chunks)
    assert 0 < n <= s.max_tokens_per_step or (n == 0 and not s.waiting and not s.running)
    assert len(s.running) <= s.max_running
    kinds = [c.is_decode for c in batch.chunks]
    assert kinds == sorted(kinds, reverse=True), "decodes come first"
    if not all(kinds):  # a prefill chunk got tokens: no decoding request was left out
        scheduled = {c.request_id for c in batch.chunks}
        assert all(r.request_id in scheduled for r in s.running if r.is_decoding)
    for c in batch.chunks:
        assert c.request.arrival_step <= batch.step and c.request.state == RUNNING
        assert c.start == c.request.num_computed
        assert len(c.block_table) * s.block_size >= c.num_keys  # room for what it writes
    assert len(set(batch.slot_mapping(s.block_size))) == n  # no two tokens share a slot
    assert batch.sample_indices == [batch.cu_seqlens_q[i + 1] - 1
                                    for i, c in enumerate(batch.chunks) if c.samples]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workload_budget_decodes_first_and_all_free(prefix_caching):
    s = Scheduler(num_blocks=40, block_size=4, max_tokens_per_step=16, max_running=5,
                  prefix_caching=prefix_caching)
    random_requests(s, 16)
    out = run_fake(s, check_batch)
    assert out == expected(s)
    assert all(r.state == FINISHED and r.finish_step is not None for r in s.requests.values())
    records = s.history
    assert max(r.prefill_tokens + r.decode_tokens for r in records) == 16
    assert any(r.prefill_tokens and r.decode_tokens for r in records)  # mixed steps
    assert sum(r.decode_tokens for r in records) > 0
    assert (sum(r.num_cached_tokens for r in s.requests.values()) > 0) == prefix_caching
    assert_all_free(s)


def test_chunked_prefill_splits_a_long_prompt():
    s = Scheduler(num_blocks=16, block_size=4, max_tokens_per_step=16)
    r = s.add_request(list(range(40)), max_new_tokens=3)
    chunks = []
    while s.has_unfinished():
        batch = s.step()
        (c,) = batch.chunks
        chunks.append((c.start, c.num_tokens, c.is_decode, c.samples))
        assert c.positions == list(range(c.start, c.start + c.num_tokens))
        assert c.token_ids == r.tokens[c.start:c.start + c.num_tokens]
        s.update(batch, [7] if c.samples else [])
    assert chunks == [(0, 16, False, False), (16, 16, False, False), (32, 8, False, True),
                      (40, 1, True, True), (41, 1, True, True)]
    assert r.output == [7, 7, 7] and r.finish_step == 4


def test_decodes_first_then_prefill_fills_the_budget():
    s = Scheduler(num_blocks=32, block_size=4, max_tokens_per_step=8)
    a = s.add_request(list(range(5)), max_new_tokens=5)
    b = s.add_request(list(range(30, 36)), max_new_tokens=5)
    s.update(batch := s.step(), [1])  # a: 5 tokens; b's first 3
    assert [(c.request_id, c.num_tokens) for c in batch.chunks] == [(a.request_id, 5),
                                                                    (b.request_id, 3)]
    c = s.add_request(list(range(50, 70)), max_new_tokens=2, arrival_step=1)
    batch = s.step()  # a decodes, b finishes its prompt (3), c takes what is left (4)
    assert [(x.request_id, x.num_tokens, x.is_decode) for x in batch.chunks] == [
        (a.request_id, 1, True), (b.request_id, 3, False), (c.request_id, 4, False)]
    s.update(batch, [2, 3])
    batch = s.step()  # a and b decode; c's chunk fills the rest
    assert [(x.request_id, x.num_tokens) for x in batch.chunks] == [
        (a.request_id, 1), (b.request_id, 1), (c.request_id, 6)]
    rec = s.history[-1]
    assert (rec.prefill_tokens, rec.decode_tokens) == (6, 2)
    assert rec.chunks == ((a.request_id, "decode", 1), (b.request_id, "decode", 1),
                          (c.request_id, "prefill", 6))


def test_arrivals_and_running_limit():
    s = Scheduler(num_blocks=32, block_size=4, max_tokens_per_step=64, max_running=2)
    late = s.add_request([1, 2, 3], 2, arrival_step=3)
    early = [s.add_request([4, 5, 6, 7, 8], 4) for _ in range(3)]
    batch = s.step()
    assert [c.request for c in batch.chunks] == early[:2]  # the third waits for a place
    assert s.history[-1].num_waiting == 1
    s.update(batch, [fake_next(c.request.tokens) for c in batch.chunks])
    assert run_fake(s, check_batch) == expected(s)
    first_step = {rid: min(h.step for h in s.history if rid in [c[0] for c in h.chunks])
                  for rid in s.requests}
    assert first_step[late.request_id] >= 3
    assert first_step[early[2].request_id] == early[0].finish_step + 1


def test_static_batching_admits_only_between_batches():
    """The baseline: a batch is formed (its prefills), then nothing joins until it is done."""
    s = Scheduler(num_blocks=64, block_size=4, max_tokens_per_step=64, max_running=2,
                  static=True)
    short, long_ = s.add_request([1, 2, 3], 1), s.add_request([4, 5, 6], 6)
    late = s.add_request([7, 8], 2, arrival_step=1)
    assert run_fake(s, check_batch) == expected(s)
    joined = {rid: min(h.step for h in s.history if rid in [c[0] for c in h.chunks])
              for rid in s.requests}
    assert short.finish_step < long_.finish_step
    assert joined[late.request_id] == long_.finish_step + 1  # not at short's free slot
    continuous = Scheduler(num_blocks=64, block_size=4, max_tokens_per_step=64, max_running=2)
    for r in (short, long_, late):
        continuous.add_request(r.prompt, r.max_new_tokens, r.arrival_step)
    run_fake(continuous)
    assert len(continuous.history) < len(s.history)
    # a token budget smaller than the batch's prompts: the batch still fills, over steps
    s = Scheduler(num_blocks=64, block_size=4, max_tokens_per_step=4, max_running=3,
                  static=True)
    reqs = [s.add_request([i + 1] * 5, 3 + i) for i in range(4)]
    assert run_fake(s, check_batch) == expected(s)
    joined = {rid: min(h.step for h in s.history if rid in [c[0] for c in h.chunks])
              for rid in s.requests}
    assert max(joined[r.request_id] for r in reqs[:3]) <= 4  # the batch of three
    assert joined[reqs[3].request_id] == max(r.finish_step for r in reqs[:3]) + 1


def test_prefix_blocks_are_shared_and_count_as_computed():
    s = Scheduler(num_blocks=32, block_size=4, max_tokens_per_step=64)
    a = s.add_request(list(range(10)), max_new_tokens=4)
    s.update(s.step(), [99])  # a's prompt: blocks 0 and 1 are full, named, cached
    assert len(s.cache) == 2 and a.block_hashes[0] == block_hash(None, range(4))
    assert a.block_hashes[1] == block_hash(a.block_hashes[0], range(4, 8))
    b = s.add_request(list(range(8)) + [50, 51, 52], 2, arrival_step=1)
    batch = s.step()
    (chunk,) = [c for c in batch.chunks if c.request is b]
    assert b.block_table[:2] == a.block_table[:2]
    for block in a.block_table[:2]:
        assert s.allocator.refcount(block) == 3  # a, b and the cache
    assert b.num_cached_tokens == 8 and (chunk.start, chunk.token_ids) == (8, [50, 51, 52])
    assert chunk.positions == [8, 9, 10] and chunk.samples
    # the same block after another prefix is another block: the names are chained
    e = s.add_request([9, 9, 9, 9] + list(range(4, 8)) + [1], 1, arrival_step=1)
    assert s._cached_prefix(e) == []
    run_fake(s)
    assert all(s.allocator.refcount(blk) == 1 for blk in s.cache._blocks.values())
    assert_all_free(s)


@pytest.mark.parametrize("n_prompt, start", [(8, 4), (9, 8), (7, 4), (3, 0)])
def test_the_last_prompt_token_is_always_computed(n_prompt, start):
    """A prompt found whole in the cache still runs its last token: the step needs its logit.
    A prompt of exactly two cached blocks recomputes the second one (only full blocks that
    end before the last token are shared)."""
    s = Scheduler(num_blocks=32, block_size=4, max_tokens_per_step=64)
    s.add_request(list(range(12)), max_new_tokens=1)
    s.update(s.step(), [5])  # finished: its three full blocks stay cached
    assert len(s.cache) == 3
    r = s.add_request(list(range(n_prompt)), max_new_tokens=1, arrival_step=1)
    (chunk,) = s.step().chunks
    assert r.num_cached_tokens == start == chunk.start
    assert chunk.num_keys == n_prompt and chunk.samples and chunk.num_tokens >= 1


def test_cached_blocks_are_evicted_least_recently_used_first():
    s = Scheduler(num_blocks=6, block_size=4, max_tokens_per_step=64)
    a = s.add_request(list(range(9)), max_new_tokens=1)  # blocks 0, 1 full, block 2 not
    s.update(s.step(), [0])
    b = s.add_request(list(range(20, 29)), max_new_tokens=1, arrival_step=1)
    s.update(s.step(), [0])
    assert len(s.cache) == 4 and s.allocator.num_free == 2 and s.num_available_blocks() == 6
    # a new request needing 4 blocks: 2 free ones, then the two least recently used cached
    # blocks (a's, tail first), and b's prefix survives
    s.add_request(list(range(40, 53)), max_new_tokens=1, arrival_step=2)
    s.update(s.step(), [0])
    assert s.cache.get(b.block_hashes[0]) is not None and s.cache.get(b.block_hashes[1])
    assert s.cache.get(a.block_hashes[0]) is None and s.cache.get(a.block_hashes[1]) is None
    assert_all_free(s)


def test_preemption_frees_the_newest_and_recomputes_it():
    s = Scheduler(num_blocks=4, block_size=4, max_tokens_per_step=16, prefix_caching=False)
    a = s.add_request(list(range(6)), max_new_tokens=8)
    b = s.add_request(list(range(10, 16)), max_new_tokens=8)
    preempted_at = None

    def check(s, batch):
        nonlocal preempted_at
        check_batch(s, batch)
        if batch.preempted and preempted_at is None:
            preempted_at = batch.step
            assert batch.preempted == [b.request_id]  # the most recently admitted
            assert b.state == WAITING and b.block_table == [] and b.num_computed == 0
            assert s.waiting[0] is b and b.num_preemptions == 1
            assert s.allocator.num_free == 4 - len(a.block_table)
            assert [c.request for c in batch.chunks] == [a]
        if b.num_preemptions and any(c.request is b for c in batch.chunks):
            (c,) = [c for c in batch.chunks if c.request is b]
            if c.start == 0:  # recomputed from its tokens: prompt and generated alike
                assert c.token_ids == b.tokens[:c.num_tokens] and b.output
                assert c.num_tokens == b.num_tokens

    out = run_fake(s, check)
    assert preempted_at is not None and out == expected(s)
    assert_all_free(s)


def test_preemption_under_pressure_keeps_the_tokens_right():
    s = Scheduler(num_blocks=12, block_size=4, max_tokens_per_step=16, max_running=6)
    random_requests(s, 12, seed=1)
    out = run_fake(s, check_batch)
    assert sum(r.num_preemptions for r in s.requests.values()) > 0
    assert out == expected(s)
    assert_all_free(s)


def test_bad_requests_and_updates_are_refused():
    s = Scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        s.add_request([], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add_request([1], 0)
    with pytest.raises(ValueError, match="more than the pool"):
        s.add_request(list(range(16)), 2)
    s.add_request(list(range(15)), 2, request_id="x")  # 16 tokens of cache: fits exactly
    with pytest.raises(ValueError, match="taken"):
        s.add_request([1], 1, request_id="x")
    batch = s.step()
    with pytest.raises(ValueError, match="next_tokens"):
        s.update(batch, [])
    s.update(batch, [1])
    with pytest.raises(ValueError, match="once, in order"):
        s.update(batch, [1])
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        Scheduler(4, max_tokens_per_step=0)


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def serving():
    pytest.importorskip("transformers", reason="transformers (the course's [hf] extra) is missing")
    from course_lib.hf import capstone
    from course_lib.serving import engine

    return types.SimpleNamespace(engine=engine, capstone=capstone)


def _pages_reference(q, k_pages, v_pages, tables, starts, n_qs, dtype, **variants):
    """Each request's queries against its keys gathered from the pages, in ``dtype``."""
    from course_lib.reference import attention_variants
    from course_lib.testing import variants_same_precision

    attend = attention_variants if dtype == torch.float64 else variants_same_precision
    outs, row = [], 0
    bs = k_pages.shape[1]
    for table, start, n_q in zip(tables, starts, n_qs):
        n_k = start + n_q
        idx = torch.tensor(table)[torch.arange(n_k) // bs] * bs + torch.arange(n_k) % bs
        k = k_pages.flatten(0, 1)[idx].transpose(0, 1)[None].to(dtype)  # (1, H_kv, n_k, D)
        v = v_pages.flatten(0, 1)[idx].transpose(0, 1)[None].to(dtype)
        qb = q[row:row + n_q].transpose(0, 1)[None].to(dtype)  # (1, H, n_q, D)
        outs.append(attend(qb, k, v, causal=True, **variants)[0].transpose(0, 1))
        row += n_q
    return torch.cat(outs)  # (N, H, D)


@pytest.mark.parametrize("window, softcap", [(None, 0.0), (5, 0.0), (None, 2.0), (3, 2.0)])
def test_attention_function_writes_the_pages_and_matches_the_reference(serving, window,
                                                                       softcap):
    from course_lib.testing import assert_close_2x, fresh_randn

    E = serving.engine
    bs, num_blocks, H, H_kv, D = 4, 12, 4, 2, 16
    tables = [[3, 7, 1, 10], [0, 5, 9], [11, 2]]  # pages in no order
    starts, n_qs = [6, 9, 0], [5, 1, 7]  # a chunk after a cache, a decode, a first chunk
    k_pages = torch.full((num_blocks, bs, H_kv, D), float("nan"), device=DEVICE)  # poison
    v_pages = torch.full_like(k_pages, float("nan"))
    for table, start in zip(tables, starts):  # the cached keys, before this step
        for p in range(start):
            k_pages[table[p // bs], p % bs] = fresh_randn(H_kv, D, seed=p)
            v_pages[table[p // bs], p % bs] = fresh_randn(H_kv, D, seed=100 + p)
    N = sum(n_qs)
    q = fresh_randn(1, H, N, D, seed=1)
    k, v = fresh_randn(1, H_kv, N, D, seed=2), fresh_randn(1, H_kv, N, D, seed=3)
    slots = [t[p // bs] * bs + p % bs for t, s0, n in zip(tables, starts, n_qs)
             for p in range(s0, s0 + n)]
    cu_q, cu_k = [0], [0]
    for s0, n in zip(starts, n_qs):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + s0 + n)
    table = torch.full((3, 4), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)

    def ints(x, dtype=torch.int32):
        return torch.tensor(x, dtype=dtype, device=DEVICE)

    step = E.PagedStep([k_pages], [v_pages], ints(slots, torch.int64), table.to(DEVICE),
                       ints(cu_q), ints(cu_k), max(n_qs), max(cu_k[i + 1] - cu_k[i]
                                                              for i in range(3)))
    variants = {"window_size": (window - 1, 0) if window else (-1, -1), "softcap": softcap}
    out, weights = E.paged_attention_forward(
        types.SimpleNamespace(layer_idx=0), q, k, v, None, scaling=0.3, paged_step=step,
        sliding_window=window, softcap=softcap or None)
    assert weights is None and out.shape == (1, N, H, D)
    flat = k_pages.flatten(0, 1)
    assert torch.equal(flat[slots], k[0].transpose(0, 1))  # this step's rows, in their slots
    assert torch.equal(v_pages.flatten(0, 1)[slots], v[0].transpose(0, 1))
    q_rows = q[0].transpose(0, 1)  # (N, H, D)
    ref = _pages_reference(q_rows, k_pages, v_pages, tables, starts, n_qs, torch.float64,
                           sm_scale=0.3, **variants)
    base = _pages_reference(q_rows, k_pages, v_pages, tables, starts, n_qs, torch.float32,
                            sm_scale=0.3, **variants)
    assert_close_2x(out[0].double(), ref, base.double(), name=f"window {window} cap {softcap}")


def _workload(n_requests, seed, block_size, vocab):
    """Prompts of 3..40 tokens (every third one after a shared prefix longer than two blocks),
    1..8 new tokens, arrival steps 0..10."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(2 * block_size + 5)]
    requests = []
    for i in range(n_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 40))]
        if i % 3 == 0:
            prompt = shared + prompt[:rng.randint(1, 10)]
        requests.append((prompt, rng.randint(1, 8), rng.randint(0, 10)))
    return requests


def _serve_and_compare(serving, monkeypatch, family, n_requests, seed=0, num_blocks=128,
                       block_size=8, max_tokens_per_step=16, max_running=6,
                       prefix_caching=True):
    cap = serving.capstone
    calls = []

    def counted(*args, **kwargs):  # every attention call of the engine is the course's op
        calls.append(kwargs["block_table"].shape[0])
        return op(*args, **kwargs)

    op = serving.engine.flash_attn_varlen
    monkeypatch.setattr(serving.engine, "flash_attn_varlen", counted)
    model = cap.make_llama(cap.small_config(family), attn_implementation="eager")
    requests = _workload(n_requests, seed, block_size, model.config.vocab_size)
    expected = [cap.greedy(model, torch.tensor([p], device=DEVICE), m)[0].tolist()
                for p, m, _ in requests]  # each request alone, eager attention
    engine = serving.engine.Engine(model, num_blocks=num_blocks, block_size=block_size,
                                   max_tokens_per_step=max_tokens_per_step,
                                   max_running=max_running, prefix_caching=prefix_caching)
    ids = [engine.add_request(p, m, arrival_step=a) for p, m, a in requests]
    out = engine.run()
    for i, (p, m, a) in enumerate(requests):
        assert out[ids[i]] == expected[i], (
            f"{family}: request {i} (prompt {len(p)} tokens, arrives at step {a}): engine "
            f"{out[ids[i]]}, generate {expected[i]}")
    s = engine.scheduler
    steps = [rec for rec in s.history if rec.chunks]
    assert calls == [len(rec.chunks) for rec in steps
                     for _ in range(model.config.num_hidden_layers)]  # one call a layer a step
    prefill_steps = collections.Counter(rid for rec in s.history
                                        for rid, kind, _ in rec.chunks if kind == "prefill")
    assert max(prefill_steps.values()) > 1, "no prefill was chunked"
    assert any(rec.prefill_tokens and rec.decode_tokens for rec in s.history)
    assert_all_free(s)
    return s


def test_engine_tokens_equal_generate_llama(serving, monkeypatch):
    s = _serve_and_compare(serving, monkeypatch, "llama", 16)
    shared = [r for r in s.requests.values() if r.num_cached_tokens >= 2 * s.block_size]
    assert len(shared) >= 2  # later requests of the shared prefix found its blocks
    assert max(len(s.requests[rid].prompt) for rid in s.requests) > s.max_tokens_per_step
    arrivals = {r.arrival_step for r in s.requests.values()}
    assert len(arrivals) > 3


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_engine_tokens_equal_generate_window_and_softcap(serving, monkeypatch, family):
    s = _serve_and_compare(serving, monkeypatch, family, 6, seed=1)
    assert any(r.num_cached_tokens for r in s.requests.values())


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_engine_tokens_equal_generate_with_preemptions(serving, monkeypatch, prefix_caching):
    s = _serve_and_compare(serving, monkeypatch, "llama", 6, seed=2, num_blocks=14,
                           block_size=4, max_running=4, prefix_caching=prefix_caching)
    assert sum(r.num_preemptions for r in s.requests.values()) > 0


def test_engine_refuses_sinks(serving):
    cap = serving.capstone
    model = cap.make_llama(cap.small_config("gpt_oss"), attn_implementation="eager")
    engine = serving.engine.Engine(model, num_blocks=8, block_size=4)
    engine.add_request([1, 2, 3], 2)
    with pytest.raises(NotImplementedError, match="sinks"):
        engine.run()


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_an_8bit_cache_against_the_models_own(serving, kv_dtype):
    """The same requests through two engines in lockstep, the model's fp32 cache and an 8-bit
    one (a scale per token and head): the logits' largest difference while the tokens agree,
    and how many greedy tokens agree, printed and bounded."""
    cap = serving.capstone
    model = cap.make_llama(cap.small_config("llama"), attn_implementation="eager")
    requests = _workload(8, 3, 8, model.config.vocab_size)
    engines = [serving.engine.Engine(model, num_blocks=64, block_size=8, max_tokens_per_step=16,
                                     max_running=6, kv_dtype=dtype)
               for dtype in (None, kv_dtype)]
    for engine in engines:
        for p, m, a in requests:
            engine.add_request(p, m, arrival_step=a)
    def outputs(e):
        return {r.request_id: list(r.output) for r in e.scheduler.requests.values()}

    errors = []
    while engines[0].scheduler.has_unfinished() and outputs(engines[0]) == outputs(engines[1]):
        batches = [engine.step() for engine in engines]  # the same histories, the same steps
        if batches[0].sample_indices:
            errors.append((engines[1].logits - engines[0].logits).abs().max().item())
    for engine in engines:
        engine.run()
    outs = [outputs(e) for e in engines]
    same = sum(a == b for rid in outs[0] for a, b in zip(outs[0][rid], outs[1][rid]))
    total = sum(len(o) for o in outs[0].values())
    print(f"{kv_dtype}: logits' largest difference {max(errors):.3f} over {len(errors)} steps; "
          f"greedy tokens agree {same} of {total}")
    assert max(errors) < (0.1 if kv_dtype == torch.int8 else 0.5)
    assert same >= 0.8 * total
