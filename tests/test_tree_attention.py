"""Tree attention in the decode kernel: ``flash_decode`` and ``paged_decode`` with ``tree_mask``.

Speculative decoding verifies a token tree in one step (Miao et al., "SpecInfer", ASPLOS 2024,
section 4.2, https://arxiv.org/abs/2305.09781): the tree's nodes are the last N_q keys of each
sequence's cache, and node i sees every key before them and, of theirs, itself and its
ancestors. The kernel's answer is checked against ``speculative.attention_with_tree`` (fp32) on
contiguous and paged caches, with GQA, trees of several shapes, an empty cache before the tree,
one and two splits; a chain's mask must give the plain causal call's answer bit for bit.
"""
import pytest
import torch

import course_lib
from course_lib.kernels import decode as kd
from course_lib.kvcache import contiguous_to_pages
from course_lib.ops import decode as opd
from course_lib.ops import flash_decode, paged_decode, plan_decode
from course_lib.reference import expand_kv
from course_lib.serving.speculative import (
    TokenTree,
    attention_with_tree,
    tree_attention_mask,
    tree_decode,
    tree_mask,
)
from course_lib.testing import (
    KERNEL_DTYPES,
    assert_close_2x,
    fresh_randn,
    poison_,
    reads_back,
)

DTYPE = KERNEL_DTYPES[-1]  # fp16 on the CPU, bf16 on a GPU
PREFIXES = [0, 5, 33]  # the cached keys before each sequence's tree: none, part of a tile, more

TREES = {  # parents, node by node (parents before children)
    "one": [-1],
    "chain3": [-1, 0, 1],
    "star3": [-1, 0, 0],
    "chain7": [-1, 0, 1, 2, 3, 4, 5],
    "star7": [-1, 0, 0, 0, 0, 0, 0],
    "deep7": [-1, 0, 0, 1, 1, 3, 2],  # two levels of branching, a path of depth 3
}


def _tree(parents) -> TokenTree:
    return TokenTree(list(range(len(parents))), parents)


def _random_tree(n: int, seed: int) -> TokenTree:
    gen = torch.Generator().manual_seed(seed)
    return _tree([-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)])


def _inputs(B, H, H_kv, n, D, prefixes, dtype, seed=0):
    """q (B, H, n, D), caches (B, H_kv, N_max, D) whose sequence b holds prefixes[b] keys and
    then the tree's n (and 3 more unused entries past its length), the lengths."""
    n_max = max(prefixes) + n + 3
    q = fresh_randn(B, H, n, D, dtype=dtype, seed=seed)
    k = fresh_randn(B, H_kv, n_max, D, dtype=dtype, seed=seed + 1)
    v = fresh_randn(B, H_kv, n_max, D, dtype=dtype, seed=seed + 2)
    lens = torch.tensor([p + n for p in prefixes], dtype=torch.int32, device=q.device)
    return q, k, v, lens


def _per_sequence(mask, b):
    return mask if mask.dim() == 2 else mask[b]


def _reference(q, k, v, lens, mask):
    """(o, lse) in fp32: ``attention_with_tree`` per sequence, and the log-sum-exp of the same
    scores under ``tree_attention_mask``."""
    n, D, outs, lses = q.shape[2], q.shape[3], [], []
    for b, length in enumerate(lens.tolist()):
        p, m = length - n, _per_sequence(mask, b).cpu()
        kb, vb = k[b:b + 1].float(), v[b:b + 1].float()
        outs.append(attention_with_tree(q[b:b + 1].float(), kb[:, :, :p], vb[:, :, :p],
                                        kb[:, :, p:length], vb[:, :, p:length], m))
        s = q[b:b + 1].float() @ expand_kv(kb[:, :, :length], q.shape[1]).transpose(-1, -2)
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool), m], dim=1).to(s.device)
        lses.append(torch.logsumexp((s * D ** -0.5).masked_fill(~visible, float("-inf")), -1))
    return torch.cat(outs), torch.cat(lses)  # (B, H, n, D), (B, H, n)


def _same_precision(q, k, v, lens, mask):
    """The same attention with every op in q's dtype: the 2x rule's baseline."""
    n, D, outs = q.shape[2], q.shape[3], []
    for b, length in enumerate(lens.tolist()):
        m = _per_sequence(mask, b).cpu()
        visible = torch.cat([torch.ones(n, length - n, dtype=torch.bool), m], dim=1)
        kb = expand_kv(k[b:b + 1, :, :length], q.shape[1])
        vb = expand_kv(v[b:b + 1, :, :length], q.shape[1])
        s = (q[b:b + 1] @ kb.transpose(-1, -2)) * D ** -0.5
        p = torch.softmax(s.masked_fill(~visible.to(s.device), float("-inf")), -1)
        outs.append(p @ vb)
    return torch.cat(outs)


def _poison(monkeypatch):
    """Every floating-point buffer the calls allocate starts as NaN; no plan is reused."""
    def poisoned(allocate):
        def empty(*args, **kwargs):
            t = allocate(*args, **kwargs)
            return poison_(t) if t.is_floating_point() else t
        return empty

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    opd.forget_plans()


def _paged(k, v, block_size=8):
    k_pages, table = contiguous_to_pages(k, block_size=block_size,
                                         generator=torch.Generator().manual_seed(3))
    v_pages, _ = contiguous_to_pages(v, block_size=block_size,
                                     generator=torch.Generator().manual_seed(3))
    return k_pages, v_pages, table


def _decode(q, k, v, lens, paged, **kw):
    if paged:
        k_pages, v_pages, table = _paged(k, v)
        return paged_decode(q, k_pages, v_pages, table, lens, return_lse=True, **kw)
    return flash_decode(q, k, v, lens, return_lse=True, **kw)


def _check(o, lse, q, k, v, lens, mask, name):
    ref_o, ref_lse = _reference(q, k, v, lens, mask)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    assert not torch.isnan(o).any(), f"{name}: an output element was never written (or is NaN)"
    assert not torch.isnan(lse).any(), f"{name}: an lse element was never written (or is NaN)"
    assert_close_2x(o, ref_o, _same_precision(q, k, v, lens, mask), name=f"{name} O")
    assert_close_2x(lse, ref_lse, ref_lse, name=f"{name} lse", atol=1e-4)


# ------------------------------------------------------------------------ against the reference

@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("shape", list(TREES))
def test_a_tree_matches_attention_with_tree(shape, paged, num_splits, monkeypatch):
    """GQA (4 heads on 2), three sequences with 0, 5 and 33 cached keys before the tree."""
    mask = tree_mask(_tree(TREES[shape]))
    q, k, v, lens = _inputs(3, 4, 2, mask.shape[0], 16, PREFIXES, DTYPE)
    _poison(monkeypatch)
    o, lse = _decode(q, k, v, lens, paged, num_splits=num_splits, tree_mask=mask.to(q.device))
    _check(o, lse, q, k, v, lens, mask, f"{shape} {'paged' if paged else 'contiguous'}")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_each_sequence_its_own_tree(paged, monkeypatch):
    """A (B, N_q, N_q) mask: a chain, a star and a deeper tree in one batch, two splits."""
    masks = torch.stack([tree_mask(_tree(TREES[s])) for s in ("chain7", "star7", "deep7")])
    q, k, v, lens = _inputs(3, 4, 1, 7, 32, PREFIXES, DTYPE, seed=5)
    _poison(monkeypatch)
    o, lse = _decode(q, k, v, lens, paged, num_splits=2, tree_mask=masks.to(q.device))
    _check(o, lse, q, k, v, lens, masks, "per-sequence trees")


def test_a_tree_of_64_nodes_uses_the_sign_bit(monkeypatch):
    """N_q = 64: the last node's own bit is bit 63, the int64's sign."""
    tree = _random_tree(64, seed=11)
    assert opd.tree_bits(tree_mask(tree))[63] < 0
    mask = tree_mask(tree)
    q, k, v, lens = _inputs(2, 2, 1, 64, 16, [0, 20], torch.float32, seed=7)
    _poison(monkeypatch)
    o, lse = _decode(q, k, v, lens, False, num_splits=2, tree_mask=mask.to(q.device))
    _check(o, lse, q, k, v, lens, mask, "64 nodes")


def test_tree_decode_is_the_reference():
    tree = _tree(TREES["deep7"])
    q, k, v, lens = _inputs(2, 4, 2, 7, 16, [5, 33], torch.float32, seed=9)
    o = tree_decode(q, k, v, tree, lens, num_splits=2)
    ref = _reference(q, k, v, lens, tree_mask(tree))[0]
    assert_close_2x(o, ref, _same_precision(q, k, v, lens, tree_mask(tree)), name="tree_decode")
    assert tree_attention_mask(tree, 5).shape == (7, 12)  # the mask the reference applies


# ------------------------------------------------------------------------ a chain is causal

@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("n", [1, 3, 7])
def test_a_chain_is_the_causal_call_bit_for_bit(n, paged, num_splits, dtype):
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert torch.equal(chain, tree_mask(_tree([-1, *range(n - 1)])))
    q, k, v, lens = _inputs(3, 4, 2, n, 16, PREFIXES, dtype, seed=n)
    o, lse = _decode(q, k, v, lens, paged, num_splits=num_splits,
                     tree_mask=chain.to(q.device))
    o_causal, lse_causal = _decode(q, k, v, lens, paged, num_splits=num_splits)
    assert torch.equal(o, o_causal) and torch.equal(lse, lse_causal)


# ------------------------------------------------------------------------ plans and operators

def test_a_planned_tree_takes_a_new_mask_each_step():
    q, k, v, lens = _inputs(3, 4, 2, 7, 16, PREFIXES, torch.float32, seed=13)
    trees = [tree_mask(_tree(TREES[s])).to(q.device) for s in ("star7", "deep7")]
    plan = plan_decode(q, k, v, num_splits=2, tree_mask=trees[0])
    for mask in trees:
        o = plan.run(q, k, v, lens, tree_mask=mask).clone()
        torch.testing.assert_close(o, flash_decode(q, k, v, lens, 2, tree_mask=mask),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="tree_mask"):
        plan.run(q, k, v, lens)  # a tree plan needs its mask
    with pytest.raises(ValueError, match="tree_mask"):
        plan.run(q, k, v, lens, tree_mask=trees[0][:3, :3])
    with pytest.raises(ValueError, match="no tree_mask"):
        plan_decode(q, k, v).run(q, k, v, lens, tree_mask=trees[0])


def test_the_operators_take_the_bits_and_compile():
    """The trailing optional tensor of the operators: opcheck, and torch.compile(fullgraph)
    gives the eager answer."""
    mask = tree_mask(_tree(TREES["deep7"]))
    q, k, v, lens = _inputs(2, 4, 2, 7, 16, [5, 33], torch.float32, seed=17)
    bits = opd.tree_bits(mask.to(q.device))
    k_pages, v_pages, table = _paged(k, v)
    torch.library.opcheck(torch.ops.course.flash_decode.default,
                          (q, k, v, lens, 2, 0.25, -1, 0.0, None, None, None, None, bits))
    torch.library.opcheck(torch.ops.course.paged_decode.default,
                          (q, k_pages, v_pages, table, lens, 0, 0.25, -1, 0.0, None, None, None,
                           None, bits[None].expand(2, 7).contiguous()))
    torch._dynamo.reset()

    def step(q, k, v, lens, k_pages, v_pages, table, mask):
        return (flash_decode(q, k, v, lens, tree_mask=mask),
                paged_decode(q, k_pages, v_pages, table, lens, num_splits=2, tree_mask=mask))

    args = (q, k, v, lens, k_pages, v_pages, table, mask.to(q.device))
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    for g, w in zip(got, step(*args)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_tree_call_reads_nothing_back_from_the_device(monkeypatch):
    """On a GPU (``_FREE_READS`` False) the bits are made where the mask lies: no read."""
    monkeypatch.setattr(opd, "_FREE_READS", False)
    mask = tree_mask(_tree(TREES["star3"]))
    q, k, v, lens = _inputs(2, 2, 1, 3, 16, [0, 5], torch.float32, seed=19)
    mask = mask.to(q.device)
    k_pages, v_pages, table = _paged(k, v)

    def calls():
        flash_decode(q, k, v, lens, num_splits=2, tree_mask=mask)
        paged_decode(q, k_pages, v_pages, table, lens, tree_mask=mask)

    assert reads_back(calls) == 0


def test_a_tree_call_repeats_its_plans_bound_launch(monkeypatch, request):
    """A stand-in for the bound split kernel records the launches: a new mask's bits are the
    24th argument taken anew (after the 8 of the scales, here q's address and six 0s), so a
    second mask reuses the bound launch."""
    launched, bound, made = [], [], []
    monkeypatch.setattr(kd, "run_plan", lambda *a, **kw: bound.append(kw) or [
        lambda *p: launched.append(p)])
    real_bits = opd.tree_bits
    monkeypatch.setattr(opd, "tree_bits", lambda m: made.append(real_bits(m)) or made[-1])
    opd.forget_plans()
    request.addfinalizer(opd.forget_plans)  # the stand-in's launches must not outlive the test
    q, k, v, lens = _inputs(1, 2, 1, 3, 16, [5], torch.float32, seed=23)
    for shape in ("chain3", "star3"):
        flash_decode(q, k, v, lens, tree_mask=tree_mask(_tree(TREES[shape])).to(q.device))
    assert len(bound) == 1 and bound[0]["tree_bits"] is made[0]
    free = kd.SPLIT_FREE + kd.SCALE_FREE + kd.TREE_FREE
    assert len(launched) == 1 and len(launched[0]) == free
    assert launched[0][kd.SPLIT_FREE:] == (q.data_ptr(), q.data_ptr(), 0, 0, 0, 0, 0, 0,
                                           made[1].data_ptr())
    assert made[1].tolist() == [1, 3, 5]


# ------------------------------------------------------------------------ bits and errors

def test_tree_bits():
    mask = tree_mask(_tree(TREES["deep7"]))
    bits = opd.tree_bits(mask)
    assert bits.dtype == torch.int64 and bits.tolist() == [1, 3, 5, 11, 19, 43, 69]
    for i in range(7):
        assert [bool(int(bits[i]) >> j & 1) for j in range(7)] == mask[i].tolist()
    assert opd.tree_bits(torch.stack([mask, mask])).shape == (2, 7)


def _small():
    mask = tree_mask(_tree(TREES["deep7"]))
    return (*_inputs(2, 4, 2, 7, 16, [5, 33], torch.float32, seed=29), mask)


def _bad_calls():
    chain = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    no_diagonal = chain.clone()
    no_diagonal[4, 4] = False
    above = chain.clone()
    above[2, 5] = True
    return [
        ({"tree_mask": [[True]]}, TypeError, "tree_mask must be a bool torch.Tensor"),
        ({"tree_mask": chain.int()}, TypeError, "tree_mask must be bool"),
        ({"tree_mask": chain[:6, :6]}, ValueError, r"tree_mask must be \(7, 7\) or \(2, 7, 7\)"),
        ({"tree_mask": chain[None].expand(3, 7, 7)}, ValueError, "tree_mask must be"),
        ({"tree_mask": no_diagonal}, ValueError, r"diagonal set .*tree_mask\[\.\.\., 4, 4\]"),
        ({"tree_mask": above}, ValueError, r"tree_mask\[\.\.\., 2, 5\] is True"),
        ({"tree_mask": chain, "window_size": (8, 0)}, ValueError, "window_size"),
        ({"tree_mask": chain, "alibi_slopes": torch.ones(4)}, ValueError, "alibi_slopes"),
    ]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kw,error,message", _bad_calls(),
                         ids=["list", "int", "shape", "batch", "diagonal", "above", "window",
                              "alibi"])
def test_bad_tree_masks_name_the_argument(kw, error, message, paged):
    q, k, v, lens, good = _small()
    kw = {n: t.to(q.device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    kw["validate"] = None if course_lib.DEVICE == "cpu" else True  # the values: free on a CPU
    with pytest.raises(error, match=message):
        _decode(q, k, v, lens, paged, **kw)
    _decode(q, k, v, lens, paged, tree_mask=good.to(q.device))  # a plan kept for a (7, 7) mask
    with pytest.raises(error, match=message):  # a call that finds it checks the values as well
        _decode(q, k, v, lens, paged, **kw)


def test_more_than_64_nodes_is_refused():
    q, k, v, lens = _inputs(1, 2, 1, 65, 16, [0], torch.float32)
    with pytest.raises(ValueError, match="at most 64 nodes"):
        flash_decode(q, k, v, lens, tree_mask=torch.ones(65, 65, dtype=torch.bool,
                                                         device=q.device).tril())


def test_validate_false_skips_the_values():
    """Values are read only where ``validate`` says: with False a bit above the diagonal is
    ignored (the causal rule), and the chain's answer comes back."""
    q, k, v, lens, _ = _small()
    chain = torch.tril(torch.ones(7, 7, dtype=torch.bool, device=q.device))
    full = torch.ones(7, 7, dtype=torch.bool, device=q.device)
    o = flash_decode(q, k, v, lens, tree_mask=full, validate=False)
    assert torch.equal(o, flash_decode(q, k, v, lens, tree_mask=chain))
