"""Exercises of notebooks/16_serving.ipynb: what a serving engine adds around attention.

1. ``step_chunks`` (Python): one step's batch under a token budget, the rule of
   ``course_lib.serving.scheduler.Scheduler.step`` (Sarathi-Serve's stall-free batching); some
   cases are steps of a real ``Scheduler`` run, so the reference is checked against it;
2. ``block_hashes`` (Python): the chained names of a prompt's full blocks, as the scheduler's
   prefix cache computes them (``scheduler.block_hash``; cases checked against a ``Scheduler``);
3. ``merge_state`` (PyTorch): cascade attention's merge of two partial states, against
   ``course_lib.ops.cascade.merge_state``, with lse near 100 and parts that saw no key;
4. ``kv8_decode_kernel`` (Triton): the loop body of a one-split decode over an int8 cache with a
   scale per token and head (``course_lib.kvquant``), the scales outside the two products as in
   ``course_lib.kernels.decode``'s KV_SCALED branch;
5. ``accept_draft`` (PyTorch): speculative decoding's test of one drafted token and the
   residual on rejection, against ``course_lib.serving.speculative``;
6. two questions with a number: the bytes of an 8-bit cache per token, and what cascade
   attention saves on a shared prefix.

Each checker names the case that fails, the student's output against the expected one, and the
registered mistake whose output on that case is the student's (with why it is wrong).
"""
from __future__ import annotations

import copy

import torch
import triton
import triton.language as tl

from course_lib import DEVICE
from course_lib.exercises import (
    TODO,
    Exercise,
    Mistake,
    Question,
    Result,
    _as_array,
    _compare,
    _nudge,
    _report,
    check_kernel,
    poisoned,
    register,
)
from course_lib.exercises.flash_v2 import EXACT_DOTS, LOG2E, TOL, kernel_variant
from course_lib.exercises.sandbox import is_kernel
from course_lib.kvquant import dequantize_kv, kv_bytes_per_token, quantize_kv
from course_lib.ops.cascade import merge_state as library_merge_state
from course_lib.serving import Scheduler, block_hash
from course_lib.serving.speculative import _residual

LESSON = "16_serving"
BLOCK = 16  # BLOCK_M (a GQA group's rows, padded) and BLOCK_N: tl.dot needs >= 16


class _Raised(str):
    """What a run that raised gave: the exception's type name."""


def _diagnosis(name, mistakes, whys, args, got, same) -> str:
    """The registered mistakes whose output on ``args`` is ``got`` (``same(got, theirs)``), and
    why each is wrong (``whys``: {label: text, or a function giving it}); "" when none is."""
    labels = []
    for m in mistakes:
        try:
            theirs = m.answer(*copy.deepcopy(args))
        except Exception as exc:  # a mistake that raises matches a student's that raises alike
            theirs = _Raised(type(exc).__name__)
        try:
            if same(got, theirs):
                labels.append(m.label)
        except Exception:
            continue
    if not labels:
        return ""
    why = " ".join(w() if callable(w) else w for w in (whys.get(label) for label in labels) if w)
    return ("\n  Diagnosis: on this case yours does exactly what a mistake students make does: "
            + "; or ".join(labels) + "." + (f" {why}" if why else "") + f" More: hint('{name}').")


def _check_python(name, student, cases, compare, describe, hints, mistakes, whys, show=True,
                  nudges=None) -> Result:
    """Run ``student(*args)`` on each (args, expected) case; ``compare(got, want, args)``: None
    when right, else what differs. A failure names the case and, when a registered mistake's
    output is the student's, the mistake."""
    if is_kernel(student):
        return _report(Result(name, False, "this exercise asks for a Python function, not a "
                              "@triton.jit kernel"), show)

    def fail(why, found):  # a nudge, unless the output's form is what is wrong ("return ...")
        nudge = "" if ": return " in why else _nudge(name, hints, why, nudges)
        return _report(Result(name, False, why + (found or nudge)), show)

    for n, (args, want) in enumerate(cases):
        label = describe(*args)
        try:
            got = student(*copy.deepcopy(args))
        except NotImplementedError:
            return _report(Result(name, False, TODO, "todo"), show)
        except Exception as exc:  # a student's bug is a message, not a crash
            raised = _Raised(type(exc).__name__)
            return fail(f"case {n} ({label}) raised {type(exc).__name__}: {exc}",
                        _diagnosis(name, mistakes, whys, args, raised,
                                   lambda a, b: isinstance(b, _Raised) and a == b))
        if got is None:
            if n == 0:
                return _report(Result(name, False, TODO + " (it returns None)", "todo"), show)
            return fail(f"case {n} ({label}) returned None", "")
        try:
            why = compare(got, want, args)
        except Exception as exc:
            why = f"your output could not be read ({type(exc).__name__}: {exc}): {got!r:.200}"
        if why:
            return fail(f"case {n} ({label}): {why}", _diagnosis(
                name, mistakes, whys, args, got,
                lambda a, b: not isinstance(b, _Raised) and compare(a, b, args) is None))
    return _report(Result(name, True, f"all {len(cases)} cases match"), show)


# =============================================================================================
# 1. one step's batch under a token budget
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def step_chunks(requests, budget):
    """requests: [(request_id, state, tokens_left)] in arrival order; state is "decode"
    (tokens_left = 1: the token sampled last step) or "prefill" (prompt tokens not yet in the
    cache). budget: the most tokens one step holds. Returns [(request_id, tokens this step)]
    in the step's order. Scheduler.step's rule, without its other limits (max_running, free
    blocks, preemption)."""
    # TODO: the step's chunks
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def step_chunks_solution(requests, budget):
    """Sarathi-Serve's stall-free batch: every decode first (one token each), then the prefills
    in arrival order, the last one cut to what the budget leaves."""
    batch = []
    for request_id, state, left in sorted(requests, key=lambda r: r[1] != "decode"):  # stable
        if budget == 0:
            break
        n = min(left, budget)
        batch.append((request_id, n))
        budget -= n
    return batch


def _chunks_in_arrival_order(requests, budget):
    batch = []
    for request_id, _, left in requests:
        if budget == 0:
            break
        batch.append((request_id, min(left, budget)))
        budget -= min(left, budget)
    return batch


def _chunks_not_cut(requests, budget):
    batch = []
    for request_id, _, left in sorted(requests, key=lambda r: r[1] != "decode"):
        if budget <= 0:
            break
        batch.append((request_id, left))
        budget -= left
    return batch


def _chunks_skip_what_does_not_fit(requests, budget):
    batch = []
    for request_id, _, left in sorted(requests, key=lambda r: r[1] != "decode"):
        if left <= budget:
            batch.append((request_id, left))
            budget -= left
    return batch


def _scheduler_steps():
    """Steps of a real ``Scheduler`` (blocks aplenty, no prefix cache, no running limit): the
    requests before each step (running, then arrived: arrival order, as nothing is preempted)
    and the chunks the step took; the first three steps with decodes and prefills that spend
    the whole budget."""
    s = Scheduler(num_blocks=512, block_size=4, max_tokens_per_step=12, max_running=64,
                  prefix_caching=False)
    for i, (n, new, at) in enumerate(((30, 4, 0), (5, 6, 0), (18, 3, 1), (3, 5, 2), (40, 2, 3))):
        s.add_request(list(range(100 * i, 100 * i + n)), new, arrival_step=at)
    steps = []
    while s.has_unfinished():
        arrived = [r for r in s.pending if r.arrival_step <= s.step_index]
        state = [(r.request_id, "decode" if r.is_decoding else "prefill", r.num_uncomputed)
                 for r in s.running + s.waiting + arrived]
        batch = s.step()
        kinds = {k for _, k, _ in state}
        if len(kinds) == 2 and len(batch.token_ids) == s.max_tokens_per_step:
            steps.append(((state, s.max_tokens_per_step),
                          [(c.request_id, c.num_tokens) for c in batch.chunks]))
        s.update(batch, [7] * sum(c.samples for c in batch.chunks))
    return steps[:3]


def _chunk_cases():
    hand = [([(0, "decode", 1), (1, "prefill", 10), (2, "decode", 1)], 8),
            ([(0, "prefill", 3), (1, "prefill", 20), (2, "prefill", 4)], 10),
            ([(5, "decode", 1), (6, "decode", 1), (7, "decode", 1)], 2),
            ([(3, "prefill", 7), (4, "decode", 1), (8, "prefill", 2)], 64),
            ([], 16)]
    return [(c, step_chunks_solution(*c)) for c in hand] + _scheduler_steps()


def _describe_chunks(requests, budget):
    what = ", ".join(f"{rid} decode" if state == "decode" else f"{rid} prefill {left} left"
                     for rid, state, left in requests) or "no request"
    return f"budget {budget}; in arrival order: {what}"


def _compare_chunks(got, want, args):
    requests, budget = args
    try:
        got = [(rid, int(n)) for rid, n in got]
    except (TypeError, ValueError):
        return f"return a list of (request_id, tokens) pairs, got {got!r}"
    if got == want:
        return None
    why = f"yours {got}, expected {want}"
    mine = dict(got)
    state = {rid: (kind, left) for rid, kind, left in requests}
    total = sum(n for _, n in got)
    if total > budget:
        why += f". Yours holds {total} tokens: over the budget of {budget}"
    for rid, n in got:
        if rid in state and n > state[rid][1]:
            why += f". Request {rid} gets {n} tokens and has {state[rid][1]} left"
    starved = [rid for rid, (kind, _) in state.items() if kind == "decode" and rid not in mine]
    if starved and any(state.get(rid, ("",))[0] == "prefill" for rid in mine):
        why += f". Decode {starved[0]} gets no token while a prefill does: it stalls"
    return why


CHUNK_HINTS = (
    "a decoding request costs one token and a user is waiting for it; a prompt can wait a step "
    "or be spread over several. Which kind goes into the step first?",
    "walk the requests in that order and keep what the budget still allows: a prompt longer "
    "than what is left is not skipped, it gets the part that fits (a chunk) and the rest next "
    "step.",
    "stop once the budget is spent; within each kind keep the arrival order (a stable sort "
    "does). A request gets at most the tokens it has left.",
)
CHUNK_WHYS = {
    "prefills before decodes": "Taking the requests in arrival order lets a long prompt fill the "
    "step, and the decodes behind it get nothing: their users see a stall (Sarathi-Serve's "
    "point: decodes first, prefill chunks fill the rest).",
    "a chunk not cut to the budget": "A prompt is scheduled whole even when less budget is "
    "left: the step holds more tokens than max_tokens_per_step, and its time is no longer "
    "bounded.",
    "a prompt that does not fit is skipped": "A prompt longer than what is left is passed over "
    "(and a later, shorter one may take its place): it should get a chunk of what is left, "
    "or a long prompt waits until the budget is free and out-of-order requests overtake it.",
}
CHUNK_MISTAKES = (
    Mistake("prefills before decodes", _chunks_in_arrival_order, "it stalls"),
    Mistake("a chunk not cut to the budget", _chunks_not_cut, "over the budget"),
    Mistake("a prompt that does not fit is skipped", _chunks_skip_what_does_not_fit,
            "passed over"),
)


def check_step_chunks(student, show: bool = True) -> Result:
    """``student(requests, budget) -> [(request_id, tokens)]``; cases by hand and steps of a
    real ``Scheduler`` run."""
    return _check_python("step_chunks", student, _chunk_cases(), _compare_chunks,
                         _describe_chunks, CHUNK_HINTS, CHUNK_MISTAKES, CHUNK_WHYS, show)


register(Exercise(
    name="step_chunks", lesson=LESSON, kind="python",
    writes="one step's batch under a token budget: decodes, then prefill chunks", lines=6,
    check=check_step_chunks, solution=step_chunks_solution, stub=step_chunks,
    mistakes=CHUNK_MISTAKES, hints=CHUNK_HINTS))


# =============================================================================================
# 2. the chained names of a prompt's full blocks
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def block_hashes(tokens, block_size):
    """The names of the full blocks of ``tokens`` (a list of ints), block 0 first: bytes, each
    made by block_hash(parent, block_tokens) (course_lib.serving)."""
    # TODO: one name per full block, as the prefix cache names them
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def block_hashes_solution(tokens, block_size):
    """Block j's name covers block j − 1's name and block j's tokens, so it stands for the
    whole prefix up to the block's end; a partial last block is not named."""
    names, parent = [], None
    for j in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[j * block_size:(j + 1) * block_size])
        names.append(parent)
    return names


def _hashes_alone(tokens, block_size):
    return [block_hash(None, tokens[j:j + block_size])
            for j in range(0, len(tokens) - block_size + 1, block_size)]


def _hashes_partial_too(tokens, block_size):
    names, parent = [], None
    for j in range(0, len(tokens), block_size):
        parent = block_hash(parent, tokens[j:j + block_size])
        names.append(parent)
    return names


def _hashes_whole_prefix(tokens, block_size):
    return [block_hash(None, tokens[:j + block_size])
            for j in range(0, len(tokens) - block_size + 1, block_size)]


def _scheduler_names(prompt, block_size):
    """The names a ``Scheduler`` gives a prompt's full blocks once its prefill has run."""
    s = Scheduler(num_blocks=64, block_size=block_size, max_tokens_per_step=256)
    request = s.add_request(prompt, max_new_tokens=2)
    s.update(s.step(), [0])
    return list(request.block_hashes)


_PAIR = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 5, 6, 7, 8])  # block 1 alike, block 0 not


def _hash_cases():
    cases = [(list(range(10, 22)), 4), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 4),
             ([7, 7, 7, 7, 7, 7, 7, 7], 4), ([42, 43, 44], 4), ([], 16)]
    out = [(c, block_hashes_solution(*c)) for c in cases]
    for prompt, bs in ((list(range(50, 90)), 16), (_PAIR[1] * 3 + [1], 4)):  # a Scheduler's
        out.append(((prompt, bs), _scheduler_names(prompt, bs)))
    return out


def _short(h) -> str:
    return h.hex()[:8] + "…" if isinstance(h, bytes) else repr(h)


def _compare_hashes(got, want, args):
    if not isinstance(got, (list, tuple)) or not all(isinstance(h, bytes) for h in got):
        kinds = sorted({type(h).__name__ for h in got}) if isinstance(got, (list, tuple)) else []
        return (f"return a list of bytes (block_hash's digests), got {type(got).__name__}"
                + (f" of {', '.join(kinds)}" if kinds else ""))
    if list(got) == want:
        return None
    why = f"yours [{', '.join(map(_short, got))}], expected [{', '.join(map(_short, want))}]"
    if len(got) != len(want):
        why += f": {len(got)} names for {len(want)} full blocks"
    else:
        j = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        why += f": the first that differs is block {j}'s"
    return why


def _pair_example(student) -> str:
    """What the student's names say about two prompts that share block 1 but not block 0."""
    try:
        a, b = (student(list(p), 4) for p in _PAIR)
        if len(a) > 1 and len(b) > 1 and a[1] == b[1]:
            return (f" Try it: prompts {_PAIR[0]} and {_PAIR[1]} (blocks of 4) differ in "
                    f"block 0 and share block 1's tokens; yours names block 1 of both "
                    f"{_short(a[1])}, so a request with the second prompt would be handed the "
                    f"first's K and V for block 1, computed after other tokens.")
    except Exception:
        pass
    return ""


HASH_HINTS = (
    "a block's K and V depend on every token before it, not only on its own: the name must "
    "say the same. Which one value already stands for everything before block j?",
    "go block by block and carry the previous block's name along as the parent of the next; "
    "the first block has no parent (None).",
    "a block is named once it is full: a last block with fewer than block_size tokens will "
    "still be written to, and gets no name (len(tokens) // block_size names).",
)
HASH_WHYS = {
    "each block hashed alone": "A block's name then ignores what comes before it, but its K and "
    "V do not.",
    "the partial last block named too": "The last block is not full: its tokens (and K, V) "
    "will still grow, so no name may promise its content yet; the scheduler names a block "
    "once it is full.",
    "the whole prefix hashed for each block": "Naming block j by all tokens up to its end "
    "stands for the prefix too, but it hashes O(N² / block_size) tokens and gives other "
    "names than the scheduler's chain (parent's name + the block's tokens).",
}
HASH_MISTAKES = (
    Mistake("each block hashed alone", _hashes_alone, "differ in block 0"),
    Mistake("the partial last block named too", _hashes_partial_too, "is not full"),
    Mistake("the whole prefix hashed for each block", _hashes_whole_prefix, "O(N²"),
)


def _describe_hashes(tokens, block_size):
    shown = f" {tokens}" if len(tokens) <= 12 else ""
    return f"{len(tokens)} tokens{shown} in blocks of {block_size}"


def check_block_hashes(student, show: bool = True) -> Result:
    """``student(tokens, block_size) -> [bytes]``; against the reference and, for two prompts,
    the names a ``Scheduler`` gives their blocks."""
    def alone():  # why, with what the student's own names do on the pair of prompts
        return HASH_WHYS["each block hashed alone"] + (_pair_example(student) or (
            f" Two prompts that differ in block 0 and share block 1 ({_PAIR[0]} and "
            f"{_PAIR[1]}, blocks of 4) would get one name for block 1: the second would be "
            f"handed the first's K and V for it, computed after other tokens."))

    return _check_python("block_hashes", student, _hash_cases(), _compare_hashes,
                         _describe_hashes, HASH_HINTS, HASH_MISTAKES,
                         {**HASH_WHYS, "each block hashed alone": alone}, show)


register(Exercise(
    name="block_hashes", lesson=LESSON, kind="python",
    writes="the chained names of a prompt's full blocks (prefix caching)", lines=4,
    check=check_block_hashes, solution=block_hashes_solution, stub=block_hashes,
    mistakes=HASH_MISTAKES, hints=HASH_HINTS))


# =============================================================================================
# 3. cascade attention's merge of two partial states
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def merge_state_student(o_a, lse_a, o_b, lse_b):
    """Two partial attentions of the same queries over disjoint key sets: o_a, o_b (..., D)
    each normalised over its own keys, lse_a, lse_b (...) natural-log log-sum-exps (−inf: the
    part saw no key, its o is 0). Returns (o, lse) as if one attention had seen both sets."""
    # TODO: the merged o and lse, with no overflow and no NaN
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def merge_state_solution(o_a, lse_a, o_b, lse_b):
    """Each part weighs e^{lse_part − lse}; everything relative to the larger lse, so no
    exponent is positive; a row no part saw keeps o = 0, lse = −inf."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)  # no key at all
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # (...), each <= 1
    total = w_a + w_b
    seen = total > 0
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / torch.where(seen, total, 1.0)[..., None]
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, 1.0)), float("-inf"))
    return o, lse


def _merge_mean(o_a, lse_a, o_b, lse_b):
    return (o_a + o_b) / 2, torch.logaddexp(lse_a, lse_b)


def _merge_no_max(o_a, lse_a, o_b, lse_b):
    e_a, e_b = torch.exp(lse_a), torch.exp(lse_b)  # inf once lse > 88 in fp32
    o = (e_a[..., None] * o_a + e_b[..., None] * o_b) / (e_a + e_b)[..., None]
    return o, torch.log(e_a + e_b)


def _merge_relative_to_a(o_a, lse_a, o_b, lse_b):
    lse = lse_a + torch.log1p(torch.exp(lse_b - lse_a))
    return (torch.exp(lse_a - lse)[..., None] * o_a
            + torch.exp(lse_b - lse)[..., None] * o_b), lse


def _merge_no_guard(o_a, lse_a, o_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse)[..., None] * o_a
            + torch.exp(lse_b - lse)[..., None] * o_b), lse


def _part(scores, v):
    """(o, lse) of attention with these scores (..., n) over values v (n, D); n = 0: no key."""
    if scores.shape[-1] == 0:
        return (torch.zeros(*scores.shape[:-1], v.shape[-1]),
                torch.full(scores.shape[:-1], float("-inf")))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _merge_cases():
    """(o_a, lse_a, o_b, lse_b) fp32 from real attention over two key sets; parts without
    keys where ``empty`` says (rows of a: -1, rows of b: 1, both: 2)."""
    gen = torch.Generator().manual_seed(16)
    cases = []
    for lead, D, shift, empty in (((2, 4, 1), 16, 0.0, {}), ((3, 8), 32, 100.0, {}),
                                  ((5,), 16, 0.0, {0: -1, 2: -1, 3: 1}),
                                  ((2, 3), 8, 100.0, {1: 2, 4: -1})):
        rows = torch.Size(lead).numel()
        s = torch.randn(rows, 24, generator=gen) * 3 + shift
        s[:, :10] += torch.rand(rows, 1, generator=gen) * 20 if shift else 0.0
        v = torch.randn(24, D, generator=gen)
        o_a, lse_a = _part(s[:, :10], v[:10])
        o_b, lse_b = _part(s[:, 10:], v[10:])
        for r, which in empty.items():
            if which in (-1, 2):
                o_a[r], lse_a[r] = 0.0, float("-inf")
            if which in (1, 2):
                o_b[r], lse_b[r] = 0.0, float("-inf")
        cases.append(tuple(t.reshape(*lead, *t.shape[1:]).contiguous()
                           for t in (o_a, lse_a, o_b, lse_b)))
    return [(c, tuple(t.float().cpu() for t in library_merge_state(*(x.to(DEVICE) for x in c))))
            for c in cases]  # (the library's kernel runs where the course runs: a GPU's)


def _describe_merge(o_a, lse_a, o_b, lse_b):
    text = f"o {tuple(o_a.shape)}, lse {tuple(lse_a.shape)}"
    finite = torch.cat([lse_a[lse_a.isfinite()], lse_b[lse_b.isfinite()]])
    if finite.numel() and finite.min() > 80:
        text += (f", lse from {finite.min():.0f} to {finite.max():.0f}: e^lse overflows fp32 "
                 "(e^89 already does)")
    both = (lse_a == float("-inf")) & (lse_b == float("-inf"))
    one = (lse_a == float("-inf")) ^ (lse_b == float("-inf"))
    for rows, what in ((one, "one part saw no key (lse = −inf, o = 0)"),
                       (both, "neither part saw a key")):
        if rows.any():
            text += f", {int(rows.sum())} row{'s' * (int(rows.sum()) > 1)} where {what}"
    return text


def _compare_merge(got, want, args):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"return a pair (o, lse), got {type(got).__name__}"
    why = _compare(_as_array(tuple(got)), _as_array(want), 1e-5, 1e-6)
    if why and why.startswith("item "):
        i = int(why.split(":")[0].split()[1])
        why = f"{('o', 'lse')[i]}:{why.split(':', 1)[1]}"
    return why


MERGE_HINTS = (
    "e^{lse_a} is the sum of part a's e^{s_j}: the merged lse is the log of the two sums "
    "added, and each o weighs its part's share of that total.",
    "compute the weights relative to the larger of the two lse's (lesson 01's safe softmax), "
    "so every exponent is ≤ 0: with lse ≈ 100, e^lse is inf in fp32.",
    "a part with lse = −inf weighs 0. When both are −inf, the larger is −inf too, and "
    "−inf − (−inf) is NaN: use 0 as the reference there, and give that row o = 0, lse = −inf.",
)
MERGE_WHYS = {
    "the mean of the two o's": "Each part must weigh its share of the softmax mass, "
    "e^{lse_part − lse}: a part with more (or larger) scores counts more.",
    "e^lse without subtracting the max": "e^lse overflows fp32 once lse > 88: inf / inf is NaN.",
    "lse_a + log1p(e^(lse_b − lse_a))": "Written relative to part a, a row where a saw no key "
    "gives −inf + inf = NaN; take the larger lse as the reference.",
    "no guard where both parts saw no key": "There lse = −inf and e^(−inf − (−inf)) is NaN: "
    "such a row must give o = 0 and lse = −inf.",
}
MERGE_MISTAKES = (
    Mistake("the mean of the two o's", _merge_mean, "values differ"),
    Mistake("e^lse without subtracting the max", _merge_no_max, "overflows fp32"),
    Mistake("lse_a + log1p(e^(lse_b − lse_a))", _merge_relative_to_a, "one part saw no key"),
    Mistake("no guard where both parts saw no key", _merge_no_guard, "neither part"),
)


def check_merge_state(student, show: bool = True) -> Result:
    """``student(o_a, lse_a, o_b, lse_b) -> (o, lse)``; against ``ops.cascade.merge_state``."""
    return _check_python("merge_state", student, _merge_cases(), _compare_merge,
                         _describe_merge, MERGE_HINTS, MERGE_MISTAKES, MERGE_WHYS, show)


register(Exercise(
    name="merge_state", lesson=LESSON, kind="python",
    writes="cascade attention's merge of two (o, lse) states, stable, −inf parts", lines=7,
    check=check_merge_state, solution=merge_state_solution, stub=merge_state_student,
    mistakes=MERGE_MISTAKES, hints=MERGE_HINTS))


# =============================================================================================
# 4. a decode kernel over an 8-bit cache
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
@triton.jit
def kv8_decode_kernel(Q, K, V, K_SCALE, V_SCALE, SEQLENS, O, qk_scale, H_KV, N_MAX,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    bg = tl.program_id(0)  # b * H_KV + g: sequence b, K/V head g
    b = bg // H_KV
    g = bg % H_KV
    seqlen = tl.load(SEQLENS + b)
    offs_m = tl.arange(0, BLOCK_M)  # rows: the GROUP query heads of K/V head g, padded
    row_ok = offs_m < GROUP
    head = g * GROUP + offs_m  # the query head of each row
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (b * H_KV * GROUP + head)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_rows, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
    k_base = K + bg * N_MAX * HEAD_DIM  # int8 key n of (b, g) at k_base + n * HEAD_DIM
    v_base = V + bg * N_MAX * HEAD_DIM  # int8 value n likewise
    ks_base = K_SCALE + bg * N_MAX  # fp32 scale of key n at ks_base + n
    vs_base = V_SCALE + bg * N_MAX  # fp32 scale of value n at vs_base + n
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    for start_n in range(0, seqlen, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # this tile's keys
        n_ok = ...  # TODO: the keys of this tile that exist
        k = ...  # TODO: the int8 K tile (BLOCK_N, HEAD_DIM), converted to q's dtype
        v = ...  # TODO: the int8 V tile (BLOCK_N, HEAD_DIM), converted to q's dtype
        k_scale = ...  # TODO: the tile's key scales (BLOCK_N,)
        v_scale = ...  # TODO: the tile's value scales (BLOCK_N,)
        s = ...  # TODO: the base-2 scores (BLOCK_M, BLOCK_N), −inf where no key
        m_new = ...  # TODO
        alpha = ...  # TODO
        p = ...  # TODO
        l_i = ...  # TODO
        acc = ...  # TODO: this tile's share of p·v
        m_i = ...  # TODO
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(O + q_rows, o, mask=row_ok[:, None])


# --- the reference and the mistakes ---------------------------------------------------------
@triton.jit
def _kv8_solution(Q, K, V, K_SCALE, V_SCALE, SEQLENS, O, qk_scale, H_KV, N_MAX,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    bg = tl.program_id(0)  # b * H_KV + g: sequence b, K/V head g
    b = bg // H_KV
    g = bg % H_KV
    seqlen = tl.load(SEQLENS + b)
    offs_m = tl.arange(0, BLOCK_M)  # rows: the GROUP query heads of K/V head g, padded
    row_ok = offs_m < GROUP
    head = g * GROUP + offs_m  # the query head of each row
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (b * H_KV * GROUP + head)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_rows, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
    k_base = K + bg * N_MAX * HEAD_DIM  # int8 key n of (b, g) at k_base + n * HEAD_DIM
    v_base = V + bg * N_MAX * HEAD_DIM  # int8 value n likewise
    ks_base = K_SCALE + bg * N_MAX  # fp32 scale of key n at ks_base + n
    vs_base = V_SCALE + bg * N_MAX  # fp32 scale of value n at vs_base + n
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of p
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of p·v, not divided
    for start_n in range(0, seqlen, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # this tile's keys
        n_ok = offs_n < seqlen
        kv = offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # (BLOCK_N, HEAD_DIM) offsets
        k = tl.load(k_base + kv, mask=n_ok[:, None], other=0).to(q.dtype)  # exact: |k̂| <= 127
        v = tl.load(v_base + kv, mask=n_ok[:, None], other=0).to(q.dtype)
        k_scale = tl.load(ks_base + offs_n, mask=n_ok, other=0.0)
        v_scale = tl.load(vs_base + offs_n, mask=n_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * k_scale[None, :] * qk_scale  # q·(k̂·k_scale), base 2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p * v_scale[None, :], v)  # Σ p·v_scale·v̂
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(O + q_rows, o, mask=row_ok[:, None])


_S_LINE = "s = tl.dot(q, tl.trans(k)) * k_scale[None, :] * qk_scale"
_ACC_LINE = "acc = acc * alpha[:, None] + tl.dot(p * v_scale[None, :], v)"
_KV8_WRONG = {
    "no_scales": kernel_variant(_kv8_solution, (_S_LINE, "s = tl.dot(q, tl.trans(k)) * qk_scale"),
                                (_ACC_LINE, "acc = acc * alpha[:, None] + tl.dot(p, v)")),
    "k_scale_rows": kernel_variant(_kv8_solution, (_S_LINE, _S_LINE.replace(
        "k_scale[None, :]", "k_scale[:, None]"))),
    "v_scale_acc_rows": kernel_variant(_kv8_solution, (
        _ACC_LINE, "acc = acc * alpha[:, None] + tl.dot(p, v) * v_scale[:, None]")),
    "v_scale_d": kernel_variant(_kv8_solution, (
        _ACC_LINE, "acc = acc * alpha[:, None] + tl.dot(p, v * v_scale[None, :])")),
    "no_where": kernel_variant(_kv8_solution, (
        '        s = tl.where(n_ok[None, :], s, float("-inf"))\n', "")),
    "unmasked": kernel_variant(
        _kv8_solution,
        ("tl.load(k_base + kv, mask=n_ok[:, None], other=0)", "tl.load(k_base + kv)"),
        ("tl.load(v_base + kv, mask=n_ok[:, None], other=0)", "tl.load(v_base + kv)"),
        ("tl.load(ks_base + offs_n, mask=n_ok, other=0.0)", "tl.load(ks_base + offs_n)"),
        ("tl.load(vs_base + offs_n, mask=n_ok, other=0.0)", "tl.load(vs_base + offs_n)")),
}


def _kv8_case(seed, B, H_kv, group, D, n_max, lens, label):
    """q (B, H, D) fp32 and an int8 cache quantized by ``kvquant.quantize_kv`` from keys and
    values whose size varies a lot from token to token; past each length, scales of NaN (a
    cache holds whatever it held) and int8 garbage."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * group, D, generator=gen)
    size = torch.exp(torch.randn(2, B, H_kv, n_max, 1, generator=gen))  # per token and head
    k_q, k_scale = quantize_kv(torch.randn(B, H_kv, n_max, D, generator=gen) * size[0])
    v_q, v_scale = quantize_kv(torch.randn(B, H_kv, n_max, D, generator=gen) * size[1])
    for b, n in enumerate(lens):
        k_scale[b, :, n:] = v_scale[b, :, n:] = float("nan")
        k_q[b, :, n:] = v_q[b, :, n:] = 99
    return (q, k_q, v_q, k_scale, v_scale, torch.tensor(lens, dtype=torch.int32), group,
            label)


def _kv8_cases():
    return [
        _kv8_case(0, 1, 1, 4, 16, 64, [64], "1 sequence of 64 keys (4 whole tiles), a group "
                  "of 4 query heads, D = 16"),
        _kv8_case(1, 2, 2, 3, 32, 80, [80, 37], "2 sequences of 80 and 37 keys, 2 K/V heads, "
                  "groups of 3, D = 32: the second's last tile ends at key 37 (the cache "
                  "holds NaN scales past it)"),
        _kv8_case(2, 3, 1, 5, 16, 20, [1, 20, 13], "3 sequences of 1, 20 and 13 keys, a group "
                  "of 5: the last tiles hang past the length and the cache's end"),
    ]


def prepare_kv8(q, k_q, v_q, k_scale, v_scale, lens, group, label=""):
    """One launch: a program per (sequence, K/V head); o poisoned."""
    B, H, D = q.shape
    H_kv, n_max = k_q.shape[1], k_q.shape[2]
    o = poisoned(B, H, D, like=q)
    args = dict(Q=q, K=k_q, V=v_q, K_SCALE=k_scale, V_SCALE=v_scale, SEQLENS=lens, O=o,
                qk_scale=D ** -0.5 * LOG2E, H_KV=H_kv, N_MAX=n_max, GROUP=group, HEAD_DIM=D,
                BLOCK_M=BLOCK, BLOCK_N=BLOCK, **EXACT_DOTS)
    return (B * H_kv,), args, o


def _kv8_spec(q, k_q, v_q, k_scale, v_scale, lens, group, label=""):
    """Attention of each query head to its sequence's dequantized keys, in float64."""
    k, v = (dequantize_kv(x, s, torch.float64) for x, s in ((k_q, k_scale), (v_q, v_scale)))
    B, H, D = q.shape
    o = torch.zeros(B, H, D, dtype=torch.float64)
    kv_head = torch.arange(H) // group
    for b, n in enumerate(lens.tolist()):
        s = torch.einsum("hd,hnd->hn", q[b].double(), k[b, kv_head, :n]) * D ** -0.5
        o[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v[b, kv_head, :n])
    return o


KV8_HINTS = (
    "key n is k̂_n·k_scale_n, so q·k_n = (q·k̂_n)·k_scale_n: one scale per column of the "
    "scores. Likewise Σ_n p_n·v_n = Σ_n (p_n·v_scale_n)·v̂_n: one scale per column of p.",
    "load the int8 tiles and the two (BLOCK_N,) scale vectors under the tile's mask (other=0), "
    "and convert the int8 tiles to q's dtype (exact: |k̂| <= 127) before tl.dot.",
    "then lesson 12's loop: base-2 scores (qk_scale holds sm_scale·log2 e), −inf where the "
    "key does not exist, the running max, α, p, l_i and acc rescaled. The value scales "
    "multiply p, not l_i: l_i sums the weights themselves.",
)
KV8_WHYS = {
    "the scales forgotten": "o comes out in the int8 cache's units (values up to 127), not "
    "the real keys' and values': each score and each value must be multiplied by its "
    "token's scale.",
    "k_scale along the rows": "k_scale[:, None] scales row i of the scores by key i's scale "
    "(BLOCK_M = BLOCK_N hides the shape error): a key's scale belongs to its column.",
    "v_scale on acc's rows": "tl.dot(p, v) has already summed over the keys; key n's scale "
    "must weigh key n's term inside the sum: on p's column n (or v̂'s row n).",
    "v_scale along v's D axis": "v * v_scale[None, :] scales column d of the values by key "
    "d's scale (D = BLOCK_N hides the shape error): key n's scale belongs to v̂'s row n.",
    "no −inf for keys past the length": "Keys past the length load as 0, so their score is 0 "
    "and 2^(0 − m) joins l_i: o shrinks. A tile that hangs over the end must set them to −inf.",
    "loads without their mask": "The tile reads the cache past the sequence's length: scales "
    "there are whatever the cache held (NaN here), and 0 · NaN is NaN; at the cache's end the "
    "load leaves the tensor.",
}


KV8_NUDGES = {
    "NaN: never written": "NaN where a number belongs: past a sequence's length the cache holds "
                          "whatever it held (NaN scales here); a value loaded there, even "
                          "with p = 0, makes 0 · NaN = NaN. Mask every load of the tile, with "
                          "other=0.",
}


def check_kv8_decode_kernel(kernel, show: bool = True) -> Result:
    """``kernel``: your ``@triton.jit`` decode over an int8 cache; one program per (sequence,
    K/V head), against attention over ``dequantize_kv``'s keys and values in float64."""
    result = check_kernel("kv8_decode_kernel", kernel, prepare_kv8, _kv8_spec, _kv8_cases(),
                          hints=KV8_HINTS, show=False, describe=lambda c: c[-1],
                          nudges=KV8_NUDGES, undefined=float("nan"), **TOL)
    head, sep, tail = result.message.partition("does: ")  # the diagnosis: add why, after it
    if sep:
        end = tail.index(".") + 1
        whys = [why for label, why in KV8_WHYS.items() if label in tail[:end]]
        result.message = head + sep + tail[:end] + "".join(" " + w for w in whys) + tail[end:]
    return _report(result, show)


register(Exercise(
    name="kv8_decode_kernel", lesson=LESSON, kind="triton",
    writes="the loop body of a decode over an int8 cache: masked int8 tiles and their scales, "
           "the scales outside both products, the online softmax", lines=14,
    check=check_kv8_decode_kernel, solution=_kv8_solution, stub=kv8_decode_kernel,
    extra=(prepare_kv8,),
    mistakes=(Mistake("the scales forgotten", _KV8_WRONG["no_scales"], "values differ"),
              Mistake("k_scale along the rows", _KV8_WRONG["k_scale_rows"], "values differ"),
              Mistake("v_scale on acc's rows", _KV8_WRONG["v_scale_acc_rows"], "values differ"),
              Mistake("v_scale along v's D axis", _KV8_WRONG["v_scale_d"], "values differ"),
              Mistake("no −inf for keys past the length", _KV8_WRONG["no_where"],
                      "values differ"),
              Mistake("loads without their mask", _KV8_WRONG["unmasked"], "NaN"),
              Mistake("an answer in PyTorch, no kernel", _kv8_spec, "@triton.jit kernel")),
    hints=KV8_HINTS))


# =============================================================================================
# 5. speculative decoding: accept or reject one drafted token
# =============================================================================================

# --- what the notebook shows ----------------------------------------------------------------
def accept_draft(p, q, x, u):
    """p (V,): the target's distribution; q (V,): the draft's, from which token x was drawn;
    u: a uniform draw in [0, 1). Returns (accepted, residual): residual (V,) is the
    distribution to draw the replacement from when x is rejected, None when it is accepted."""
    # TODO: the acceptance test, and the residual on rejection
    raise NotImplementedError


# --- the reference and the mistakes ---------------------------------------------------------
def accept_draft_solution(p, q, x, u):
    """Leviathan et al.'s rule: accept with probability min(1, p(x) / q(x)); on rejection draw
    from norm(max(p − q, 0)), which makes the output distributed as p."""
    if u < min(1.0, float(p[x] / q[x])):
        return True, None
    residual = torch.clamp(p - q, min=0.0)
    return False, residual / residual.sum()


def _accept_if_likelier(p, q, x, u):
    if p[x] > q[x]:
        return True, None
    r = (p - q).clamp_min(0)
    return False, r / r.sum()


def _accept_by_p(p, q, x, u):
    if u < p[x]:
        return True, None
    r = (p - q).clamp_min(0)
    return False, r / r.sum()


def _residual_no_clamp(p, q, x, u):
    if u < p[x] / q[x]:
        return True, None
    return False, (p - q) / (p - q).sum()


def _residual_unnormalised(p, q, x, u):
    if u < p[x] / q[x]:
        return True, None
    return False, (p - q).clamp_min(0)


def _residual_flipped(p, q, x, u):
    if u < p[x] / q[x]:
        return True, None
    r = (q - p).clamp_min(0)
    return False, r / r.sum()


def _accept_cases():
    gen = torch.Generator().manual_seed(160)
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    p1, q1 = t(.1, .4, .2, .1, .1, .1), t(.3, .1, .2, .2, .1, .1)
    p2, q2 = t(.05, .35, .25, .05, .2, .1), t(.3, .1, .1, .2, .2, .1)
    cases = [(p1, q1, 1, 0.97),  # p(x) = 4 q(x): always accepted
             (p1, q1, 0, 0.05),  # p(x) / q(x) = 1/3 and u below it: accepted
             (p2, q2, 0, 0.6),   # p(x) / q(x) = 1/6: rejected
             (p2, q2, 3, 0.2),   # p(x) / q(x) = 1/4 and u below it: accepted
             (t(0, .5, .5, 0, 0, 0), t(.25, .25, .25, .25, 0, 0), 3, 0.001)]  # p(x) = 0
    for _ in range(2):
        p, q = (torch.softmax(torch.randn(50, generator=gen, dtype=torch.float64) * 2, 0)
                for _ in range(2))
        x = int(torch.multinomial(q, 1, generator=gen))
        cases.append((p, q, x, min(0.999, float(p[x] / q[x]) * 1.02)))  # above the ratio
    return [(c, _library_accept(*c)) for c in cases]


def _library_accept(p, q, x, u):
    """The library's test (``accept_tree``: u < p(x) / q(x)) and its ``_residual``."""
    accepted = bool(u < p[x] / q[x])
    return accepted, None if accepted else _residual(p, q)


def _describe_accept(p, q, x, u):
    return (f"V = {len(p)}, x = {x}: p(x) = {float(p[x]):.3g}, q(x) = {float(q[x]):.3g}, "
            f"u = {u:.3g}")


def _compare_accept(got, want, args):
    p, q, x, u = args
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"return a pair (accepted, residual), got {type(got).__name__}"
    accepted, residual = bool(got[0]), got[1]
    if accepted != want[0]:
        verb = {True: "accepts", False: "rejects"}
        return (f"yours {verb[accepted]} x, expected: it {verb[want[0]]} it "
                f"(p(x) / q(x) = {float(p[x] / q[x]):.3g}, u = {u:.3g})")
    if want[1] is None:
        return None if residual is None else "x is accepted: return None as the residual"
    if residual is None:
        return "x is rejected: return the residual distribution, not None"
    r = torch.as_tensor(residual, dtype=torch.float64)
    why = _compare(_as_array(r), _as_array(want[1]), 1e-9, 1e-12)
    if why is None:
        return None
    total = float(r.sum())
    if torch.isfinite(r).all() and (r < 0).any():
        why += f". Yours has negative entries (down to {float(r.min()):.3g}): not a distribution"
    elif torch.isfinite(r).all() and abs(total - 1) > 1e-6:
        why += f". Yours sums to {total:.3g}, not 1"
    return why


ACCEPT_HINTS = (
    "the test must be random: x is kept with a probability, compared against u, and that "
    "probability is 1 whenever the target likes x at least as much as the draft did.",
    "on rejection the replacement must come from where the target has more mass than the "
    "draft: the tokens with p > q, each in proportion to how much more.",
    "the residual is a distribution: no negative entries (the tokens where p < q get 0), and "
    "it sums to 1.",
)
ACCEPT_WHYS = {
    "accept iff p(x) > q(x)": "A deterministic test keeps every token the target likes more and "
    "drops every other: the output is no longer distributed as p. x must be kept with "
    "probability min(1, p(x)/q(x)), drawn against u.",
    "accept with probability p(x)": "p(x) alone ignores how likely the draft was to propose x: "
    "a token the draft proposes rarely must be kept more often.",
    "residual p − q without the clamp at 0": "p − q sums to 0 (both sum to 1): dividing by it "
    "gives ±inf and NaN; the tokens where p < q must get 0 first.",
    "residual not normalised": "max(p − q, 0) sums to less than 1: divide by its sum.",
    "residual max(q − p, 0)": "That is where the draft has more mass than the target: the "
    "replacement must come from where p exceeds q.",
}
ACCEPT_MISTAKES = (
    Mistake("accept iff p(x) > q(x)", _accept_if_likelier, "expected: it accepts"),
    Mistake("accept with probability p(x)", _accept_by_p, "a token the draft proposes"),
    Mistake("residual p − q without the clamp at 0", _residual_no_clamp, "sums to 0"),
    Mistake("residual not normalised", _residual_unnormalised, "not 1"),
    Mistake("residual max(q − p, 0)", _residual_flipped, "where p exceeds q"),
)


def check_accept_draft(student, show: bool = True) -> Result:
    """``student(p, q, x, u) -> (accepted, residual or None)``; against the test and the
    residual of ``course_lib.serving.speculative``."""
    return _check_python("accept_draft", student, _accept_cases(), _compare_accept,
                         _describe_accept, ACCEPT_HINTS, ACCEPT_MISTAKES, ACCEPT_WHYS, show)


register(Exercise(
    name="accept_draft", lesson=LESSON, kind="python",
    writes="speculative decoding's test of one drafted token and the residual on rejection",
    lines=4, check=check_accept_draft, solution=accept_draft_solution, stub=accept_draft,
    mistakes=ACCEPT_MISTAKES, hints=ACCEPT_HINTS))


# =============================================================================================
# 6. questions with a number
# =============================================================================================
def _kv_bytes(dtype) -> int:
    return kv_bytes_per_token(8, 128, dtype)


_FP16, _INT8 = _kv_bytes(torch.float16), _kv_bytes(torch.int8)

register(Question(
    name="q16_kv8_bytes", lesson=LESSON,
    asks="How many bytes does one token add to one layer's cache with H_kv = 8, D = 128 in "
         "int8, with one fp32 scale per token and head for K and for V? (fp16: 4096.)",
    value=_INT8, rtol=0.01,
    answer=(
        f"{_INT8:,} bytes. The values: 2 (K and V) · 8 heads · 128 · 1 byte = 2,048. The "
        f"scales: 2 · 8 heads · 4 bytes = 64. In fp16 the same token takes 2 · 8 · 128 · 2 = "
        f"{_FP16:,} bytes, so the 8-bit cache is {_FP16 / _INT8:.2f}x smaller, not 2x: the "
        f"scales cost 64 / 2,048 = 3% on top (kvquant.kv_bytes_per_token computes it). A "
        f"decode step reads every byte of the cache, so its floor drops by the same "
        f"{_FP16 / _INT8:.2f}x, and the tokens that fit beside the weights grow by it. A scale "
        f"per head and tensor (vLLM's FP8 cache, "
        f"https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/) would cost "
        f"nothing per token; per token keeps each row's error at half its own step.")))

_B, _P, _OWN = 64, 4096, 256
_WHOLE, _CASCADE = _B * (_P + _OWN), _P + _B * _OWN  # tokens of K and V read
_RATIO = _WHOLE / _CASCADE

register(Question(
    name="q16_cascade_bytes", lesson=LESSON,
    asks="64 requests share a 4096-token prefix and have 256 tokens of their own (H_kv 8, "
         "D 128, fp16). One decode step: how many times fewer bytes of K and V does cascade "
         "attention read than attention over each request's whole context?",
    value=_RATIO, rtol=0.02,
    answer=(
        f"About {_RATIO:.1f}x. Each token's K and V take 2 · 8 · 128 · 2 = {_FP16:,} bytes per "
        f"layer. Each request reading its whole context reads 64 · (4096 + 256) = {_WHOLE:,} "
        f"tokens: {_WHOLE * _FP16 / 1e9:.2f} GB per layer. Cascade attention reads the prefix "
        f"once for all 64 requests and each request's own tokens: 4096 + 64 · 256 = "
        f"{_CASCADE:,} tokens, {_CASCADE * _FP16 / 1e6:.1f} MB. The ratio, "
        f"(64 · 4352) / (4096 + 64 · 256) = {_RATIO:.1f}, does not depend on the layer or "
        f"the head size. It is a bound on the time, not the time: ops/cascade.py measures "
        f"3.22x on an H200 at this shape (four launches, the merge, the suffixes' reads), and "
        f"the gap grows with the prefix (9.31x at P = 16k). FlashInfer's cascade inference "
        f"(Ye et al., 2024, https://flashinfer.ai/2024/02/02/cascade-inference.html) and "
        f"Hydragen (Juravsky et al., 2024, https://arxiv.org/abs/2402.05099) do this.")))
