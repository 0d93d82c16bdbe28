"""Speculative decoding over a token tree: draft a tree, verify it in one forward of the target
model, and accept a path so that what comes out is distributed exactly as the target's samples.

Introduced in notebooks/16_serving.ipynb.

A decode step reads every weight and the whole KV cache to produce one token: it is bound by
memory, and the GPU has compute to spare. Speculative decoding spends it. A cheap draft guesses
the next tokens; the target model scores all the guesses in one forward; the guesses it agrees
with are kept, and the same forward also gives the next token after them.

* **The acceptance rule** (Leviathan et al., "Fast Inference from Transformers via
  Speculative Decoding", ICML 2023, section 2.3, https://arxiv.org/abs/2211.17192; Chen et
  al., "Accelerating Large Language Model Decoding with Speculative Sampling", 2023,
  https://arxiv.org/abs/2302.01318): a draft token x, drawn from the draft's distribution q,
  is accepted with probability min(1, p(x) / q(x)), p the target's. On rejection the token is
  drawn from the residual norm(max(p - q, 0)). The token that comes out is distributed as p,
  whatever q is: a good draft only makes acceptance more likely.
* **A tree of guesses** (Miao et al., "SpecInfer: Accelerating Large Language Model Serving
  with Tree-based Speculative Inference and Verification", ASPLOS 2024, section 4,
  https://arxiv.org/abs/2305.09781; Cai et al., "Medusa: Simple LLM Inference Acceleration
  Framework with Multiple Decoding Heads", 2024, section 2.1.2,
  https://arxiv.org/abs/2401.10774): several candidates per position, their continuations
  below them. One forward verifies the whole tree: every node is one more query, and a node
  sees the cache and its own ancestors only (``tree_mask``), at position cache length + its
  depth (``tree_positions``). A causal mask is the tree mask of a chain.
* **Several children per node**: SpecInfer's multi-step speculative sampling (its Algorithm 2
  and Theorem 4.2). Try the children in turn; accept child x with probability
  min(1, p(x) / q(x)); on rejection replace p by norm(max(p - q, 0)) and go on with the next
  child; if none is accepted, draw from what is left of p. The q of each child is the
  distribution that child was drawn from. ``draft_tree`` draws siblings without replacement,
  so the second child's q is the draft's with the first child's token removed (and
  renormalised), and so on. Using the draft's full q for every sibling is a common pitfall: the
  output is then no longer distributed as p (tests/test_speculative.py measures it). The
  without-replacement form is Sequoia's verification (Chen et al., "Sequoia: Scalable, Robust,
  and Hardware-aware Speculative Decoding", 2024, https://arxiv.org/abs/2402.12374).

Greedy decoding (temperature 0) is the special case where p is one token: keep the longest path
whose tokens are the target's argmax, then the target's argmax after it (``accept_greedy``).
The output is then the target's greedy text, token for token.

Here verification is the plain version: the past tokens and the tree in one forward of a
transformers model, without a KV cache, under a 4D mask (0 where a query sees a key, -inf
elsewhere) that transformers takes as it is for its "eager" and "sdpa" attention. With a cache,
the tree's queries see every cached key and the tree mask among themselves:
``tree_attention_mask``, and ``attention_with_tree`` is the fp32 reference of that attention.
``tree_decode`` runs it with the course's decode kernel: the tree's keys are the cache's last
entries, and the kernel reads the tree mask as one int64 of bits per node (FlashInfer's custom
masks play this part in vLLM and SGLang, https://docs.flashinfer.ai).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from course_lib.ops import flash_decode
from course_lib.reference import expand_kv

# ---------------------------------------------------------------------------------------------
# the token tree and its mask
# ---------------------------------------------------------------------------------------------


@dataclass
class TokenTree:
    """Draft tokens as a tree. Node 0 is the root: the last accepted token, not yet run by the
    target. ``parents[i]`` is node i's parent (``parents[0] = -1``, else ``parents[i] < i``,
    so a node comes after its ancestors). Siblings carry different tokens.

    >>> tree = TokenTree(tokens=[5, 7, 9, 2], parents=[-1, 0, 0, 1])
    >>> tree.depths, tree.children(0), tree.path(3)
    ([0, 1, 1, 2], [1, 2], [0, 1, 3])
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(init=False)

    def __post_init__(self):
        self.tokens = [int(t) for t in self.tokens]
        self.parents = [int(p) for p in self.parents]
        if not self.tokens or len(self.tokens) != len(self.parents):
            raise ValueError(f"tokens and parents must have one non-zero length, got "
                             f"{len(self.tokens)} and {len(self.parents)}")
        if self.parents[0] != -1:
            raise ValueError(f"node 0 is the root: parents[0] must be -1, got {self.parents[0]}")
        for i, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"parents[{i}] = {parent}: a parent comes before its child")
        self.depths = [0]
        for parent in self.parents[1:]:
            self.depths.append(self.depths[parent] + 1)
        for i in range(len(self)):
            siblings = [self.tokens[c] for c in self.children(i)]
            if len(set(siblings)) != len(siblings):
                raise ValueError(f"node {i} has two children with one token: {siblings}")

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> list[int]:
        """Node i's children, in the order they were drafted."""
        return [c for c, parent in enumerate(self.parents) if parent == i]

    def path(self, i: int) -> list[int]:
        """The nodes from the root down to node i (both included)."""
        nodes = [i]
        while self.parents[nodes[-1]] >= 0:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]

    def after(self, past_tokens) -> TokenTree:
        """This tree hung below a chain of ``past_tokens``: one tree of len(past) + n nodes.

        The past is a chain (each token's parent is the token before it), so its tree mask is
        the causal mask. Node i of this tree is node len(past) + i of the result.
        """
        n_past = len(past_tokens)
        parents = list(range(-1, n_past - 1))
        parents += [n_past - 1] + [n_past + p for p in self.parents[1:]]
        return TokenTree(list(past_tokens) + self.tokens, parents)


def tree_mask(tree: TokenTree) -> torch.Tensor:
    """(n, n) bool: node i sees node j iff j is i or one of i's ancestors."""
    n = len(tree)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            mask[i] = mask[parent]  # the parent's ancestors are i's ancestors
        mask[i, i] = True
    return mask


def tree_positions(tree: TokenTree, start: int = 0) -> torch.Tensor:
    """(n,) int64 positions for the rotary embedding: start + depth. Siblings share one
    position: each is a candidate for the same place in the text."""
    return start + torch.tensor(tree.depths, dtype=torch.int64)


def tree_attention_mask(tree: TokenTree, cache_len: int) -> torch.Tensor:
    """(n, cache_len + n) bool: the tree's queries see every cached key, and the tree's keys
    under the tree mask. The keys are laid out as the cache, then the tree's nodes."""
    n = len(tree)
    return torch.cat([torch.ones(n, cache_len, dtype=torch.bool), tree_mask(tree)], dim=1)


def additive_mask(mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A bool mask (N_q, N_k) as the 4D float mask transformers adds to the scores:
    (1, 1, N_q, N_k), 0 where a query sees a key and -inf elsewhere."""
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, float("-inf"))[None, None]  # (1, 1, N_q, N_k)


# ---------------------------------------------------------------------------------------------
# the reference attention of a tree's queries
# ---------------------------------------------------------------------------------------------

def attention_with_tree(q, k_cache, v_cache, k_tree, v_tree, mask, sm_scale=None):
    """Attention of the tree's queries to the whole cache plus the tree's keys, in fp32.

    q (B, H, n, D): one query per tree node. k_cache, v_cache (B, H_kv, N_cache, D): every
    cached key is seen by every node. k_tree, v_tree (B, H_kv, n, D): the tree's own keys, seen
    where ``mask`` (n, n) bool (``tree_mask``) says. Returns O (B, H, n, D) in fp32. For each
    node this is causal attention over the cache and the root-to-node path, run as one
    sequence: the node is the last query of its path and sees all of it.
    """
    B, H, n, D = q.shape
    if mask.shape != (n, n):
        raise ValueError(f"mask must be ({n}, {n}) for {n} tree queries, got {tuple(mask.shape)}")
    if k_tree.shape[2] != n or v_tree.shape[2] != n:
        raise ValueError(f"k_tree and v_tree must hold {n} keys, got {k_tree.shape[2]} and "
                         f"{v_tree.shape[2]}")
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    k = expand_kv(torch.cat([k_cache, k_tree], dim=2).float(), H)  # (B, H, N_cache + n, D)
    v = expand_kv(torch.cat([v_cache, v_tree], dim=2).float(), H)  # (B, H, N_cache + n, D)
    visible = torch.cat([torch.ones(n, k_cache.shape[2], dtype=torch.bool), mask.cpu()], dim=1)
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale  # (B, H, n, N_cache + n)
    s = s.masked_fill(~visible.to(s.device), float("-inf"))  # every row sees its own key
    p = torch.softmax(s, dim=-1)  # (B, H, n, N_cache + n)
    return torch.matmul(p, v)  # (B, H, n, D)


def tree_decode(q, k_cache, v_cache, tree: TokenTree, cache_seqlens=None, **kwargs):
    """The tree's attention by the decode kernel: ``flash_decode(..., tree_mask=tree_mask(tree))``.

    q (B, H, n, D): one query per node. k_cache, v_cache (B, H_kv, N_max, D) hold, for sequence
    b, the cached keys and then the tree's n keys in node order: its first L_b entries
    (``cache_seqlens``, None: all N_max), the tree's the last n of them. Returns O (B, H, n, D)
    in q's dtype: ``attention_with_tree`` on the cache's first L_b - n keys and the tree's.
    ``kwargs``: ``flash_decode``'s (num_splits, sm_scale, return_lse, ...).
    """
    return flash_decode(q, k_cache, v_cache, cache_seqlens,
                        tree_mask=tree_mask(tree).to(q.device), **kwargs)


# ---------------------------------------------------------------------------------------------
# verification: one forward of the target model over the past and the tree
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def tree_logits(model, past_tokens, tree: TokenTree) -> torch.Tensor:
    """The target's logits (n, V) at every tree node, in fp32, from ONE forward of a
    transformers model over ``past_tokens`` and the tree's tokens, without a KV cache.

    Row i is the target's next-token logits after the past and the path to node i: the same
    as running that path as a plain sequence. The past and the tree are one tree (``after``),
    so one tree mask is the whole 4D mask, and the depths are the positions. transformers
    (5.24) takes a 4D mask as it is and adds it to the scores ("eager") or hands it to
    ``scaled_dot_product_attention`` ("sdpa"); a bool mask would be added as 0 and 1, so it
    is the float one. The course's "course_kernels" attention refuses such a mask (not one
    causal run of keys per sequence) rather than get it wrong.
    """
    whole = tree.after(past_tokens)  # the past is a chain: its mask is the causal mask
    device = model.device
    input_ids = torch.tensor([whole.tokens], device=device)  # (1, n_past + n)
    mask = additive_mask(tree_mask(whole), model.dtype).to(device)  # (1, 1, n_past + n, same)
    position_ids = tree_positions(whole).to(device)[None]  # (1, n_past + n)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                use_cache=False, logits_to_keep=len(tree))
    return out.logits[0, -len(tree):].float()  # (n, V)


def sampling_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution a sampler draws from: softmax(logits / temperature), or at
    temperature 0 (greedy) all the mass on the argmax."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        one_hot = torch.zeros_like(logits, dtype=torch.float32)
        return one_hot.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(logits.float() / temperature, dim=-1)


def verify_tree(model, past_tokens, tree: TokenTree, temperature: float = 1.0) -> torch.Tensor:
    """The target's distribution (n, V) of the next token at every tree node, from one forward
    (``tree_logits``), at ``temperature`` (0: greedy, one-hot on the argmax)."""
    return sampling_probs(tree_logits(model, past_tokens, tree), temperature)


# ---------------------------------------------------------------------------------------------
# acceptance: walk from the root, keep what the target agrees with
# ---------------------------------------------------------------------------------------------

class Acceptance(NamedTuple):
    """What one verification keeps.

    ``nodes``: the accepted path, from the root (node 0) down; a KV cache keeps these nodes'
    entries and drops the other nodes'. ``tokens``: the new tokens of the text, the accepted
    nodes' tokens after the root and then one more from the target: len(nodes) tokens.
    """
    nodes: list[int]
    tokens: list[int]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): what p has left once a token drawn from q was rejected."""
    r = (p - q).clamp_min(0)  # (V,)
    total = r.sum()
    # A rejection implies p(x) < q(x), so the residual has mass; 0 only by rounding when p ≈ q.
    return r / total if total > 0 else p


def accept_tree(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                generator: torch.Generator | None = None) -> Acceptance:
    """SpecInfer's multi-step speculative sampling, from the root down.

    target_probs (n, V): the target's next-token distribution at each node (``verify_tree``).
    draft_probs (n, V): row i is the distribution node i's token was drawn from (row 0, the
    root's, is not used). At a node, try its children in order: accept child x with
    probability min(1, p(x) / q(x)) and go down to it; on rejection p becomes
    norm(max(p - q, 0)) and the next child is tried. When no child is accepted (or the node is a
    leaf), the last token is drawn from p as it stands. The tokens are then distributed as the
    target's own samples.
    """
    node, nodes, tokens = 0, [0], []
    while True:
        p = target_probs[node].float()  # (V,)
        accepted = None
        for child in tree.children(node):
            x, q = tree.tokens[child], draft_probs[child].float()  # q (V,)
            if q[x] <= 0:
                raise ValueError(f"node {child}'s token {x} has draft probability {float(q[x])}: "
                                 f"draft_probs[{child}] is not the distribution it was drawn from")
            u = torch.rand((), generator=generator)
            if u < p[x] / q[x]:  # accept with probability min(1, p(x) / q(x))
                accepted = child
                break
            p = _residual(p, q)
        if accepted is None:
            tokens.append(int(torch.multinomial(p, 1, generator=generator)))
            return Acceptance(nodes, tokens)
        nodes.append(accepted)
        tokens.append(tree.tokens[accepted])
        node = accepted


def accept_greedy(tree: TokenTree, target_probs: torch.Tensor) -> Acceptance:
    """Greedy verification (temperature 0): the longest path whose tokens are the target's
    argmax at their parent, then the target's argmax after it. ``target_probs`` (n, V) may be
    logits or probabilities: only the argmax is read. Siblings carry different tokens, so at
    most one child matches and the walk is the longest match."""
    best = target_probs.argmax(-1).tolist()  # (n,)
    node, nodes, tokens = 0, [0], []
    while True:
        match = [c for c in tree.children(node) if tree.tokens[c] == best[node]]
        if not match:
            tokens.append(best[node])
            return Acceptance(nodes, tokens)
        node = match[0]
        nodes.append(node)
        tokens.append(tree.tokens[node])


# ---------------------------------------------------------------------------------------------
# the draft
# ---------------------------------------------------------------------------------------------

def draft_tree(draft_probs_fn: Callable[[list[int]], torch.Tensor], root_token: int, width: int,
               depth: int, generator: torch.Generator | None = None):
    """A token tree drawn from a draft: ``width`` children per node, drawn without replacement,
    for ``depth`` levels below the root.

    ``draft_probs_fn(path)`` returns the draft's next-token distribution (V,) after ``path``,
    the tokens from the root down to a node (a draft model closes over the past tokens; for the
    tests and the lesson, any distribution). Siblings are drawn one after another, each from
    the draft's distribution with the earlier siblings' tokens removed and renormalised: that
    distribution is the child's q, the one ``accept_tree`` must use. A node gets fewer children
    when the draft gives fewer tokens a non-zero probability.

    Returns the tree (nodes level by level, so parents come first) and draft_probs (n, V), row
    i the distribution node i was drawn from (row 0, the root's, all zeros).
    """
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be >= 1, got {width} and {depth}")
    tokens, parents, qs = [int(root_token)], [-1], [None]

    def path(i):
        nodes = [i]
        while parents[nodes[-1]] >= 0:
            nodes.append(parents[nodes[-1]])
        return [tokens[j] for j in reversed(nodes)]

    level = [0]
    for _ in range(depth):
        next_level = []
        for node in level:
            q = draft_probs_fn(path(node)).float()  # (V,)
            for _ in range(min(width, int((q > 0).sum()))):
                x = int(torch.multinomial(q, 1, generator=generator))
                tokens.append(x)
                parents.append(node)
                qs.append(q)
                next_level.append(len(tokens) - 1)
                q = q.clone()
                q[x] = 0.0  # the next sibling is drawn from what is left
                q = q / q.sum()
        level = next_level
    qs[0] = torch.zeros_like(qs[1])
    return TokenTree(tokens, parents), torch.stack(qs)  # draft_probs (n, V)
