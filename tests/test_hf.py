"""course_lib.hf: the course's kernels as a Hugging Face attention implementation.

A small LLaMA with random weights (nothing downloaded): logits against an fp64 eager reference
with the 2x rule, greedy tokens identical to eager's, decode steps really routed to
flash_decode, chunked prefill and multi-token decode against a cache, a static cache, gradients,
and the clear errors for what the kernels cannot do (padding, sliding windows, dropout).
"""
import copy
import weakref

import pytest
import torch

pytest.importorskip("transformers", reason="transformers (the course's [hf] extra) is missing")

from course_lib import DEVICE, hf  # noqa: E402
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
        with pytest.raises(RuntimeError, match="without padding"), torch.inference_mode():
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
    padded = ones.clone()
    padded[0, :3] = False
    with pytest.raises(NotImplementedError, match="without padding"):
        hf.course_attention_mask(2, 10, 10, attention_mask=padded)
    # a static cache that is not full: 6 and 4 keys in use of 10, checked here once per forward;
    # every layer then gets the key counts, (B, 1, 1, 1) int32, not a (B, 1, N_q, N_k) mask
    used = torch.zeros(2, 10, dtype=torch.bool)
    used[0, :6], used[1, :4] = True, True
    lengths = hf.course_attention_mask(2, 1, 10, q_offset=5, attention_mask=used)
    assert lengths.dtype == torch.int32 and lengths.view(-1).tolist() == [6, 4]
    assert hf._lengths_range(lengths) == (4, 6)  # known from the check: no second read back


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
    in any layer. A prefill into the cache reads the key range back once per forward (to cut
    the cache to the keys in use), not once per layer."""
    attn = model.model.layers[0].self_attn
    cfg = model.config
    H, H_kv, D, N_max = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 40
    k, v = (torch.randn(1, H_kv, N_max, D, device=DEVICE) for _ in "kv")
    with torch.inference_mode():
        for n_q, offset, reads in ((1, 6, 0), (3, 6, 0), (hf.DECODE_MAX_QUERIES + 4, 0, 1)):
            q = torch.randn(1, n_q, H, D, device=DEVICE).transpose(1, 2)

            def forward():
                lengths = hf.course_attention_mask(1, n_q, N_max, device=DEVICE,
                                                   q_offset=torch.tensor(offset, device=DEVICE))
                assert lengths.dtype == torch.int32 and lengths.shape == (1, 1, 1, 1)
                for _ in range(2):  # two layers, one mask
                    hf.course_attention_forward(attn, q, k, v, lengths, scaling=D ** -0.5)
                return lengths

            assert _reads_back(forward, monkeypatch) == reads, f"N_q {n_q}"
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

            with mock.patch.object(hf, "sdpa_mask", side_effect=AssertionError("drawn")):
                assert _reads_back(step, monkeypatch) == 1
                lengths = step()
            assert lengths.dtype == torch.int32 and lengths.shape == (2, 1, 1, 1)
            assert lengths.view(-1).tolist() == [6 + n_q] * 2
            assert hf._lengths_range(lengths) == (6 + n_q, 6 + n_q)  # no second read-back
            # nothing kept alive once the model lets go: a tensor held from one generate to the
            # next moves the next static cache in memory, and a compiled step records anew
            gone = weakref.ref(lengths)
            del lengths
            assert gone() is None
    # left padding in one sequence: drawn, checked and refused
    padded = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
    padded[1, :2] = False
    with pytest.raises(NotImplementedError, match="without padding"):
        hf.course_attention_mask(2, 1, n_max, q_offset=torch.tensor([6], device=DEVICE),
                                 attention_mask=padded, device=DEVICE)
    # a mask as long as the cache (zeros for the keys not written yet): drawn and checked
    used = torch.zeros(2, n_max, dtype=torch.bool, device=DEVICE)
    used[:, :7] = True
    lengths = hf.course_attention_mask(2, 1, n_max, q_offset=6, attention_mask=used,
                                       device=DEVICE)
    assert lengths.view(-1).tolist() == [7, 7]


def test_padding_is_refused_with_a_clear_error(model):
    ids = _ids(2, 12, seed=5)
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # left padding of the first sequence
    with pytest.raises(NotImplementedError, match="without padding"), torch.inference_mode():
        model(ids, attention_mask=attn)


def test_dropout_and_sliding_window_are_refused():
    class Layer(torch.nn.Module):
        is_causal = True
        sliding_window = None

    q = torch.randn(1, 4, 8, 32, device=DEVICE)
    k = torch.randn(1, 2, 8, 32, device=DEVICE)
    layer = Layer()
    out, weights = hf.course_attention_forward(layer, q, k, k, None, scaling=0.2)
    assert out.shape == (1, 8, 4, 32) and weights is None
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.course_attention_forward(layer, q, k, k, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="softcap"):
        hf.course_attention_forward(layer, q, k, k, None, softcap=30.0)
    layer.sliding_window = 4
    with pytest.raises(NotImplementedError, match="sliding-window"):
        hf.course_attention_forward(layer, q, k, k, None)


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
