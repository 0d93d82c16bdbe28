"""course_lib.serving.speculative: speculative decoding over a token tree.

The tree's mask and positions on a small tree written by hand; the reference tree attention
against each root-to-node path run as a plain causal sequence; one forward of a tiny LLaMA over
the past and the tree against each node's path run alone ("eager" and "sdpa"); greedy
speculative decoding against plain greedy decoding, token for token. Then the acceptance rule
on a toy target and draft over 6 tokens: the text it emits is distributed as the target's
(chi-square, for a chain and for a tree of three children per node); a draft equal to the
target is accepted in full; and the pitfall, siblings drawn without replacement but verified
with the draft's full q, is caught by the same test.
"""
import pytest
import torch

from course_lib.reference import attention
from course_lib.serving.speculative import (
    TokenTree,
    accept_greedy,
    accept_tree,
    additive_mask,
    attention_with_tree,
    draft_tree,
    sampling_probs,
    tree_attention_mask,
    tree_logits,
    tree_mask,
    tree_positions,
    verify_tree,
)
from course_lib.testing import fresh_randn

# A tree written by hand: root 0 has children 1 and 2; 1 has 3 and 4; 4 has 5; 2 has 6.
#
#        0
#       / \
#      1   2
#     / \   \
#    3   4   6
#        |
#        5
TREE = TokenTree(tokens=[10, 11, 12, 13, 14, 15, 16], parents=[-1, 0, 0, 1, 1, 4, 2])


# ------------------------------------------------------------------------------ the tree


def test_tree_depths_children_and_paths():
    assert TREE.depths == [0, 1, 1, 2, 2, 3, 2]
    assert TREE.children(0) == [1, 2] and TREE.children(1) == [3, 4] and TREE.children(5) == []
    assert TREE.path(5) == [0, 1, 4, 5] and TREE.path(6) == [0, 2, 6] and TREE.path(0) == [0]


def test_tree_mask_and_positions():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 0],
        [1, 0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree_mask(TREE), expected)
    assert tree_positions(TREE, start=9).tolist() == [9, 10, 10, 11, 11, 12, 11]
    full = tree_attention_mask(TREE, cache_len=3)  # (n, 3 + n)
    assert full.shape == (7, 10) and full[:, :3].all() and torch.equal(full[:, 3:], expected)
    float_mask = additive_mask(full)  # (1, 1, n, 3 + n)
    assert float_mask.shape == (1, 1, 7, 10)
    assert (float_mask[0, 0][full] == 0).all() and (float_mask[0, 0][~full] == -torch.inf).all()


def test_a_chain_is_the_causal_mask():
    chain = TokenTree(tokens=[3, 1, 4, 1, 5], parents=[-1, 0, 1, 2, 3])
    assert torch.equal(tree_mask(chain), torch.ones(5, 5, dtype=torch.bool).tril())
    whole = TREE.after([7, 8, 9])  # the past is a chain, the tree hangs from its last token
    mask = tree_mask(whole)
    assert torch.equal(mask[:3, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(mask[3:], tree_attention_mask(TREE, cache_len=3))
    assert tree_positions(whole).tolist() == list(range(3)) + tree_positions(TREE, 3).tolist()


def test_tree_errors():
    with pytest.raises(ValueError, match="parents\\[0\\]"):
        TokenTree(tokens=[1, 2], parents=[0, 0])
    with pytest.raises(ValueError, match="before its child"):
        TokenTree(tokens=[1, 2, 3], parents=[-1, 2, 0])
    with pytest.raises(ValueError, match="two children with one token"):
        TokenTree(tokens=[1, 2, 2], parents=[-1, 0, 0])


# ------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("cache_len", [0, 1, 17])
def test_attention_with_tree_is_causal_attention_over_each_path(cache_len):
    B, H, H_kv, D, n = 2, 4, 2, 16, len(TREE)
    q = fresh_randn(B, H, n, D, seed=1, device="cpu")
    k_cache = fresh_randn(B, H_kv, cache_len, D, seed=2, device="cpu")
    v_cache = fresh_randn(B, H_kv, cache_len, D, seed=3, device="cpu")
    k_tree = fresh_randn(B, H_kv, n, D, seed=4, device="cpu")
    v_tree = fresh_randn(B, H_kv, n, D, seed=5, device="cpu")
    out = attention_with_tree(q, k_cache, v_cache, k_tree, v_tree, tree_mask(TREE),
                              sm_scale=0.3)  # (B, H, n, D)
    for i in range(n):
        path = TREE.path(i)
        k = torch.cat([k_cache, k_tree[:, :, path]], dim=2)  # (B, H_kv, cache_len + depth + 1, D)
        v = torch.cat([v_cache, v_tree[:, :, path]], dim=2)
        expected = attention(q[:, :, i:i + 1], k, v, causal=True, sm_scale=0.3)  # (B, H, 1, D)
        err = (out[:, :, i:i + 1] - expected).abs().max().item()
        print(f"node {i}: path {path}, max error {err:.1e}")
        assert err < 1e-5


# ------------------------------------------------------------------------------ a real model


@pytest.fixture(scope="module")
def hf_capstone():
    pytest.importorskip("transformers", reason="transformers (the course's [hf] extra) is missing")
    from course_lib.hf import capstone
    return capstone


@pytest.fixture(scope="module")
def model(hf_capstone):
    return hf_capstone.make_llama(hf_capstone.small_config("llama"), attn_implementation="eager",
                                  dtype=torch.float32)


@torch.inference_mode()
def _last_logits(model, tokens):
    """The plain forward: next-token logits (V,) after ``tokens``, causal, no tree."""
    return model(torch.tensor([tokens], device=model.device)).logits[0, -1].float()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_tree_logits_equal_each_path_run_alone(model, impl):
    gen = torch.Generator().manual_seed(0)
    past = torch.randint(0, 128, (7,), generator=gen).tolist()
    tree = TokenTree(tokens=[5, 40, 41, 90, 91, 17, 3], parents=TREE.parents)
    model.set_attn_implementation(impl)
    try:
        logits = tree_logits(model, past, tree)  # (n, V)
        for i in range(len(tree)):
            expected = _last_logits(model, past + [tree.tokens[j] for j in tree.path(i)])
            err = (logits[i] - expected).abs().max().item()
            print(f"{impl} node {i}: max error {err:.1e}")
            assert err < 1e-4
    finally:
        model.set_attn_implementation("eager")


def test_greedy_speculative_decoding_is_greedy_decoding(model):
    """Draft trees (2 children, 3 levels) from a draft that agrees with the target about half of
    the time; verified greedily, the text is the target's greedy text, token for token."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (6,), generator=gen).tolist()
    new_tokens = 24

    expected = list(prompt)
    for _ in range(new_tokens):  # plain greedy decoding, one forward per token
        expected.append(int(_last_logits(model, expected).argmax()))

    text = list(prompt)

    def draft_probs(path):  # the target's argmax with probability 0.5, else any token
        logits = _last_logits(model, text[:-1] + path)  # (V,)
        return 0.5 * sampling_probs(logits, 0.0) + 0.5 / logits.numel()

    accepted = []
    while len(text) < len(prompt) + new_tokens:
        tree, q = draft_tree(draft_probs, text[-1], width=2, depth=3, generator=gen)
        target = verify_tree(model, text[:-1], tree, temperature=0.0)  # (n, V), one-hot
        verdict = accept_greedy(tree, target)
        assert verdict.tokens[:-1] == [tree.tokens[i] for i in verdict.nodes[1:]]
        # At temperature 0 the sampling rule is the greedy one: p is one-hot on the argmax.
        assert accept_tree(tree, target, q, gen) == verdict
        accepted.append(len(verdict.nodes) - 1)
        text += verdict.tokens
    print(f"draft tokens accepted per round: {accepted}")
    assert text[:len(expected)] == expected
    assert max(accepted) >= 2 and min(accepted) == 0  # deep paths kept, and some rejected


# ------------------------------------------------------------------------------ the rule


V = 6
_toy = torch.Generator().manual_seed(0)
P = torch.softmax(torch.randn(V, V, generator=_toy, dtype=torch.float64), dim=-1)  # target
Q = torch.softmax(1.5 * torch.randn(V, V, generator=_toy, dtype=torch.float64), dim=-1)  # draft
# A Markov toy: the next token's distribution depends on the last token only, so the target's
# distribution at a tree node is P[its token] and the draft's is Q[its token].


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs: the p-value (without scipy: the
    chi-square tail is the regularised upper incomplete gamma function)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = counts.sum() * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = probs.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))
    print(f"chi-square {stat:.1f} with {dof} degrees of freedom: p-value {p_value:.3g}")
    return p_value


def _generate(width, depth, gen, draft=Q, full_q=False, n_tokens=2):
    """Speculative sampling of ``n_tokens`` after token 0 in the toy; rounds until enough."""
    text, rounds = [0], []
    while len(text) < 1 + n_tokens:
        tree, q = draft_tree(lambda path: draft[path[-1]], text[-1], width, depth, gen)
        if full_q:  # the pitfall: every sibling verified with the draft's full distribution
            q = draft[torch.tensor([0] + [tree.tokens[p] for p in tree.parents[1:]])]
        verdict = accept_tree(tree, P[torch.tensor(tree.tokens)], q, gen)
        rounds.append(len(verdict.nodes) - 1)
        text += verdict.tokens
    return text[1:1 + n_tokens], rounds


@pytest.mark.parametrize("width, depth", [(1, 3), (3, 2)])
def test_speculative_sampling_keeps_the_target_distribution(width, depth):
    """20,000 texts of two tokens: the first token is distributed as P[0], the pair (a, b) as
    P[0, a]·P[a, b], whatever the draft (chi-square test, p-value > 0.001)."""
    gen = torch.Generator().manual_seed(1)
    first, pairs, accepted = torch.zeros(V), torch.zeros(V, V), []
    for _ in range(20_000):
        (a, b), rounds = _generate(width, depth, gen)
        first[a] += 1
        pairs[a, b] += 1
        accepted.append(rounds[0])
    print(f"width {width}, depth {depth}: mean draft tokens accepted in the first round "
          f"{sum(accepted) / len(accepted):.2f}")
    assert chi_square_p_value(first, P[0]) > 1e-3
    assert chi_square_p_value(pairs, P[0][:, None] * P) > 1e-3
    assert 0 < sum(accepted) and min(accepted) == 0  # some drafts kept, some rejected


def test_verifying_siblings_with_the_full_draft_distribution_is_biased():
    """The pitfall: siblings drawn without replacement but each verified with the draft's full
    q. The first token is no longer distributed as P[0]; the test above would fail."""
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(V)
    for _ in range(5_000):
        (a,), _ = _generate(3, 1, gen, full_q=True, n_tokens=1)
        first[a] += 1
    assert chi_square_p_value(first, P[0]) < 1e-6


def test_a_draft_equal_to_the_target_is_accepted_in_full():
    gen = torch.Generator().manual_seed(2)
    for width, depth in [(1, 4), (3, 2)]:
        for _ in range(200):
            tree, q = draft_tree(lambda path: P[path[-1]], 0, width, depth, gen)
            verdict = accept_tree(tree, P[torch.tensor(tree.tokens)], q, gen)
            assert len(verdict.nodes) == depth + 1 and len(verdict.tokens) == depth + 1
            assert verdict.nodes[1] == 1  # the first child, always


def test_draft_tree_draws_siblings_without_replacement():
    gen = torch.Generator().manual_seed(3)
    tree, q = draft_tree(lambda path: Q[path[-1]], 0, width=3, depth=2, generator=gen)
    assert len(tree) == 1 + 3 + 9 and tree.depths == [0] + [1] * 3 + [2] * 9
    assert q.shape == (13, V) and (q[0] == 0).all()
    for node in range(len(tree)):
        children = tree.children(node)
        assert len({tree.tokens[c] for c in children}) == len(children)
        for k, child in enumerate(children):  # each child's q: the draft's without the earlier
            earlier = [tree.tokens[c] for c in children[:k]]
            expected = Q[tree.tokens[node]].clone().float()
            expected[earlier] = 0
            torch.testing.assert_close(q[child], expected / expected.sum())
    # a draft with two tokens of non-zero probability gives two children, not three
    two = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    tree, _ = draft_tree(lambda path: two, 0, width=3, depth=1, generator=gen)
    assert sorted(tree.tokens[1:]) == [1, 3]


def test_sampling_probs():
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 0.0, 1.0]])
    greedy = sampling_probs(logits, 0.0)
    assert torch.equal(greedy, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(sampling_probs(logits, 2.0), torch.softmax(logits / 2, dim=-1))
    with pytest.raises(ValueError, match="temperature"):
        sampling_probs(logits, -1.0)
