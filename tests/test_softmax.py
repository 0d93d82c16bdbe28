"""course_lib.softmax, its counted cost, the step widget and the exercises of lesson 01.

Every softmax variant is compared with torch.softmax: random inputs of several shapes, inputs
scaled by 1e4, rows with -inf (partly and fully masked). Property-based tests (hypothesis)
show that ⊕ is commutative and associative, so neither block size nor merge order matters.
"""
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from course_lib import softmax as sm
from course_lib import softmax_cost
from course_lib.exercises import softmax as ex
from course_lib.opcount import Tracked, count

ROOT = Path(__file__).resolve().parents[1]
STABLE = {
    "safe": sm.safe_softmax,
    "online": sm.online_softmax,
    "fused": sm.fused_softmax,
    "blocked B=1": lambda x: sm.blocked_online_softmax(x, 1),
    "blocked B=3": lambda x: sm.blocked_online_softmax(x, 3),
    "blocked B=16": lambda x: sm.blocked_online_softmax(x, 16),
    "blocked B=16 tree": lambda x: sm.blocked_online_softmax(x, 16, order="tree"),
    "blocked B=200": lambda x: sm.blocked_online_softmax(x, 200),
}
ALL = {"naive": sm.naive_softmax, **STABLE}
SHAPES = [(1,), (7,), (3, 5), (2, 3, 17), (4, 97), (5, 1), (2, 1, 1025)]


def _torch_softmax(x):
    return torch.softmax(torch.from_numpy(np.ascontiguousarray(x)), dim=-1).numpy()


def _assert_matches_torch(y, x, rtol, atol):
    ref = _torch_softmax(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref), err_msg="NaN where torch has none")
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=atol, equal_nan=True)


@pytest.fixture(autouse=True)
def _quiet_numpy():
    with np.errstate(all="ignore"):  # overflow and 0/0 are what some tests are about
        yield


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_torch_float64(name, shape):
    x = np.random.default_rng(hash(shape) % 2**32).standard_normal(shape) * 3
    _assert_matches_torch(ALL[name](x), x, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ALL)
def test_matches_torch_float32(name):
    x = (np.random.default_rng(3).standard_normal((8, 300)) * 3).astype(np.float32)
    y = ALL[name](x)
    ref64 = _torch_softmax(x.astype(np.float64))
    err = np.abs(y - ref64).max()
    torch_err = np.abs(_torch_softmax(x) - ref64).max()
    print(f"{name}: max err {err:.2e}, torch float32 {torch_err:.2e}")
    assert err <= 2 * torch_err + 1e-6


@pytest.mark.parametrize("name", STABLE)
def test_stable_variants_survive_inputs_scaled_by_1e4(name):
    x = np.random.default_rng(4).standard_normal((6, 33)) * 1e4
    assert np.isfinite(_torch_softmax(x)).all()
    _assert_matches_torch(STABLE[name](x), x, rtol=1e-9, atol=1e-300)


def test_naive_softmax_breaks_on_inputs_scaled_by_1e4():
    """The exception that is the lesson: e^x overflows, inf/inf = NaN."""
    x = np.random.default_rng(4).standard_normal((6, 33)) * 1e4
    assert np.isnan(sm.naive_softmax(x)).any(axis=-1).all()


@pytest.mark.parametrize("dtype, big", [(np.float32, 100.0), (np.float16, 12.0)])
def test_naive_overflow_thresholds(dtype, big):
    x = np.array([big, 0.0, -1.0], dtype=dtype)
    assert np.isnan(sm.naive_softmax(x)).any()
    assert np.isfinite(sm.safe_softmax(x)).all()
    limits = sm.exp_limits(dtype)
    assert limits["overflow_above"] < big


@pytest.mark.parametrize("name", ALL)
def test_rows_with_neg_inf(name):
    x = np.random.default_rng(5).standard_normal((6, 9))
    x[0, :2] = -np.inf          # two masked entries first: the unguarded online update fails
    x[1, ::2] = -np.inf
    x[2, -1] = -np.inf
    x[3, :] = -np.inf           # fully masked: NaN, as torch
    x[4, 1:] = -np.inf          # one entry left
    _assert_matches_torch(ALL[name](x), x, rtol=1e-12, atol=1e-15)
    assert np.isnan(ALL[name](x)[3]).all()


@pytest.mark.parametrize("name", ALL)
def test_empty_rows_and_bad_input(name):
    assert ALL[name](np.zeros((3, 0))).shape == (3, 0)
    with pytest.raises(ValueError, match="at least one dimension"):
        ALL[name](np.float64(1.0))


def test_integer_input_becomes_float():
    np.testing.assert_allclose(sm.online_softmax([1, 2, 3]), _torch_softmax(np.array([1., 2, 3])))


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError),
                                        (True, TypeError)])
def test_block_size_is_checked(bad, error):
    with pytest.raises(error, match="block_size"):
        sm.blocked_online_softmax(np.ones(4), bad)


def test_reduce_md_rejects_a_bad_order():
    m, d = sm.block_md(np.arange(6.0), 2)
    with pytest.raises(ValueError, match="permutation"):
        sm.reduce_md(m, d, order=[0, 0, 1])
    with pytest.raises(ValueError, match="tree"):
        sm.reduce_md(m, d, order="forest")
    np.testing.assert_allclose(sm.reduce_md(m, d, order=np.array([2, 0, 1])), sm.reduce_md(m, d))


def test_logsumexp():
    x = np.random.default_rng(6).standard_normal((5, 40)) * 300
    x[1, :3] = -np.inf
    x[2] = -np.inf
    ref = torch.logsumexp(torch.from_numpy(x), dim=-1).numpy()
    np.testing.assert_allclose(sm.logsumexp(x), ref, rtol=1e-13)
    assert sm.logsumexp(np.array([-np.inf])) == -np.inf
    assert np.isinf(sm.naive_logsumexp(x[0].astype(np.float32))), "e^x overflows above 88.7"
    assert sm.logsumexp(x[0].astype(np.float32)) == pytest.approx(ref[0], rel=1e-6)


def test_softmax_is_exp_of_x_minus_lse():
    x = np.random.default_rng(7).standard_normal((4, 12)) * 5
    np.testing.assert_allclose(np.exp(x - sm.logsumexp(x)[..., None]), sm.online_softmax(x),
                               rtol=1e-12)


def test_gradient_of_lse_is_softmax():
    x = torch.randn(3, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(8)) * 4
    x.requires_grad_(True)
    torch.logsumexp(x, dim=-1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), sm.online_softmax(x.detach().numpy()),
                               rtol=1e-12, atol=1e-15)


def test_dtype_is_kept_and_float16_works():
    x = (np.random.default_rng(9).standard_normal((4, 20)) * 4).astype(np.float16)
    for name, fn in ALL.items():
        y = fn(x)
        assert y.dtype == np.float16, name
        np.testing.assert_allclose(y.astype(np.float64), _torch_softmax(x.astype(np.float64)),
                                   atol=2e-3, err_msg=name)


# ----------------------------------------------------------------------------- properties
finite = st.floats(-50, 50, allow_nan=False)
state = st.tuples(finite, st.floats(0.01, 100))
empty_or_state = st.one_of(st.just((-math.inf, 0.0)), state)
rows = hnp.arrays(np.float64, st.integers(1, 40),
                  elements=st.one_of(st.floats(-30, 30), st.just(-math.inf)))


def _md_close(a, b):
    np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-12)


@settings(max_examples=150, deadline=None)
@given(empty_or_state, empty_or_state)
def test_merge_is_commutative(a, b):
    assert sm.merge_md(*a, *b) == sm.merge_md(*b, *a)  # exactly, not just approximately


@settings(max_examples=150, deadline=None)
@given(empty_or_state, empty_or_state, empty_or_state)
def test_merge_is_associative(a, b, c):
    _md_close(sm.merge_md(*sm.merge_md(*a, *b), *c), sm.merge_md(*a, *sm.merge_md(*b, *c)))


@settings(max_examples=100, deadline=None)
@given(state)
def test_empty_state_is_the_identity(a):
    assert sm.merge_md(-math.inf, 0.0, *a) == (a[0], a[1])
    assert sm.merge_md(*a, -math.inf, 0.0) == (a[0], a[1])


@settings(max_examples=60, deadline=None)
@given(rows, st.integers(1, 45), st.randoms(use_true_random=False))
def test_blocked_result_does_not_depend_on_block_size_or_order(x, block_size, rnd):
    with np.errstate(all="ignore"):
        ref = sm.safe_softmax(x)
        n_blocks = math.ceil(x.size / block_size)
        order = list(range(n_blocks))
        rnd.shuffle(order)
        for y in (sm.blocked_online_softmax(x, block_size),
                  sm.blocked_online_softmax(x, block_size, order="tree"),
                  sm.blocked_online_softmax(x, block_size, order=order)):
            np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-300, equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(rows)
def test_online_md_is_max_and_sum(x):
    m, d = sm.online_md(x)
    assert m == x.max()
    if m > -math.inf:
        np.testing.assert_allclose(d, np.exp(x - m).sum(), rtol=1e-12)


# ----------------------------------------------------------------------------- counting
@pytest.mark.parametrize("name", softmax_cost.VARIANTS)
@pytest.mark.parametrize("s", [1, 2, 3, 5, 16, 17, 40])
def test_counts_equal_the_closed_forms(name, s):
    softmax_cost.check_closed_forms(name, s)                     # s×s, as in seed 003
    softmax_cost.check_closed_forms(name, s, rows=3, block_size=4)


def test_accesses_per_element_are_the_seeds():
    rows = softmax_cost.table(sizes=(40,), block_size=16)
    assert {r["variant"]: r["accesses_per_element"] for r in rows} == {
        "naive": 3, "safe": 4, "online": 3, "blocked": 3, "fused": 2}
    assert {r["variant"]: r["footprint"] for r in rows} == {
        "naive": 1, "safe": 1, "online": 1, "blocked": 16, "fused": 40}


def test_counting_does_not_change_the_result():
    x = np.random.default_rng(10).standard_normal((4, 13))
    for name, v in softmax_cost.VARIANTS.items():
        args = (5,) if name == "blocked" else ()
        _, y = count(v.fn, x, *args)
        np.testing.assert_array_equal(y, v.fn(x, *args))


def test_counter_refuses_what_it_cannot_count():
    with pytest.raises(TypeError, match="np.sin"):
        count(lambda x: np.sin(x), np.ones(3))
    with pytest.raises(TypeError, match="never stored"):
        count(lambda x: x[..., :] * 2, np.ones(3))
    with pytest.raises(TypeError, match="cannot be converted"):
        count(lambda x: np.asarray(x), np.ones(3))
    assert "memory" in repr(Tracked(np.ones(2), None, in_memory=True))


def test_pass_ledger_adds_up():
    for name in ("safe", "online"):
        ledger = softmax_cost.pass_ledger(name, 6)
        total = sum(c.flops() for _, c in ledger)
        assert total == softmax_cost.flops_closed_form(name, 6)
        assert sum(c.reads + c.writes for _, c in ledger) == {"safe": 4, "online": 3}[name] * 36


def test_notebook_text_states_the_measured_closed_forms():
    """The lesson's prose quotes the same closed forms that the counts are checked against."""
    nb = json.loads((ROOT / "notebooks" / "01_softmax.ipynb").read_text(encoding="utf-8"))
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    for v in softmax_cost.VARIANTS.values():  # in plain text or in LaTeX
        latex = (v.flops_label.replace("s²", "s^2").replace("−", "-")
                 .replace("⌈s/B⌉", "\\lceil s/B \\rceil"))
        assert v.flops_label in text or latex in text, f"the lesson does not state {v.flops_label}"


# ----------------------------------------------------------------------------- widget, figures
def test_trace_ends_at_online_md():
    from course_lib.widgets.softmax_steps import DEMO_ROW, trace

    for b in (1, 3, 4, 10):
        last = trace(DEMO_ROW, b)[-1]
        m, d = sm.online_md(DEMO_ROW)
        assert last.m_new == m and math.isclose(last.d_new, d, rel_tol=1e-14)
    assert trace(DEMO_ROW, 1)[0].rescale == 0.0


def test_figures_and_widget_draw(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.widgets import softmax_steps

    for name, make in {**sm.FIGURES, **softmax_steps.FIGURES}.items():
        fig = make()
        assert fig.get_axes(), name
        plt.close(fig)
    with pytest.raises(ValueError, match="k must be"):
        softmax_steps.draw_step(softmax_steps.DEMO_ROW, 99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        box = softmax_steps.online_softmax_widget(softmax_steps.DEMO_ROW)
    step_slider, block_slider = box.children[0].children
    block_slider.value = 4
    assert step_slider.max == 2
    plt.close("all")


# ----------------------------------------------------------------------------- exercises
def test_reference_solutions_pass_the_checkers():
    assert ex.check_online_update(sm.online_update) and ex.check_merge(sm.merge_md)
    assert ex.check_logsumexp(sm.logsumexp)


def test_unfinished_and_unguarded_exercises_get_hints(capsys):
    def stub(*args):
        raise NotImplementedError

    for checker in (ex.check_online_update, ex.check_merge, ex.check_logsumexp):
        assert checker(stub).status == "todo"
    assert capsys.readouterr().out.count("not done yet") == 3

    def unguarded(m1, d1, m2, d2):
        m = np.maximum(m1, m2)
        return m, d1 * np.exp(m1 - m) + d2 * np.exp(m2 - m)

    result = ex.check_merge(unguarded)
    assert not result and "masked entries" in result.message and "NaN" in result.message
    assert "np.where" in result.message and "hint('merge')" in result.message


def test_tile_md_is_the_state_of_one_block():
    x = np.random.default_rng(11).standard_normal((3, 10)) * 3
    x[1] = -np.inf                                            # a block that is all masked
    x[2, :4] = -np.inf
    m, d = sm.tile_md(x)
    m_b, d_b = sm.block_md(x, 10)
    np.testing.assert_array_equal(m, m_b[:, 0])
    np.testing.assert_array_equal(d, d_b[:, 0])
    assert (m[1], d[1]) == (-np.inf, 0.0)                     # the empty state, not (-inf, 1)
    assert sm.tile_md(np.array([-np.inf])) == (-np.inf, 0.0)


def test_blocked_softmax_exercise_tests_the_loop_with_its_own_merge():
    from course_lib.exercises import catalogue

    e = catalogue()["blocked_softmax"]
    assert ex.check_blocked_softmax(e.solution, show=False)

    def from_first_block(x, B, merge):                        # no empty state: also right
        m, d = sm.tile_md(x[..., :B])
        for lo in range(B, x.shape[-1], B):
            m, d = merge(m, d, *sm.tile_md(x[..., lo:lo + B]))
        return np.exp(x - np.expand_dims(m, -1)) / np.expand_dims(d, -1)

    assert ex.check_blocked_softmax(from_first_block, show=False)
    # every registered mistake is told its own diagnosis (its registered phrase), and no other
    # mistake's: the two short loops too, told apart by the blocks they merge
    for mistake in e.mistakes:
        message = e.check(mistake.answer, show=False).message
        assert "Diagnosis" in message and mistake.expect in message, (mistake.label, message)
        others = [o for o in e.mistakes if o is not mistake and o.label in message]
        assert not others, (mistake.label, [o.label for o in others])
    dropped, early = (next(m for m in e.mistakes if key in m.label)
                      for key in ("shorter last block dropped", "stops a block early"))
    assert early.expect not in e.check(dropped.answer, show=False).message
    assert dropped.expect not in e.check(early.answer, show=False).message

    def guarded(x, B, merge):                                 # 0 for a fully masked row
        y = e.solution(x, B, merge)
        return np.where(np.isnan(y), 0.0, y)

    result = ex.check_blocked_softmax(guarded, show=False)
    assert not result and "fully masked" in result.message and "NaN" in result.message
