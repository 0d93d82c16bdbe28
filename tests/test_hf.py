"""course_lib.hf: the course's kernels as a Hugging Face attention implementation.

A small LLaMA with random weights (nothing downloaded): logits against an fp64 eager reference
with the 2x rule, greedy tokens identical to eager's, decode steps really routed to
flash_decode, chunked prefill and multi-token decode against a cache, a static cache, gradients.
Then what real open checkpoints need, on tiny random-weight configs of four families
(``hf.small_config``): a left-padded batch of three prompts (LLaMA), a sliding window shorter
than the prompt and generation past it (Mistral), soft-capped logits, query_pre_attn_scalar and
sliding and global layers in turn (Gemma 2), learned sinks and sliding layers (GPT-OSS): the
logits of every real token against each prompt run alone in fp64 by transformers' eager
attention (2x rule), greedy tokens identical to eager's, every attention call counted as served
by a course kernel: the decode steps without padding by flash_decode, with the window, softcap
and sinks (eager and compiled). And the clear errors for what the kernels cannot do (holes in
a padding mask, chunked attention, a bidirectional window, dropout).
"""
import contextlib
import copy
import weakref

import pytest
import torch

pytest.importorskip("transformers", reason="transformers (the course's [hf] extra) is missing")

from course_lib import DEVICE, hf  # noqa: E402
from course_lib.hf import attention as hf_attention  # noqa: E402
from course_lib.testing import assert_close_2x, errors  # noqa: E402


def _ids(batch, n, seed=0, vocab=1000):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, n), generator=gen).to(DEVICE)


@pytest.fixture(scope="module")
def model():
    return hf.make_llama(hf.small_llama_config(num_hidden_layers=2))


@pytest.fixture(scope="module")
def reference(model):
    """The same weights in float64 with eager attention: the reference."""
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation("eager")
    return ref


def _logits(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    try:
        with torch.inference_mode():
            return model(ids, **kw).logits
    finally:
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)


def test_registered_names():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[hf.ATTN_IMPLEMENTATION] is \
        hf.course_attention_forward
    assert AttentionMaskInterface._global_mapping[hf.ATTN_IMPLEMENTATION] is \
        hf.course_attention_mask
    assert "flash" not in hf.ATTN_IMPLEMENTATION  # transformers would look for a hub kernel


@pytest.mark.parametrize("batch,n", [(2, 37), (1, 64)])
def test_logits_match_eager_2x_rule(model, reference, batch, n):
    ids = _ids(batch, n, seed=n)
    with torch.inference_mode():
        ref = reference(ids).logits
    ours = _logits(model, hf.ATTN_IMPLEMENTATION, ids)
    for impl in ("sdpa", "eager"):
        assert_close_2x(ours, ref, _logits(model, impl, ids), name=f"logits vs {impl}",
                        atol=1e-5)


def test_greedy_32_tokens_identical_to_eager_and_decode_uses_flash_decode(model):
    ids = _ids(1, 20, seed=1)
    model.set_attn_implementation("eager")
    want = hf.greedy(model, ids, 32)
    model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    hf.CALLS.clear()
    got = hf.greedy(model, ids, 32)
    print("eager :", want[0].tolist())
    print("course:", got[0].tolist())
    assert torch.equal(got, want)
    layers = model.config.num_hidden_layers
    assert hf.CALLS == {"prefill": layers, "decode": 31 * layers}, hf.CALLS


@pytest.mark.parametrize("first,second", [(9, 20), (16, 4), (28, 1)])
def test_chunks_after_a_cache_match_one_forward(model, first, second):
    """Chunked prefill (> 16 new tokens: flash_attn_v2 bottom-right causal) and multi-token
    decode (<= 16: flash_decode causal among the new tokens) against a DynamicCache."""
    ids = _ids(2, first + second, seed=first)
    hf.CALLS.clear()
    with torch.inference_mode():
        full = model(ids).logits
        out = model(ids[:, :first], use_cache=True)
        out2 = model(ids[:, first:], past_key_values=out.past_key_values, use_cache=True)
    route = "prefill" if second > hf.DECODE_MAX_QUERIES else "decode"
    assert hf.CALLS[route] >= model.config.num_hidden_layers, hf.CALLS
    err, _ = errors(out2.logits, full[:, first:])
    print(f"chunk of {second} after {first}: max err {err:.2e} ({route})")
    assert err < 1e-4


def test_static_cache_generation_matches_eager(model):
    """A StaticCache gives the kernels a padded cache and a causal mask over its used part."""
    ids = _ids(1, 12, seed=3)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
              pad_token_id=0)
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        want = model.generate(ids, **kw)
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
        got = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(got, want)


def test_compiled_static_cache_generation_matches_eager(model):
    """The way models are deployed: a static cache and a compiled decode step (fullgraph: the
    kernels are in the graph as torch.ops.course.*, no graph break). Same greedy tokens."""
    ids = _ids(1, 12, seed=6)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
              pad_token_id=0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        want = model.generate(ids, **kw)
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
        calls = hf.CALLS.copy()
        got = model.generate(ids, cache_implementation="static",
                             compile_config=hf.static_compile_config(), **kw)
    assert torch.equal(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert not torch._dynamo.utils.counters["graph_break"]  # in one graph
    # eager calls are counted, compiled ones are not: one forward (the prompt) ran eagerly,
    # every decode step after it was compiled
    eager_calls = sum(hf.CALLS.values()) - sum(calls.values())
    assert eager_calls == model.config.num_hidden_layers


def test_compiled_prefill_runs_the_causal_forward_and_checks_its_mask(model, reference):
    """torch.compile(fullgraph=True) of a forward with no cache: transformers draws a mask
    (packed sequences cannot be ruled out in a graph); checked on the device to be the plain
    causal one, it sends every layer to flash_attn_fwd, the eager prefill's kernel, not to
    flash_decode. Same logits as eager (2x rule). Position ids that restart (two packed
    sequences) fail the device-side check (tried on the CPU only)."""
    ids = _ids(1, 19, seed=8)
    torch._dynamo.reset()
    ops_seen = []

    def backend(gm, example_inputs):
        ops_seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    with torch.inference_mode():
        got = compiled(ids, use_cache=False).logits
        want = _logits(reference, "eager", ids, use_cache=False)
        eager = _logits(model, "sdpa", ids, use_cache=False)
    assert_close_2x(got, want, eager, name="compiled prefill logits")
    attention_ops = [op.split(".")[1] for op in ops_seen if op.startswith("course.")]
    assert attention_ops == ["flash_attn_fwd"] * model.config.num_hidden_layers
    if DEVICE == "cpu":  # on a GPU a failed device-side assertion ends the CUDA context
        packed = torch.cat([torch.arange(10), torch.arange(9)])[None].to(DEVICE)
        with pytest.raises(RuntimeError, match="another pattern"), torch.inference_mode():
            compiled(ids, position_ids=packed, use_cache=False)
    torch._dynamo.reset()


def test_gradients_match_eager(model):
    """With gradients on, every call goes to flash_attn_v2 (differentiable)."""
    ids = _ids(1, 24, seed=4)
    grads = {}
    for impl in (hf.ATTN_IMPLEMENTATION, "eager"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    model.zero_grad()
    ours, eager = grads[hf.ATTN_IMPLEMENTATION], grads["eager"]
    assert ours.keys() == eager.keys()
    worst = max(errors(ours[n], eager[n])[0] / (eager[n].abs().max().item() + 1e-12)
                for n in eager)
    print(f"worst relative gradient error: {worst:.2e}")
    assert worst < 1e-4


def test_mask_function_returns_none_for_plain_causal():
    ones = torch.ones(2, 10, dtype=torch.bool)
    assert hf.course_attention_mask(2, 10, 10, attention_mask=ones) is None
    assert hf.course_attention_mask(2, 1, 10, q_offset=9, attention_mask=ones) is None
    assert hf.course_attention_mask(2, 4, 10, q_offset=6) is None
    # a static cache that is not full: 6 and 4 keys in use of 10, checked here once per forward;
    # every layer then gets the key counts, (B, 1, 1, 1) int32, not a (B, 1, N_q, N_k) mask
    used = torch.zeros(2, 10, dtype=torch.bool)
    used[0, :6], used[1, :4] = True, True
    lengths = hf.course_attention_mask(2, 1, 10, q_offset=5, attention_mask=used)
    assert lengths.dtype == torch.int32 and lengths.view(-1).tolist() == [6, 4]
    assert hf_attention._lengths_range(lengths) == (4, 6)  # known: no second read back


def test_mask_function_turns_padding_into_key_ranges():
    """Left padding (generate's), right padding, a sliding layer's cache that dropped its oldest
    tokens: each sequence's real queries and the keys they see, (B, 1, 1, 4) int32 = (q_lo,
    q_hi, k_lo, k_hi), never an N_q x N_k mask. Holes in a sequence's padding mask, chunked
    attention: refused."""
    from transformers.masking_utils import (
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )

    left = torch.ones(3, 10, dtype=torch.bool)
    left[0, :3], left[2, :9] = False, False  # 7, 10 and 1 real tokens
    ranges = hf.course_attention_mask(3, 10, 10, attention_mask=left)
    assert ranges.dtype == torch.int32 and ranges.shape == (3, 1, 1, 4)
    assert ranges.view(3, 4).tolist() == [[3, 10, 3, 10], [0, 10, 0, 10], [9, 10, 9, 10]]
    # the next decode step: one query, the 11th token, real in every sequence
    step = torch.cat([left, torch.ones(3, 1, dtype=torch.bool)], 1)
    ranges = hf.course_attention_mask(3, 1, 11, q_offset=10, attention_mask=step)
    assert ranges.view(3, 4).tolist() == [[0, 1, 3, 11], [0, 1, 0, 11], [0, 1, 9, 11]]
    # a sliding layer's cache holds tokens 4..10 (kv_offset 4): sequence 0's padding is gone
    sliding = sliding_window_causal_mask_function(8)
    ranges = hf.course_attention_mask(3, 1, 7, q_offset=10, kv_offset=4, attention_mask=step,
                                      mask_function=sliding, local_size=8)
    assert ranges.view(3, 4).tolist() == [[0, 1, 0, 7], [0, 1, 0, 7], [0, 1, 5, 7]]
    # right padding (a batch scored without generating): the real queries end early
    right = torch.ones(2, 6, dtype=torch.bool)
    right[1, 4:] = False
    ranges = hf.course_attention_mask(2, 6, 6, attention_mask=right)
    assert ranges.view(2, 4).tolist() == [[0, 6, 0, 6], [0, 4, 0, 4]]
    holes = torch.ones(2, 6, dtype=torch.bool)
    holes[0, 2] = False
    with pytest.raises(NotImplementedError, match="holes"):
        hf.course_attention_mask(2, 6, 6, attention_mask=holes)
    chunked = chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="chunked"):
        hf.course_attention_mask(2, 10, 10, mask_function=chunked, local_size=4)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_the_sliding_window_is_inclusive_as_transformers_draws_it(window):
    """transformers' sliding mask function lets query t see keys t - W < j <= t: W keys, its own
    included. hf reads W from the mask function (no mask drawn) and the layer's kernel gets
    FlashAttention's window_size = (W - 1, 0): the same keys as the drawn mask, checked here
    against course_lib.masks, with a cache (N_q != N_k). A drawn 4D mask with left padding
    decomposes into the same key ranges as the 2D padding mask gives."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    from course_lib import masks

    fn = sliding_window_causal_mask_function(window)
    assert hf.mask_pattern(fn) == ("sliding", window)
    drawn = sdpa_mask(batch_size=1, q_length=5, kv_length=12, q_offset=7, mask_function=fn,
                      allow_is_causal_skip=False)[0, 0]  # (5, 12)
    assert torch.equal(drawn, masks.visible(5, 12, (window - 1, 0), drawn.device))
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :4] = False
    drawn = sdpa_mask(batch_size=2, q_length=5, kv_length=12, q_offset=7, mask_function=fn,
                      attention_mask=padding, allow_is_causal_skip=False)
    keys, _ = hf_attention._keys_in_mask(drawn, 5, 12, left=window - 1)
    direct = hf.course_attention_mask(2, 5, 12, q_offset=7, mask_function=fn,
                                      attention_mask=padding, local_size=window)
    assert direct.view(2, 4).tolist() == [[0, 5, 0, 12], [0, 5, 4, 12]]
    if window > 4:  # the window reaches sequence 1's padding: the same ranges, from the drawing
        assert torch.equal(keys, direct)
    else:  # no query sees a key before 8 - W: the drawing starts both ranges there
        assert keys.view(2, 4).tolist() == [[0, 5, 8 - window, 12]] * 2


def test_compiled_decode_with_variants_is_flash_decode(model):
    """A decode step through a static cache with a window, a softcap and sinks, compiled
    (fullgraph, as generate compiles it; aot_eager): the graph holds torch.ops.course.flash_decode
    and no other attention (not flash_attn_varlen), the key counts L_b a tensor of the graph,
    nothing read back. Two sequences of 5 and 30 keys in a 40-slot cache, 3 new tokens each:
    the window (W = 6) is aligned on each sequence's own L_b, and hides keys of the second only.
    Each sequence against course_lib.reference on its first L_b keys, fp64, with the 2x rule,
    compiled and eager (which routes the same way: counted)."""
    from course_lib.reference import attention_variants
    from course_lib.testing import variants_same_precision

    attn = model.model.layers[0].self_attn
    cfg = model.config
    H, H_kv, D, N_max = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 40
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 3, H, D, generator=gen).to(DEVICE).transpose(1, 2)  # (B, H, N_q, D)
    k, v = (torch.randn(2, H_kv, N_max, D, generator=gen).to(DEVICE) for _ in "kv")
    sinks = torch.randn(H, generator=gen).to(DEVICE)
    seen = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    lengths = seen.view(2, 1, 1, 1)  # course_attention_mask's key counts
    W, softcap, scale = 6, 1.5, D ** -0.5

    def step(q, k, v, lengths):
        return hf.course_attention_forward(attn, q, k, v, lengths, scaling=scale, sliding_window=W,
                                           softcap=softcap, s_aux=sinks)[0]

    ops_seen = []

    def backend(gm, example_inputs):
        ops_seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.common.aot_autograd(
            fw_compiler=lambda g, _: g)(gm, example_inputs)

    torch._dynamo.reset()
    with torch.inference_mode():
        hf.CALLS.clear()
        eager = step(q, k, v, lengths)  # (B, N_q, H, D)
        assert hf.CALLS == {"decode": 1}, hf.CALLS
        got = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)(
            q, k, v, lengths)
    torch._dynamo.reset()
    attention_ops = [op.split(".")[1] for op in ops_seen if op.startswith("course.")]
    assert attention_ops == ["flash_decode"], ops_seen
    for b, n in enumerate(seen.tolist()):
        variants = dict(causal=True, sm_scale=scale, window_size=(W - 1, 0), softcap=softcap)
        kb, vb = k[b:b + 1, :, :n], v[b:b + 1, :, :n]
        ref = attention_variants(q[b:b + 1].double(), kb.double(), vb.double(),
                                 sinks=sinks.double(), **variants)
        same = variants_same_precision(q[b:b + 1], kb, vb, sinks=sinks, **variants)
        for name, out in (("compiled", got), ("eager", eager)):
            assert_close_2x(out[b:b + 1], ref.transpose(1, 2), same.transpose(1, 2),
                            name=f"{name} decode, L_b = {n}")


def _reads_back(fn, monkeypatch) -> int:
    """How many times ``fn`` reads tensor values back to the host (``tolist``, ``item``)."""
    reads = []
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, real=real: reads.append(1) or real(self))
    try:
        fn()
    finally:
        monkeypatch.undo()
    return len(reads)


def test_static_cache_steps_read_nothing_back(model, monkeypatch):
    """generate with a static cache asks for the mask before every step, its position a tensor.
    A decode step gets the key counts made on the device: nothing is read back, in the mask or
    in any layer, with the variants too (flash_decode's window, softcap and sinks). A prefill
    into the cache reads the key range back once per forward (to cut the cache to the keys in
    use), not once per layer."""
    attn = model.model.layers[0].self_attn
    cfg = model.config
    H, H_kv, D, N_max = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 40
    k, v = (torch.randn(1, H_kv, N_max, D, device=DEVICE) for _ in "kv")
    sinks = torch.randn(H, device=DEVICE)
    layer_variants = dict(sliding_window=4, softcap=1.5, s_aux=sinks)
    cases = (({}, 1, 6, 0), ({}, 3, 6, 0), ({}, hf.DECODE_MAX_QUERIES + 4, 0, 1),
             (layer_variants, 1, 6, 0), (layer_variants, 3, 6, 0))  # (variants, N_q, offset, reads)
    with torch.inference_mode():
        for variants, n_q, offset, reads in cases:
            q = torch.randn(1, n_q, H, D, device=DEVICE).transpose(1, 2)

            def forward():
                lengths = hf.course_attention_mask(1, n_q, N_max, device=DEVICE,
                                                   q_offset=torch.tensor(offset, device=DEVICE))
                assert lengths.dtype == torch.int32 and lengths.shape == (1, 1, 1, 1)
                for _ in range(2):  # two layers, one mask
                    hf.course_attention_forward(attn, q, k, v, lengths, scaling=D ** -0.5,
                                                **variants)
                return lengths

            hf.CALLS.clear()
            assert _reads_back(forward, monkeypatch) == reads, f"N_q {n_q} {sorted(variants)}"
            route = "decode" if reads == 0 else "prefill"
            assert hf.CALLS == {route: 2}, hf.CALLS
            assert forward().view(-1).tolist() == [offset + n_q]


def test_a_2d_mask_without_padding_is_one_flag_read_back(monkeypatch):
    """transformers 5.17's generate keeps an all-ones 2D mask and, with a static cache, asks
    for the mask with it before every step. With no padding over exactly the tokens seen, the
    key counts come from one read-back of a flag, and the 4D mask is never drawn."""
    from unittest import mock

    n_max = 40
    for q_offset in (6, torch.tensor([6], device=DEVICE)):
        for n_q in (1, 3):
            seen = torch.ones(2, 6 + n_q, dtype=torch.bool, device=DEVICE)

            def step():
                return hf.course_attention_mask(2, n_q, n_max, q_offset=q_offset,
                                                attention_mask=seen, device=DEVICE)

            with mock.patch.object(hf_attention, "sdpa_mask", side_effect=AssertionError("drawn")):
                assert _reads_back(step, monkeypatch) == 1
                lengths = step()
            assert lengths.dtype == torch.int32 and lengths.shape == (2, 1, 1, 1)
            assert lengths.view(-1).tolist() == [6 + n_q] * 2
            assert hf_attention._lengths_range(lengths) == (6 + n_q, 6 + n_q)  # no second read-back
            # nothing kept alive once the model lets go: a tensor held from one generate to the
            # next moves the next static cache in memory, and a compiled step records anew
            gone = weakref.ref(lengths)
            del lengths
            assert gone() is None
    # left padding in one sequence: the key ranges, from the same one read-back, not drawn
    padded = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
    padded[1, :2] = False

    def padded_step():
        return hf.course_attention_mask(2, 1, n_max, q_offset=torch.tensor([6], device=DEVICE),
                                        attention_mask=padded, device=DEVICE)

    with mock.patch.object(hf_attention, "sdpa_mask", side_effect=AssertionError("drawn")):
        assert _reads_back(padded_step, monkeypatch) == 1
        ranges = padded_step()
    assert ranges.view(2, 4).tolist() == [[0, 1, 0, 7], [0, 1, 2, 7]]
    # a mask as long as the cache (zeros for the keys not written yet): drawn and checked
    used = torch.zeros(2, n_max, dtype=torch.bool, device=DEVICE)
    used[:, :7] = True
    lengths = hf.course_attention_mask(2, 1, n_max, q_offset=6, attention_mask=used,
                                       device=DEVICE)
    assert lengths.view(-1).tolist() == [7, 7]


def test_holes_in_a_padding_mask_are_refused_with_a_clear_error(model):
    """Padding in the middle of a sequence (or right padding followed by generated tokens):
    no range of keys expresses it, and the call says so instead of answering wrongly."""
    ids = _ids(2, 12, seed=5)
    attn = torch.ones_like(ids)
    attn[0, 4:7] = 0
    with pytest.raises(NotImplementedError, match="holes"), torch.inference_mode():
        model(ids, attention_mask=attn)


def test_variants_as_transformers_passes_them_match_the_reference():
    """One attention call, GQA, each keyword as the models pass it: sliding_window W (Mistral,
    Gemma 2, GPT-OSS: window (W - 1, 0)), softcap (Gemma 2), s_aux (GPT-OSS's sinks, the
    layer's parameter, cast to fp32) and a scaling that is not D^-0.5; against
    course_lib.reference in fp64 with the 2x rule. With a cache (5 new tokens, 23 keys) the call
    is a decode step, flash_decode's; without one (23 and 23), flash_attn_v2's. Dropout and a
    window on bidirectional attention are refused."""
    from course_lib.reference import attention_variants
    from course_lib.testing import variants_same_precision

    class Layer(torch.nn.Module):
        is_causal = True
        layer_idx = 0

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 5, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2, 23, 16, generator=gen).to(DEVICE) for _ in "kv")
    sinks = torch.nn.Parameter(torch.randn(4, generator=gen).to(DEVICE))
    layer = Layer()
    names = {"sliding_window": "window", "softcap": "softcap", "s_aux": "sinks"}
    q_prefill = torch.randn(2, 4, 23, 16, generator=gen).to(DEVICE)
    for q, route, kw in (
            (q, "decode", dict(sliding_window=6)), (q, "decode", dict(softcap=1.5)),
            (q, "decode", dict(s_aux=sinks)),
            (q, "decode", dict(sliding_window=9, softcap=1.5, s_aux=sinks)),
            (q_prefill, "variants", dict(sliding_window=9, softcap=1.5, s_aux=sinks))):
        hf.CALLS.clear()
        hf.VARIANTS.clear()
        with torch.inference_mode():
            out, weights = hf.course_attention_forward(layer, q, k, v, None, scaling=0.3, **kw)
        assert weights is None and out.shape == (2, q.shape[2], 4, 16)
        variants = dict(sm_scale=0.3, window_size=(kw.get("sliding_window", 0) - 1, 0),
                        softcap=kw.get("softcap", 0.0), sinks=kw.get("s_aux"))
        ref = attention_variants(q.double(), k.double(), v.double(), causal=True, **{
            **variants, "sinks": None if "s_aux" not in kw else sinks.detach().double()})
        same = variants_same_precision(q, k, v, causal=True, **{
            **variants, "sinks": None if "s_aux" not in kw else sinks.detach()})
        assert_close_2x(out, ref.transpose(1, 2), same.transpose(1, 2),
                        name=f"{route} {sorted(kw)}")
        assert hf.CALLS == {route: 1} and set(hf.VARIANTS) == {names[n] for n in kw}
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.course_attention_forward(layer, q, k, v, None, dropout=0.1)
    layer.is_causal = False
    with pytest.raises(NotImplementedError, match="bidirectional"):
        hf.course_attention_forward(layer, q, k, v, None, sliding_window=4)


# ---------------------------------------------------------------------------------------------
# real checkpoints' attention: LLaMA, Mistral, Gemma 2, GPT-OSS (tiny random-weight configs)
# ---------------------------------------------------------------------------------------------

FAMILIES = ("llama", "mistral", "gemma2", "gpt_oss")
PROMPTS = (13, 20, 7)  # three prompts, left-padded to 20; the window (8) is shorter than two


@pytest.fixture(scope="module")
def families():
    """{family: (model fp32, the same weights in fp64 with eager attention)}, built on first
    use. GPT-OSS's sinks are drawn with std 1 (its init's 0.1 would barely move a softmax)."""
    built = {}

    def get(family):
        if family not in built:
            model = hf.make_llama(hf.small_config(family))
            if family == "gpt_oss":
                gen = torch.Generator().manual_seed(11)
                with torch.no_grad():
                    for layer in model.model.layers:
                        sinks = layer.self_attn.sinks
                        sinks.copy_(torch.randn(sinks.shape, generator=gen))
            ref = copy.deepcopy(model).double()
            ref.set_attn_implementation("eager")
            if family == "gpt_oss":
                ref.set_experts_implementation("eager")  # (grouped_mm has no fp64)
            built[family] = model, ref
        return built[family]

    return get


def _left_padded(lengths, seed=0, vocab=128):
    """(ids, attention_mask, position_ids) of prompts of ``lengths`` left-padded with token 0,
    the position ids counted from each prompt's first token, as ``generate`` counts them."""
    n = max(lengths)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        mask[b, n - length:] = 1
    ids = torch.randint(1, vocab, mask.shape, generator=torch.Generator().manual_seed(seed))
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return (ids * mask).to(DEVICE), mask.to(DEVICE), positions.to(DEVICE)


def _n_layers(model, kind=None):
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(
        model.model.layers)
    return sum(kind is None or t == kind for t in types)


@contextlib.contextmanager
def _variant_off(model, family):
    """The family's attention variant switched off, for an eager run: the size of the effect
    the tests check (a window that never bit, or a cap that never bent, would pass anything)."""
    attns = [layer.self_attn for layer in model.model.layers]
    saved = {}
    if family == "mistral":
        saved["window"], model.config.sliding_window = model.config.sliding_window, None
    for attn in attns:
        if family == "gemma2":
            saved[attn] = attn.attn_logit_softcapping
            attn.attn_logit_softcapping = None
        if family == "gpt_oss":
            saved[attn] = attn.sinks.detach().clone()
            attn.sinks.data.fill_(float("-inf"))  # e^-inf: no sink
    try:
        yield
    finally:
        if family == "mistral":
            model.config.sliding_window = saved["window"]
        for attn in attns:
            if family == "gemma2":
                attn.attn_logit_softcapping = saved[attn]
            if family == "gpt_oss":
                attn.sinks.data.copy_(saved[attn])


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_logits_match_each_prompt_alone(families, family):
    """Three prompts of 13, 20 and 7 tokens, left-padded, in one forward (a sliding window of 8
    on Mistral's layers and on every other layer of Gemma 2 and GPT-OSS; Gemma 2's softcap and
    scaling; GPT-OSS's sinks). The logits of every real token against each prompt run alone in
    fp64 by transformers' eager attention: the kernels' error <= 2x that of eager attention on
    the padded batch in fp32, + 1e-5. Every layer's call is served by flash_attn_varlen, with
    the window where it hides keys, the softcap and the sinks (counted)."""
    model, ref = families(family)
    ids, mask, positions = _left_padded(PROMPTS)
    real = mask.bool()
    with torch.inference_mode():
        want = torch.cat([ref(ids[b:b + 1, -n:]).logits[0] for b, n in enumerate(PROMPTS)])
        eager = _logits(model, "eager", ids, attention_mask=mask, position_ids=positions)
        hf.CALLS.clear()
        hf.VARIANTS.clear()
        ours = _logits(model, hf.ATTN_IMPLEMENTATION, ids, attention_mask=mask,
                       position_ids=positions)
        with _variant_off(model, family):
            off = _logits(model, "eager", ids, attention_mask=mask, position_ids=positions)
    layers = _n_layers(model)
    sliding = layers if family == "mistral" else _n_layers(model, "sliding_attention")
    expected = {"window": sliding, "softcap": layers if family == "gemma2" else 0,
                "sinks": layers if family == "gpt_oss" else 0}
    print(family, dict(hf.CALLS), dict(hf.VARIANTS))
    assert hf.CALLS == {"varlen": layers}
    assert hf.VARIANTS == {k: n for k, n in expected.items() if n}
    err, eager_err = assert_close_2x(ours[real], want, eager[real], name=f"{family} logits",
                                     atol=1e-5)
    if family != "llama":  # the variant moves the logits far more than the bound
        effect = errors(off[real], want)[0]
        print(f"{family}: without its variant the logits move by {effect:.2f}")
        assert effect > 1000 * (2 * eager_err + 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_greedy_tokens_identical_to_eager(families, family):
    """Batched greedy generation from the left-padded prompts (prefill, then decode steps with
    transformers' own cache: a sliding layer's drops its oldest tokens): the same 6 tokens per
    prompt as eager attention, and every attention call served by a course kernel. The padding
    stays in a global layer's cache (its decode steps: flash_attn_varlen) but leaves a sliding
    layer's with the prefill (it keeps the last 7 tokens, all real): those layers' decode steps
    are flash_decode calls, with Gemma 2's softcap and GPT-OSS's sinks (counted); the window
    hides keys only in the prefill (20 keys; the sliding cache then holds the window)."""
    model, _ = families(family)
    ids, mask, _ = _left_padded(PROMPTS, seed=1)
    new = 6
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0)
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        want = model.generate(ids, **kw)[:, ids.shape[1]:]
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
        hf.CALLS.clear()
        hf.VARIANTS.clear()
        got = model.generate(ids, **kw)[:, ids.shape[1]:]
    print(family, "eager :", want.tolist())
    print(family, "course:", got.tolist(), dict(hf.CALLS), dict(hf.VARIANTS))
    assert torch.equal(got, want)
    layers = _n_layers(model)
    sliding = layers if family == "mistral" else _n_layers(model, "sliding_attention")
    decode = (new - 1) * sliding  # the sliding layers' decode steps: no padding in their cache
    assert sum(hf.CALLS.values()) == layers * new  # one call per layer and forward: all ours
    assert hf.CALLS == {k: n for k, n in (("varlen", layers * new - decode),
                                          ("decode", decode)) if n}, hf.CALLS
    assert (family == "llama") == (decode == 0)  # the three others have unpadded decode steps
    assert hf.VARIANTS["window"] == sliding  # the prefill's; in the decode steps it hides none
    assert hf.VARIANTS["softcap"] == (layers * new if family == "gemma2" else 0)
    assert hf.VARIANTS["sinks"] == (layers * new if family == "gpt_oss" else 0)


def test_mistral_generation_past_the_window_with_padding_in_the_window(families):
    """Prompts of 6, 3 and 5 tokens (shorter than the window of 8) and 6 new tokens: the
    generation runs past the window. With Mistral's sliding cache (it keeps the last 7 tokens:
    transformers' kv_offset > 0 from the 3rd decode step) the padding of the 3-token prompt
    sits inside the cache for two steps, then leaves it; with a full DynamicCache the decode
    steps that see more than 8 keys apply the window in the kernel: flash_attn_varlen's with
    the padding, flash_decode's (split-KV over the window's band) for a prompt of 6 tokens
    without padding. Same tokens as eager attention, every call ours."""
    from transformers import DynamicCache

    model, _ = families("mistral")
    new = 6
    layers = _n_layers(model)
    for padded, full_cache in ((True, False), (True, True), (False, True)):
        if padded:
            ids, mask, _ = _left_padded((6, 3, 5), seed=2)
        else:
            ids, mask = _ids(1, 6, seed=2, vocab=128), None  # (its tokens 4-6 need the window)
        kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0)
        extra = dict(past_key_values=DynamicCache()) if full_cache else {}
        with torch.inference_mode():
            model.set_attn_implementation("eager")
            want = model.generate(ids, **kw, **extra)[:, ids.shape[1]:]
            model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
            hf.CALLS.clear()
            hf.VARIANTS.clear()
            extra = dict(past_key_values=DynamicCache()) if full_cache else {}
            got = model.generate(ids, **kw, **extra)[:, ids.shape[1]:]
        print("padded" if padded else "no padding", "full cache" if full_cache else
              "sliding cache", got.tolist(), dict(hf.CALLS), dict(hf.VARIANTS))
        assert torch.equal(got, want)
        assert sum(hf.CALLS.values()) == layers * new
        # the window hides keys once a step sees more than 8: with the full cache, the decode
        # steps 3 to 5 (6 + 3 = 9 keys and more); the sliding cache holds only the window
        assert hf.VARIANTS["window"] == (layers * 3 if full_cache else 0)
        if not padded:  # every decode step is flash_decode's, the window in three of them
            assert hf.CALLS == {"prefill": layers, "decode": layers * (new - 1)}, hf.CALLS


def test_padded_batch_with_a_compiled_static_cache(families):
    """The deployed way: a static cache and a compiled decode step (fullgraph: no graph break,
    so nothing in the step reads a tensor back), for the left-padded batch. Each step's key
    ranges are made before the step (transformers asks for the mask outside the graph) and
    flash_attn_varlen runs inside it, its offsets computed on the device. Same greedy tokens
    as eager attention."""
    model, _ = families("llama")
    ids, mask, _ = _left_padded(PROMPTS, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        want = model.generate(ids, **kw)
        model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
        hf.CALLS.clear()
        got = model.generate(ids, cache_implementation="static",
                             compile_config=hf.static_compile_config(), **kw)
    print("eager :", want[:, ids.shape[1]:].tolist())
    print("course:", got[:, ids.shape[1]:].tolist(), dict(hf.CALLS))
    assert torch.equal(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert not torch._dynamo.utils.counters["graph_break"]
    assert hf.CALLS == {"varlen": _n_layers(model)}  # the eager prefill; the steps compiled
    torch._dynamo.reset()


def test_compiled_gemma2_prefill_checks_its_drawn_masks_on_the_device(families):
    """torch.compile(fullgraph=True) of Gemma 2's forward, with and without padding: inside a
    graph the sliding mask function cannot be read, so transformers' mask is drawn and checked
    on the device (a sliding window of 8 over one run of keys per sequence), then served as
    key ranges (padding) or as no mask at all (none). The real tokens' logits as eager's."""
    model, _ = families("gemma2")
    ids, mask, positions = _left_padded(PROMPTS, seed=5)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    for kw, real in ((dict(attention_mask=mask, position_ids=positions), mask.bool()),
                     ({}, torch.ones_like(mask, dtype=torch.bool))):
        with torch.inference_mode():
            want = _logits(model, "eager", ids, use_cache=False, **kw)
            got = compiled(ids, use_cache=False, **kw).logits
        err, _ = errors(got[real], want[real])
        print(f"compiled Gemma 2 prefill, {'padded' if kw else 'no padding'}: max err {err:.1e}")
        assert err < 1e-4
    torch._dynamo.reset()


def test_gpt_oss_gradients_through_padding_and_sinks_match_eager(families):
    """A training step on the left-padded batch: gradients of every weight, the sinks
    included, through flash_attn_varlen's backward, against eager attention's in fp32. Labels
    are -100 on the padding and on each prompt's first token (which the last padding position
    would predict: the padding's outputs are not specified)."""
    model, _ = families("gpt_oss")
    ids, mask, positions = _left_padded(PROMPTS, seed=3)
    after_a_token = torch.nn.functional.pad(mask[:, :-1], (1, 0))
    labels = ids.masked_fill((mask * after_a_token) == 0, -100)
    grads = {}
    for impl in (hf.ATTN_IMPLEMENTATION, "eager"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, attention_mask=mask, position_ids=positions, labels=labels).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    model.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    model.zero_grad()
    ours, eager = grads[hf.ATTN_IMPLEMENTATION], grads["eager"]
    assert ours.keys() == eager.keys() and any(n.endswith("sinks") for n in ours)
    worst = {n: errors(ours[n], eager[n])[0] / (eager[n].abs().max().item() + 1e-12)
             for n in eager}
    print(f"worst relative gradient error: {max(worst.values()):.2e}; sinks: "
          f"{max(v for n, v in worst.items() if n.endswith('sinks')):.2e}")
    assert max(worst.values()) < 1e-4


@pytest.mark.gpu
def test_bf16_logits_on_gpu_2x_rule():
    model = hf.make_llama(hf.small_llama_config(), dtype=torch.bfloat16)
    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("eager")
    ids = _ids(2, 300, seed=6)
    with torch.inference_mode():
        want = ref(ids).logits
    ours = _logits(model, hf.ATTN_IMPLEMENTATION, ids)
    assert_close_2x(ours, want, _logits(model, "sdpa", ids), name="bf16 logits", atol=1e-2)


def test_exercise_checker():
    from course_lib.exercises import llama as ex

    assert ex.check_attention_function(ex.attention_function_solution)

    def stub(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        raise NotImplementedError

    def no_transpose(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
        return ex.attention_function_solution(module, query, key, value, attention_mask,
                                              scaling)[0].transpose(1, 2), None

    def top_left(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):  # the chunk after a cache needs bottom-right alignment
        n_q, n_k = query.shape[2], key.shape[2]
        k = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        v = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
        s = query @ k.transpose(-1, -2) * scaling
        top_left_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~top_left_mask, float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2), None

    for wrong in (stub, no_transpose, top_left, lambda *a, **k: None):
        assert not ex.check_attention_function(wrong)


def test_graph_recordings_are_counted_by_attention_and_the_hook_restored(monkeypatch):
    """The capstone counts the CUDA graphs each side records: a wrapper around the CUDA-graph
    trees' recording method, put back afterwards (even when the block raises)."""
    from types import SimpleNamespace

    from torch._inductor import cudagraph_trees as trees

    recorded = []
    monkeypatch.setattr(trees.CUDAGraphTreeManager, "record_function",
                        lambda self, *a: recorded.append(a) or "graph")
    stub = trees.CUDAGraphTreeManager.record_function
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="course_kernels"))
    with hf.count_graph_recordings(model) as counts:
        assert trees.CUDAGraphTreeManager.record_function(None, 1, 2) == "graph"
        model.config._attn_implementation = "sdpa"
        trees.CUDAGraphTreeManager.record_function(None, 3, 4)
        trees.CUDAGraphTreeManager.record_function(None, 5, 6)
    assert dict(counts) == {"course_kernels": 1, "sdpa": 2} and len(recorded) == 3
    assert trees.CUDAGraphTreeManager.record_function is stub
    with pytest.raises(RuntimeError), hf.count_graph_recordings(model):
        raise RuntimeError("a failed benchmark")
    assert trees.CUDAGraphTreeManager.record_function is stub


def test_the_stored_runs_need_a_gpu(monkeypatch):
    import course_lib

    monkeypatch.setattr(course_lib, "DEVICE", "cpu")
    for argv in ([], ["--compiled"]):
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            hf.main(argv)



def test_two_sides_timed_in_turns_are_compared_pair_by_pair():
    """hf.paired: the share of pairs one side won and the median ratio; the timers hand every
    timed call over in turn order (``samples``), as ``benchmark`` stores them."""
    assert hf.paired([1.0, 2.0, 3.0, 5.0], [2.0, 1.0, 4.0, 4.0]) == {
        "pairs": 4, "won": 0.5, "ratio_median": 1.25}  # ratios 0.5, 2, 0.75, 1.25
    with pytest.raises(ValueError, match="one length"):
        hf.paired([1.0], [1.0, 2.0])
    model = hf.make_llama(hf.small_llama_config())
    ids = torch.randint(0, model.config.vocab_size, (1, 6), device=model.device)
    samples = {}
    medians = hf.time_decodes_in_turns(model, ids, (hf.ATTN_IMPLEMENTATION, "sdpa"),
                                       new_tokens=2, repeats=1, samples=samples)
    assert {k: len(v) for k, v in samples.items()} == {hf.ATTN_IMPLEMENTATION: 2, "sdpa": 2}
    assert medians == {k: sorted(v)[1] for k, v in samples.items()}
