"""The kernels as PyTorch operators: opcheck, torch.compile(fullgraph=True), no host syncs,
plan/run, and the CUDA graphs a decode step can be captured in (on a GPU)."""
import pytest
import torch

import course_lib
from course_lib import ops
from course_lib.kvcache import contiguous_to_pages
from course_lib.ops import decode as opd
from course_lib.reference import decode_reference
from course_lib.testing import fresh_randn, reads_back

ON_GPU = course_lib.DEVICE == "cuda"
# On a CPU, compile with AOTAutograd and no code generation: it traces through the operators'
# fake implementations exactly as Inductor does, then runs the real kernels in the interpreter.
BACKEND = "inductor" if ON_GPU else "aot_eager"


def _qkv(B=2, H=4, H_kv=2, N_q=5, N_k=11, D=16, dtype=torch.float32, grad=False):
    q, k, v = (fresh_randn(*s, dtype=dtype) for s in ((B, H, N_q, D), (B, H_kv, N_k, D),
                                                      (B, H_kv, N_k, D)))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _pages(k, v, block_size=8):
    """k, v as pages in one random physical order, and their block table."""
    k_pages, table = contiguous_to_pages(k, block_size=block_size,
                                         generator=torch.Generator().manual_seed(5))
    v_pages, _ = contiguous_to_pages(v, block_size=block_size,
                                     generator=torch.Generator().manual_seed(5))
    return k_pages, v_pages, table


def _decode_inputs(B=2, H=4, H_kv=2, N_q=1, N_max=40, D=16, lengths=(40, 13)):
    q = fresh_randn(B, H, N_q, D)
    k = fresh_randn(B, H_kv, N_max, D)
    v = fresh_randn(B, H_kv, N_max, D)
    lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    return q, k, v, lens


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch
# ---------------------------------------------------------------------------------------------

def test_opcheck_flash_attn_forward_and_backward():
    q, k, v = _qkv(grad=True)
    torch.library.opcheck(torch.ops.course.flash_attn_fwd.default,
                          (q, k, v, True, 0.25, "auto"))
    o, lse = torch.ops.course.flash_attn_fwd(q.detach(), k.detach(), v.detach(), True, 0.25,
                                             "auto")
    do = fresh_randn(*o.shape)
    torch.library.opcheck(torch.ops.course.flash_attn_bwd.default,
                          (do, q.detach(), k.detach(), v.detach(), o, lse, True, 0.25))


def test_opcheck_with_the_layout_transformers_hands_over():
    """q, k, v as (B, N, H, D) tensors seen transposed: the fake implementations lay O out as
    the kernels do (as q is), which opcheck compares stride for stride."""
    B, H, H_kv, N_q, N_k, D = 2, 4, 2, 5, 11, 16
    q = fresh_randn(B, N_q, H, D).transpose(1, 2).requires_grad_(True)
    k, v = (fresh_randn(B, N_k, H_kv, D).transpose(1, 2).requires_grad_(True) for _ in "kv")
    torch.library.opcheck(torch.ops.course.flash_attn_fwd.default,
                          (q, k, v, True, 0.25, "auto"))
    o, _ = torch.ops.course.flash_attn_fwd(q.detach(), k.detach(), v.detach(), True, 0.25, "auto")
    assert o.transpose(1, 2).is_contiguous()
    q1 = fresh_randn(B, 1, H, D).transpose(1, 2)
    lens = torch.tensor([11, 4], dtype=torch.int32, device=q.device)
    torch.library.opcheck(torch.ops.course.flash_decode.default,
                          (q1, k.detach(), v.detach(), lens, 0, 0.25))
    q3 = fresh_randn(B, 3, H, D).transpose(1, 2)
    torch.library.opcheck(torch.ops.course.flash_decode.default,
                          (q3, k.detach(), v.detach(), lens, 0, 0.25))
    o3, _ = torch.ops.course.flash_decode(q3, k.detach(), v.detach(), lens, 0, 0.25)
    assert o3.transpose(1, 2).is_contiguous()


def test_opcheck_varlen_over_a_paged_cache():
    """The serving step's operator: packed queries against pages through a block table."""
    q, k, v, lens = _decode_inputs()
    k_pages, v_pages, table = _pages(k, v)
    n_q = torch.tensor([1, 3], dtype=torch.int32, device=q.device)[:q.shape[0]]
    cu_q = torch.cat([n_q.new_zeros(1), n_q.cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)])
    qp = fresh_randn(int(cu_q[-1]), q.shape[1], q.shape[-1])
    args = (qp, k_pages, v_pages, cu_q, cu_k, table, 3, int(lens.max()), 0.25, -1, 0, 0.0,
            None, None)
    torch.library.opcheck(torch.ops.course.flash_attn_varlen_paged_fwd.default, args)


def test_opcheck_decode_ops():
    q, k, v, lens = _decode_inputs()
    torch.library.opcheck(torch.ops.course.flash_decode.default, (q, k, v, lens, 0, 0.25))
    torch.library.opcheck(torch.ops.course.flash_decode.default, (q, k, v, None, 2, 0.25))
    k_pages, v_pages, table = _pages(k, v)
    torch.library.opcheck(torch.ops.course.paged_decode.default,
                          (q, k_pages, v_pages, table, lens, 0, 0.25))


@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])
def test_opcheck_decode_ops_over_a_quantized_cache(fmt):
    """The scales are the operators' last two arguments (None by default): an 8-bit cache,
    contiguous and paged (its scales paged with it), with one split and two. (opcheck's schema
    test compares every input before and after with torch.allclose, which torch implements for
    float8 on neither the CPU nor CUDA: e4m3 runs the other three tests, the schema being
    int8's.)"""
    from course_lib.kvquant import quantize_kv

    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    if fmt == torch.float8_e4m3fn:
        utils = utils[1:]
    q, k, v, lens = _decode_inputs()
    (k_q, k_scale), (v_q, v_scale) = quantize_kv(k, fmt), quantize_kv(v, fmt)
    for splits in (0, 2):
        torch.library.opcheck(torch.ops.course.flash_decode.default,
                              (q, k_q, v_q, lens, splits, 0.25),
                              dict(k_scale=k_scale, v_scale=v_scale), test_utils=utils)
    k_pages, v_pages, table = _pages(k, v)
    (kp_q, kp_scale), (vp_q, vp_scale) = quantize_kv(k_pages, fmt), quantize_kv(v_pages, fmt)
    torch.library.opcheck(torch.ops.course.paged_decode.default,
                          (q, kp_q, vp_q, table, lens, 0, 0.25, -1, 0.0, None, None, kp_scale,
                           vp_scale), test_utils=utils)


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) matches eager
# ---------------------------------------------------------------------------------------------

def test_compiled_flash_attn_v2_forward_and_backward_match_eager():
    torch._dynamo.reset()

    def loss_fn(q, k, v):
        o = ops.flash_attn_v2(q, k, v, causal=True)
        return o, (o ** 2).sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend=BACKEND)
    q, k, v = _qkv(grad=True)
    o_want, want = loss_fn(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v))
    o_got, got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v))
    torch.testing.assert_close(o_got, o_want, rtol=0, atol=0)  # the same kernel: identical
    # the sum of squares around it is Inductor's code on a GPU: its own order of additions
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_compiled_decode_matches_eager():
    torch._dynamo.reset()
    q, k, v, lens = _decode_inputs()
    k_pages, v_pages, table = _pages(k, v)

    def step(q, k, v, lens, k_pages, v_pages, table):
        a = ops.flash_decode(q, k, v, cache_seqlens=lens)
        b = ops.paged_decode(q, k_pages, v_pages, table, lens)
        return a, b

    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    got = compiled(q, k, v, lens, k_pages, v_pages, table)
    want = step(q, k, v, lens, k_pages, v_pages, table)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_compiled_decode_over_a_quantized_cache_matches_eager():
    """An int8 cache with its scales through torch.compile: the operators take the scales as
    their last arguments, and the graph runs the eager call's kernel."""
    from course_lib.kvquant import quantize_kv

    torch._dynamo.reset()
    q, k, v, lens = _decode_inputs()
    (k_q, k_scale), (v_q, v_scale) = quantize_kv(k, torch.int8), quantize_kv(v, torch.int8)
    k_pages, v_pages, table = _pages(k, v)
    (kp_q, kp_scale), (vp_q, vp_scale) = (quantize_kv(t, torch.int8) for t in (k_pages, v_pages))

    def step(q, lens, table):
        a = ops.flash_decode(q, k_q, v_q, lens, k_scale=k_scale, v_scale=v_scale)
        b = ops.paged_decode(q, kp_q, vp_q, table, lens, k_scale=kp_scale, v_scale=vp_scale)
        return a, b

    got = torch.compile(step, fullgraph=True, backend=BACKEND)(q, lens, table)
    want = step(q, lens, table)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_compiled_graph_holds_the_operators():
    """The kernels are nodes of the graph, not a graph break around them."""
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    q, k, v, lens = _decode_inputs()
    torch.compile(lambda q, k, v, lens: ops.flash_decode(q, k, v, cache_seqlens=lens),
                  fullgraph=True, backend=backend)(q, k, v, lens)
    assert any("course.flash_decode" in s for s in seen), seen


def test_validate_under_compile_is_refused_with_a_clear_error():
    torch._dynamo.reset()
    q, k, v, lens = _decode_inputs()
    fn = torch.compile(lambda q, k, v, lens: ops.flash_decode(q, k, v, lens, validate=True),
                       fullgraph=True, backend=BACKEND)
    with pytest.raises(Exception, match="validate=True"):
        fn(q, k, v, lens)


# ---------------------------------------------------------------------------------------------
# no device -> host reads on the default path
# ---------------------------------------------------------------------------------------------

def test_default_decode_reads_nothing_back_from_a_gpu(monkeypatch):
    """The default call reads values only where that is free (``_FREE_READS``: the CPU). With
    the flag as a GPU has it, the default path reads nothing, the repeated calls included."""
    q, k, v, lens = _decode_inputs()
    k_pages, v_pages, table = _pages(k, v)
    plan = ops.plan_decode(q, k, v)
    paged_plan = ops.plan_decode(q, k_pages, v_pages, block_table=table)
    calls = (lambda: ops.flash_decode(q, k, v, cache_seqlens=lens),
             lambda: ops.paged_decode(q, k_pages, v_pages, table, lens),
             lambda: plan.run(q, k, v, lens),
             lambda: paged_plan.run(q, k_pages, v_pages, lens, table))
    monkeypatch.setattr(opd, "_FREE_READS", False)
    for call in calls + calls:  # twice: the second flash_decode repeats the first's launch
        assert reads_back(call) == 0
    # The counter does see a read back: the opt-in validation makes them on every device.
    assert reads_back(lambda: ops.flash_decode(q, k, v, cache_seqlens=lens,
                                                validate=True)) > 0
    assert reads_back(lambda: ops.paged_decode(q, k_pages, v_pages, table, lens,
                                                validate=True)) > 0
    assert reads_back(lambda: plan.run(q, k, v, lens, validate=True)) > 0
    monkeypatch.setattr(opd, "_FREE_READS", True)  # as on a CPU: the default checks the values
    for call in calls + calls:
        assert reads_back(call) > 0
    # validate=False never reads.
    assert reads_back(lambda: ops.flash_decode(q, k, v, cache_seqlens=lens,
                                                validate=False)) == 0
    assert reads_back(lambda: ops.paged_decode(q, k_pages, v_pages, table, lens,
                                                validate=False)) == 0
    assert reads_back(lambda: plan.run(q, k, v, lens, validate=False)) == 0


def test_the_default_checks_values_on_the_cpu_only():
    assert opd._FREE_READS == (course_lib.DEVICE == "cpu")


def test_eager_flash_attn_v2_reads_nothing_back():
    q, k, v = _qkv()
    assert reads_back(lambda: ops.flash_attn_v2(q, k, v, causal=True)) == 0


# ---------------------------------------------------------------------------------------------
# out-of-range lengths and block ids: clamped by the kernel where nothing checks them
# (validate=False, or the default on a GPU), refused by validate=True
# ---------------------------------------------------------------------------------------------

def test_lengths_outside_the_cache_are_clamped_not_read_past():
    q, k, v, _ = _decode_inputs()
    wild = torch.tensor([1000, -7], dtype=torch.int32, device=q.device)
    o, lse = ops.flash_decode(q, k, v, cache_seqlens=wild, return_lse=True, validate=False)
    ref = decode_reference(q, k, v, torch.tensor([40, 0], device=q.device))
    torch.testing.assert_close(o[0], ref[0].to(o.dtype), atol=2e-5, rtol=0)
    assert torch.all(o[1] == 0) and torch.all(lse[1] == float("-inf"))
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        ops.flash_decode(q, k, v, cache_seqlens=wild, validate=True)


def test_block_ids_outside_the_pool_stay_inside_it():
    q, k, v, lens = _decode_inputs()
    k_pages, v_pages, table = _pages(k, v)
    bad = table.clone()
    bad[0, 1] = 10_000_000
    bad[1, 0] = -5
    # a wrong answer, but no crash
    o = ops.paged_decode(q, k_pages, v_pages, bad, lens, validate=False)
    assert torch.isfinite(o).all()
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 10000000"):
        ops.paged_decode(q, k_pages, v_pages, bad, lens, validate=True)


# ---------------------------------------------------------------------------------------------
# plan and run
# ---------------------------------------------------------------------------------------------

def test_plan_run_matches_the_function_and_reuses_its_buffers():
    q, k, v, lens = _decode_inputs()
    plan = ops.plan_decode(q, k, v, num_splits=3)
    o1 = plan.run(q, k, v, lens)
    want = ops.flash_decode(q, k, v, cache_seqlens=lens, num_splits=3)
    torch.testing.assert_close(o1, want, rtol=0, atol=0)
    assert o1.data_ptr() == plan.out.data_ptr()
    q2 = fresh_randn(*q.shape)
    o2, lse2 = plan.run(q2, k, v, lens, return_lse=True)
    assert o2.data_ptr() == o1.data_ptr()  # the next run overwrites the plan's output
    torch.testing.assert_close(o2, ops.flash_decode(q2, k, v, cache_seqlens=lens, num_splits=3),
                               rtol=0, atol=0)


def test_paged_plan_run():
    q, k, v, lens = _decode_inputs()
    k_pages, v_pages, table = _pages(k, v)
    plan = ops.plan_decode(q, k_pages, v_pages, block_table=table)
    got = plan.run(q, k_pages, v_pages, lens, block_table=table)
    torch.testing.assert_close(got, ops.paged_decode(q, k_pages, v_pages, table, lens),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs block_table"):
        plan.run(q, k_pages, v_pages, lens)


def test_plan_refuses_other_shapes():
    q, k, v, lens = _decode_inputs()
    plan = ops.plan_decode(q, k, v)
    q3, k3, v3, lens3 = _decode_inputs(B=3, lengths=(1, 2, 3))
    with pytest.raises(ValueError, match="make a new plan"):
        plan.run(q3, k3, v3, lens3)


def test_split_buffers_are_reused_per_shape(monkeypatch):
    q, k, v, lens = _decode_inputs()
    opd.forget_plans()
    allocated = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        allocated.append(t.ndim)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    for _ in range(3):
        ops.flash_decode(q, k, v, cache_seqlens=lens, num_splits=2)
    assert allocated.count(5) == 1  # the splits' partial outputs: one plan
    ops.flash_decode(q[:1], k[:1], v[:1], cache_seqlens=lens[:1], num_splits=2)
    assert allocated.count(5) == 2  # another batch shape: another plan


# ---------------------------------------------------------------------------------------------
# on a GPU: CUDA graphs
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need an NVIDIA GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_planned_decode_step_replays_in_a_cuda_graph(paged):
    q, k, v, lens = _decode_inputs(B=4, H=32, H_kv=8, N_max=4096, D=128,
                                   lengths=(4096, 1000, 17, 3000))
    q, k, v = (t.half() for t in (q, k, v))
    if paged:
        k, v, table = _pages(k, v, block_size=16)
        plan = ops.plan_decode(q, k, v, block_table=table)
        run = lambda: plan.run(q, k, v, lens, block_table=table)  # noqa: E731
    else:
        plan = ops.plan_decode(q, k, v)
        run = lambda: plan.run(q, k, v, lens)  # noqa: E731
    run()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(3):  # new values in the same buffers, then replay
        q.copy_(fresh_randn(*q.shape, dtype=q.dtype))
        lens.copy_(torch.tensor([4096 - step, 1 + step, 17, 2999], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = (ops.paged_decode(q, k, v, table, lens) if paged
                 else ops.flash_decode(q, k, v, cache_seqlens=lens))
        _within_one_ulp(out, eager)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need an NVIDIA GPU")
def test_default_flash_decode_is_capturable():
    q, k, v, lens = _decode_inputs(B=1, H=32, H_kv=8, N_max=4096, D=128, lengths=(3001,))
    q, k, v = (t.half() for t in (q, k, v))
    ops.flash_decode(q, k, v, cache_seqlens=lens)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.flash_decode(q, k, v, cache_seqlens=lens)
    graph.replay()
    torch.cuda.synchronize()
    _within_one_ulp(out, ops.flash_decode(q, k, v, cache_seqlens=lens))


def _within_one_ulp(got, want):
    """A captured step merges the splits in a second kernel, an eager one in the split kernel
    (kernels.decode.MERGES): the same sums, compiled into two kernels that may round the last
    bit differently. Equal up to one unit in the last place of the output dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(
        torch.finfo(want.dtype).tiny)
    err = (got.float() - want.float()).abs()
    assert (err <= ulp).all(), f"{(err > ulp).sum().item()} elements differ by more than 1 ulp"


@pytest.mark.skipif(not ON_GPU, reason="mode='reduce-overhead' records CUDA graphs")
def test_compiled_decode_with_cuda_graphs():
    torch._dynamo.reset()
    q, k, v, lens = _decode_inputs(B=2, H=32, H_kv=8, N_max=2048, D=128, lengths=(2048, 700))
    q, k, v = (t.half() for t in (q, k, v))
    fn = torch.compile(lambda q, k, v, lens: ops.flash_decode(q, k, v, cache_seqlens=lens),
                       fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm up, record, replay
        got = fn(q, k, v, lens).clone()
    _within_one_ulp(got, ops.flash_decode(q, k, v, cache_seqlens=lens))


@pytest.mark.skipif(not ON_GPU, reason="the fast launch path runs on a GPU only")
def test_fast_launch_equals_tritons_own_launch(monkeypatch, request):
    """course_lib._launch against kernel[grid](...): same outputs, bit for bit, on aligned
    and misaligned views (a misaligned q: Triton's own launch, at every call)."""
    from course_lib import _launch

    if not _launch.FAST:
        pytest.skip(f"triton {__import__('triton').__version__} is not in SUPPORTED_TRITON")
    opd.forget_plans()
    q, k, v, lens = _decode_inputs(B=2, H=32, H_kv=8, N_max=1000, D=128, lengths=(1000, 77))
    q, k, v = (t.half() for t in (q, k, v))
    slow_before = _launch.SLOW_LAUNCHES
    fast = [ops.flash_decode(q, k, v, cache_seqlens=lens) for _ in range(3)]
    # the first call's launch (eagerly the split kernel merges too: one kernel), unless an
    # earlier test compiled it; then the plan's bound launch
    assert _launch.SLOW_LAUNCHES - slow_before <= 1
    slow_before = _launch.SLOW_LAUNCHES
    store = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    q_odd = store[1:].view(q.shape).copy_(q)  # 2-byte aligned, not 16
    fast.append(ops.flash_decode(q_odd, k, v, cache_seqlens=lens))
    fast.append(ops.flash_decode(q_odd, k, v, cache_seqlens=lens))
    # a bound launch assumes 16-byte aligned addresses: a misaligned q goes through Triton
    assert _launch.SLOW_LAUNCHES - slow_before == 2
    qf, kf, vf = _qkv(B=1, H=4, H_kv=2, N_q=70, N_k=70, D=64, dtype=torch.float16)
    attn_fast = [ops.flash_attn_v2(qf, kf, vf, causal=True, impl="portable") for _ in range(2)]
    # impl None at this size: the portable kernel, then its remembered bound launch
    attn_fast += [ops.flash_attn_v2(qf, kf, vf, causal=True) for _ in range(3)]
    # a cache that grows by a token per call (new tensor, new strides): one plan, one bound
    # launch given the new strides and length
    growing = [torch.randn(1, 8, n, 128, device=q.device, dtype=q.dtype)
               for n in (1001, 1002, 1003, 1017)]
    q1 = q[:1]
    slow_before = _launch.SLOW_LAUNCHES
    grown = [ops.flash_decode(q1, kg, kg) for kg in growing]
    assert _launch.SLOW_LAUNCHES - slow_before <= 1, "the growing cache was bound more than once"
    monkeypatch.setattr(_launch, "FAST", False)
    opd.forget_plans()  # (plans whose launches were bound fast)
    request.addfinalizer(opd.forget_plans)
    for kg, o in zip(growing, grown):
        torch.testing.assert_close(o, ops.flash_decode(q1, kg, kg), rtol=0, atol=0)
    slow = ops.flash_decode(q, k, v, cache_seqlens=lens)
    for o in fast:
        torch.testing.assert_close(o, slow, rtol=0, atol=0)
    attn_slow = ops.flash_attn_v2(qf, kf, vf, causal=True, impl="portable")
    for o in attn_fast:
        torch.testing.assert_close(o, attn_slow, rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="the fast path runs on a GPU only")
@pytest.mark.parametrize("variants", [{}, {"window_size": (64, 0), "softcap": 30.0}])
@pytest.mark.parametrize("impl,n", [("portable", 300), ("portable", 2048), ("hopper", 300),
                                    ("hopper", 2048)])  # a table's config; the autotuner's
def test_the_fast_path_equals_tritons_own_launch(impl, n, variants, monkeypatch):
    """flash_attn_v2's fast path (the kept launch, bound to everything but the addresses; the
    Hopper kernels' four TMA descriptors moved to them) for new tensors of the same shape, with
    and without variants: no launch through Triton after the first call, and the same bits as
    Triton's own launch."""
    from course_lib import _launch

    if not _launch.FAST:
        pytest.skip(f"triton {__import__('triton').__version__} is not in SUPPORTED_TRITON")
    if impl not in ops.IMPLS:
        pytest.skip("the Hopper kernel runs on an sm_90 GPU only")
    inputs = [_qkv(B=1, H=8, H_kv=2, N_q=n, N_k=n + 5, D=64, dtype=torch.float16)
              for _ in range(4)]
    got = [ops.flash_attn_v2(*inputs[0], causal=True, impl=impl, **variants)]
    slow = _launch.SLOW_LAUNCHES
    got += [ops.flash_attn_v2(*t, causal=True, impl=impl, **variants) for t in inputs[1:]]
    assert _launch.SLOW_LAUNCHES == slow, "a repeated call went through Triton's launch"
    monkeypatch.setattr(_launch, "FAST", False)
    for t, g in zip(inputs, got):
        torch.testing.assert_close(g, ops.flash_attn_v2(*t, causal=True, impl=impl, **variants),
                                   rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="the fast launch path runs on a GPU only")
@pytest.mark.parametrize("merge", ["fused", "kernel"])
def test_bound_plan_steps_equal_tritons_own_launch(merge, monkeypatch):
    """DecodePlan.run repeats its bound launches (course_lib._launch.bind) for a new q each
    step: the same bits as Triton's own launch; a misaligned q re-binds."""
    from course_lib import _launch
    from course_lib.kernels import decode as kd

    if not _launch.FAST:
        pytest.skip(f"triton {__import__('triton').__version__} is not in SUPPORTED_TRITON")
    q, k, v, lens = _decode_inputs(B=2, H=32, H_kv=8, N_max=1000, D=128, lengths=(1000, 77))
    q, k, v = (t.half() for t in (q, k, v))
    plan = ops.plan_decode(q, k, v, merge=merge)
    assert plan.num_splits > 1
    qs = [torch.randn_like(q) for _ in range(4)]
    store = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    qs.append(store[1:].view(q.shape).copy_(qs[0]))  # 2-byte aligned, not 16
    launched = []  # the steps that went through Triton (and bound their launches)
    real_run_plan = kd.run_plan
    monkeypatch.setattr(kd, "run_plan", lambda *a, **kw: launched.append(1)
                        or real_run_plan(*a, **kw))
    got, through_triton = [], []
    for qi in qs:
        got.append(plan.run(qi, k, v, lens).clone())
        through_triton.append(len(launched))
    # steps 2 to 4 repeated step 1's bound launches; the misaligned q was launched anew
    assert through_triton == [1, 1, 1, 1, 2]
    k2 = k.clone()  # another cache tensor, laid out alike: its address is a free argument
    got.append(plan.run(qs[1], k2, v, lens).clone())
    got.append(plan.run(qs[2], k2, v, lens).clone())
    assert len(launched) == 2, "another cache tensor of the same layout was launched anew"
    monkeypatch.setattr(_launch, "FAST", False)
    slow_plan = ops.plan_decode(q, k, v, merge=merge)
    for qi, g in zip([*qs, qs[1], qs[2]], got):
        torch.testing.assert_close(g, slow_plan.run(qi, k, v, lens), rtol=0, atol=0)


def test_integer_classes_follow_tritons_specialization():
    """``_launch.int_classes`` tells integers apart as Triton specializes them (1, a multiple of
    16, 32 or 64 bits), so a decode cache that grows by one token keeps its bound launch."""
    from course_lib._launch import int_classes

    def key(a):
        return int_classes([a])

    assert key(2048) == key(4096) and key(2049) == key(2051)
    assert key(1) != key(17) and key(16) != key(17) and key(1) != key(2)
    assert key(2 ** 31 - 16) != key(2 ** 31) and key(-16) == key(32)


@pytest.mark.parametrize("layout", ["3.6", "3.7"])
def test_fast_launch_plumbing_with_a_stand_in_for_triton(layout, monkeypatch):
    """course_lib._launch's bound launches, on any machine: a stand-in kernel and launcher
    record what the fast path hands Triton's C launcher, in 3.6's form (the arguments spread)
    and in the form of 3.7 to 3.9 (annotations, the signature, the arguments as one tuple).
    The GPU tests above check the installed Triton's against its own launch."""
    import inspect
    import types

    from course_lib import _launch

    calls = []

    class Launcher:  # Triton's CudaLauncher: its C function and flags
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        def launch(self, *a):
            if layout == "3.6":
                calls.append(("fast", a))
            else:  # (..., coop, pdl, packed, None x 5, notes, signature, args): as 3.6 lays it
                assert a[13:15] == ("notes", "sig") and type(a[15]) is tuple
                calls.append(("fast", (*a[:7], None, None, a[7], None, None, None, *a[15])))

    if layout != "3.6":
        Launcher.arg_annotations, Launcher.kernel_signature = "notes", "sig"
    compiled = types.SimpleNamespace(function=7, packed_metadata=(4, 1, 0), run=Launcher())

    class Kernel:
        params = [types.SimpleNamespace(name=n, default=d) for n, d in
                  (("X", inspect.Parameter.empty), ("n", inspect.Parameter.empty),
                   ("BLOCK", inspect.Parameter.empty), ("FLAG", True))]

        def __getitem__(self, grid):
            def run(*a, **kw):
                calls.append(("slow", grid, a, kw))
                return compiled
            return run

    driver = types.SimpleNamespace(get_current_device=lambda: 0,
                                   get_current_stream=lambda device: 99)
    monkeypatch.setattr(_launch, "FAST", True)
    monkeypatch.setattr(_launch, "_driver", types.SimpleNamespace(active=driver))
    kernel, x, y = Kernel(), torch.zeros(4), torch.zeros(4)
    head = (99, 7, False, False, None, None, (4, 1, 0), None, None, None)

    again = _launch.bind(1, kernel, (3, 2), x, 2048, BLOCK=16)
    assert calls[-1] == ("slow", (3, 2), (x, 2048), {"BLOCK": 16})  # Triton launches (compiles)
    again(y.data_ptr())  # the bound launch: only the free address changes
    assert calls[-1] == ("fast", (3, 2, 1, *head, y.data_ptr(), 2048, 16, True))
    again(x.data_ptr())
    assert calls[-1] == ("fast", (3, 2, 1, *head, x.data_ptr(), 2048, 16, True))
    assert _launch.bind(None, kernel, (2,), x, 17, BLOCK=16) is None  # launch, bind nothing
    assert calls[-1] == ("slow", (2,), (x, 17), {"BLOCK": 16})
    assert sum(c[0] == "slow" for c in calls) == 2
    again = _launch.bind((0, 1), kernel, (1,), x, 2048, BLOCK=16)  # free positions
    again(y.data_ptr(), 4096)
    assert calls[-1] == ("fast", (1, 1, 1, *head, y.data_ptr(), 4096, 16, True))
    # A TMA descriptor bound as a free argument moves to the new address, and keeps its shape,
    # strides, block shape and padding: Triton's launcher encodes it from those.
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = TensorDescriptor.from_tensor(x.view(1, 4), [1, 4])
    again = _launch.bind(1, kernel, (1,), desc, 2048, BLOCK=16)
    again(y.data_ptr())
    moved = calls[-1][1][len(head) + 3]
    assert calls[-1][1][len(head) + 4:] == (2048, 16, True)
    assert moved.base.data_ptr() == y.data_ptr()
    assert (list(moved.shape), list(moved.strides), list(moved.block_shape), moved.padding) == (
        list(desc.shape), list(desc.strides), list(desc.block_shape), desc.padding)


# ---------------------------------------------------------------------------------------------
# a call shaped like an earlier one skips the checks (the host time of a model's layers)
# ---------------------------------------------------------------------------------------------

def test_a_decode_call_shaped_like_an_earlier_one_repeats_its_bound_launch(monkeypatch, request):
    """flash_decode's kept plan, on any machine: a stand-in for the bound split kernel records
    the launches. The second call with the same shapes, strides, dtypes, devices, scale and
    lengths' layout is checked and then hands the plan's bound launch the new addresses;
    another scale or length class binds anew; bad input is refused, naming the argument."""
    from course_lib.kernels import decode as kd

    launched, bound = [], []
    monkeypatch.setattr(kd, "run_plan", lambda *a, **kw: bound.append(1) or [
        lambda *p: launched.append(p)])
    opd.forget_plans()
    request.addfinalizer(opd.forget_plans)  # the stand-in's launches must not outlive the test
    checks = []
    real_check = opd._check_cache
    monkeypatch.setattr(opd, "_check_cache", lambda *a: checks.append(1) or real_check(*a))
    B, H, H_kv, D, N = 1, 4, 2, 16, 40
    q = fresh_randn(B, 1, H, D).transpose(1, 2)  # as transformers hands it over
    k, v = fresh_randn(B, H_kv, N, D), fresh_randn(B, H_kv, N, D)
    ops.flash_decode(q, k, v, sm_scale=0.25)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()  # (clone keeps q's layout)
    o = ops.flash_decode(q2, k2, v2, sm_scale=0.25)
    assert len(bound) == 1 and len(launched) == 1, "the second call bound anew"
    assert len(checks) == 1, "a call with a kept plan was checked again"
    assert o.shape == (B, H, 1, D) and o.dtype == q.dtype
    p = launched[-1]
    assert p[:6] == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), q2.data_ptr(),
                     q2.data_ptr(), o.data_ptr())
    assert p[7:14] == (*k2.stride()[:3], *v2.stride()[:3], N)  # the cache's geometry, its length
    assert p[14:] == ((-1, 0, None, None, None, None),)  # VARIANT: causal, no other variant
    longer = fresh_randn(B, H_kv, N + 1, D)  # one token more: the same plan, no checks
    ops.flash_decode(q, longer, longer, sm_scale=0.25)
    assert len(checks) == 1 and len(bound) == 1 and launched[-1][13] == N + 1
    ops.flash_decode(q, k, v, sm_scale=0.5)  # another scale: another plan
    assert len(bound) == 2
    with pytest.raises(TypeError, match="sm_scale"):
        ops.flash_decode(q, k, v, sm_scale=True)  # True == 1.0, but not a scale
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ops.flash_decode(q.tolist(), k, v)
    monkeypatch.setattr(opd, "hooks_installed", lambda: True)  # a profiler: through Triton
    ops.flash_decode(q, k, v, sm_scale=0.25)
    assert len(bound) == 3


def test_a_remembered_call_allocates_like_q_only_where_that_is_os_layout():
    """_FastCall (a remembered call's O): ``torch.empty_like(q)`` where it gives O's layout
    (a dense q: the same stride wherever a dim has more than one element), else O's kept shape
    and layout."""
    from course_lib.kernels.attention_common import empty_output
    from course_lib.ops.attention import _FastCall

    dense = fresh_randn(2, 7, 4, 16).transpose(1, 2)  # (B, H, N, D) seen through a transpose
    step = fresh_randn(2, 1, 4, 16).transpose(1, 2)  # a decode step's q: N 1, O contiguous
    packed = fresh_randn(2, 4, 7, 48)[..., :16]  # q cut from a packed qkv: a contiguous O
    odd = fresh_randn(2, 16, 4, 7).permute(0, 2, 3, 1)  # dense, but O is contiguous, not so
    for q, like in ((dense, True), (step, True), (packed, True), (odd, False),
                    (fresh_randn(2, 4, 7, 16), True)):
        o = empty_output(q)
        launched = []
        kept = _FastCall(lambda *p: launched.append(p), o, q)
        assert kept.like is like
        again = kept(q, q, q)
        assert (again.shape, again.dtype) == (o.shape, o.dtype)
        assert all(n == 1 or a == b for n, a, b in zip(o.shape, o.stride(), again.stride()))
        assert launched == [(q.data_ptr(),) * 3 + (again.data_ptr(),) * 2]


def _fast_path_stand_in(monkeypatch, table, forward, check):
    """flash_attn_v2's fast path turned on in the interpreter, which binds no launch: every
    launcher of ``ops.attention.<table>`` is ``forward``, whose bound launch is a stand-in that
    records the addresses it is called with (``launched``), and each call of
    ``ops.attention.<check>`` is counted (``checks``). Returns (launched, checks)."""
    from course_lib import _launch
    from course_lib.ops import attention as oa

    launched, checks = [], []

    def stand_in(*args, bind=False, **options):
        o, lse = forward(*args, **options)
        return (o, lse, lambda *p: launched.append(p)) if bind else (o, lse)

    monkeypatch.setattr(oa, "_REMEMBER", True)
    monkeypatch.setattr(_launch, "FAST", True)
    monkeypatch.setattr(oa, table, {impl: stand_in for impl in oa.IMPLS})
    real_check = getattr(oa, check)
    monkeypatch.setattr(oa, check, lambda *a: checks.append(1) or real_check(*a))
    return launched, checks


def test_a_forward_call_shaped_like_an_earlier_one_skips_the_checks(monkeypatch):
    """flash_attn_v2's fast path (the GPU's, turned on here, with a stand-in for the bound
    launch, which the interpreter never makes): the second call with the first's key is an
    allocation laid out as q is and the kept launch at the new addresses, with no checks; bad
    input, a misaligned input, a profiler, and calls that need the autograd or the lse go the
    checked way."""
    from course_lib.ops import attention as oa
    from course_lib.reference import attention

    launched, checks = _fast_path_stand_in(monkeypatch, "_FORWARDS", oa.forward_portable,
                                           "check_attention_inputs")
    q, k, v = _qkv(N_q=7, N_k=7)
    qt = fresh_randn(2, 7, 4, 16).transpose(1, 2)  # (B, H, N, D) seen through a transpose
    first = ops.flash_attn_v2(qt, k, v, causal=True, sm_scale=0.3)
    torch.testing.assert_close(first, attention(qt, k, v, causal=True, sm_scale=0.3),
                               rtol=1e-4, atol=1e-4)
    k2, v2 = fresh_randn(*k.shape), fresh_randn(*v.shape)
    o = ops.flash_attn_v2(qt, k2, v2, causal=True, sm_scale=0.3)
    assert len(checks) == 1, "the repeated call was checked again"
    assert launched == [(qt.data_ptr(), k2.data_ptr(), v2.data_ptr(), o.data_ptr(),
                         o.data_ptr())]
    assert o.shape == qt.shape and o.transpose(1, 2).is_contiguous()
    with pytest.raises(TypeError, match="causal"):
        ops.flash_attn_v2(qt, k, v, causal=1, sm_scale=0.3)  # 1 == True, but not a bool
    with pytest.raises(ValueError, match="impl"):
        ops.flash_attn_v2(qt, k, v, causal=True, impl=["portable"])  # unhashable, and no impl
    store = torch.empty(k.numel() + 1, dtype=k.dtype, device=k.device)
    ops.flash_attn_v2(qt, store[1:].view(k.shape).copy_(k), v, causal=True, sm_scale=0.3)
    o, lse = ops.flash_attn_v2(qt, k, v, causal=True, sm_scale=0.3, return_lse=True)
    assert lse.shape == (2, 4, 7)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    ops.flash_attn_v2(qg, kg, vg, causal=True).sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    monkeypatch.setattr(oa, "hooks_installed", lambda: True)  # a profiler: Triton launches
    ops.flash_attn_v2(qt, k2, v2, causal=True, sm_scale=0.3)
    assert len(launched) == 1 and len(checks) == 7


def test_a_variants_call_shaped_like_an_earlier_one_skips_the_checks(monkeypatch):
    """The fast path keeps a call with a window or a softcap (no ALiBi slopes, no sinks: their
    tensors' values may change) under a key that holds them with their types: a repeated call
    is the kept launch; the same numbers as another type, or with sinks, go the checked way."""
    from course_lib.ops import attention as oa
    from course_lib.reference import attention_variants

    launched, checks = _fast_path_stand_in(monkeypatch, "_VARIANT_FORWARDS", oa.forward_variants,
                                           "check_call")
    q, k, v = _qkv(N_q=9, N_k=9)
    first = ops.flash_attn_v2(q, k, v, causal=True, window_size=(3, 0), softcap=5.0)
    torch.testing.assert_close(first, attention_variants(q, k, v, causal=True,
                                                         window_size=(3, 0), softcap=5.0),
                               rtol=1e-4, atol=1e-4)
    k2 = fresh_randn(*k.shape)
    o = ops.flash_attn_v2(q, k2, v, causal=True, window_size=(3, 0), softcap=5.0)
    assert len(checks) == 1, "the repeated call was checked again"
    assert launched == [(q.data_ptr(), k2.data_ptr(), v.data_ptr(), o.data_ptr(), o.data_ptr())]
    with pytest.raises(TypeError, match="window_size"):
        ops.flash_attn_v2(q, k, v, causal=True, window_size=(3.0, 0), softcap=5.0)
    with pytest.raises(TypeError, match="softcap"):
        ops.flash_attn_v2(q, k, v, causal=True, window_size=(3, 0), softcap=True)
    sinks = torch.zeros(q.shape[1], device=q.device)
    ops.flash_attn_v2(q, k, v, causal=True, window_size=(3, 0), softcap=5.0, sinks=sinks)
    assert len(launched) == 1 and len(checks) == 4
