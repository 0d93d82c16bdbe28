"""The Python side of lessons 08 and 09: block kinds against the kernel's own bounds and the
causal mask, the grid order, deferred normalisation, the stored-benchmark readers, shared
memory per stage, the ceiling model, TMA clipping, probe 1 and the exercises."""
import json
import math

import pytest
import torch
import triton
from matplotlib.figure import Figure

from course_lib.analysis import flash_v2 as plan
from course_lib.analysis import hopper as hp
from course_lib.bench import attention as ab
from course_lib.bench import common
from course_lib.bench import kernel_configs as kc
from course_lib.bench.common import load_result
from course_lib.bench.plots import plot_attention
from course_lib.exercises import flash_v2 as ex
from course_lib.exercises.attention import rescale_update_solution
from course_lib.kernels import flash_v2_hopper as hop
from course_lib.reference import attention, causal_mask
from course_lib.testing import assert_close_2x, attention_same_precision, fresh_randn, poison_

BLOCKS = [(16, 16), (32, 16), (16, 32), (64, 32), (128, 64)]


# ----------------------------------------------------------------------------- block kinds

@pytest.mark.parametrize("causal", [True, False])
def test_python_mirror_agrees_with_the_jitted_causal_bounds(causal):
    sizes = [(1, 1), (17, 17), (64, 64), (97, 130), (130, 97), (200, 33), (33, 200), (256, 256),
             (300, 200), (1000, 1000)]
    for N_q, N_k in sizes:
        for bm, bn in BLOCKS:
            want = [plan.causal_bounds(s, N_q, N_k, causal, bm, bn) for s in range(0, N_q, bm)]
            assert plan.kernel_bounds(N_q, N_k, bm, bn, causal) == want, (N_q, N_k, bm, bn)


def _needed_kind(vis, r0, r1, c0, bn, N_k):
    """What visibility alone asks for: no visible key -> skipped; every key of the block exists
    and every row sees it -> unmasked; anything else -> masked."""
    block = vis[r0:r1, c0:c0 + bn]
    if not block.any():
        return plan.SKIPPED
    if c0 + bn <= N_k and bool(block.all()):
        return plan.UNMASKED
    return plan.MASKED


@pytest.mark.parametrize("bm,bn", BLOCKS[:4])
@pytest.mark.parametrize("causal", [True, False])
def test_kinds_cover_exactly_the_visible_keys(bm, bn, causal):
    for N_q in (1, 5, 16, 17, 40, 64, 97):
        for N_k in (1, 3, 16, 31, 50, 64, 100):
            vis = causal_mask(N_q, N_k) if causal else torch.ones(N_q, N_k, dtype=torch.bool)
            kinds = plan.causal_block_kinds(N_q, N_k, bm, bn, causal)
            assert kinds.shape == (math.ceil(N_q / bm), math.ceil(N_k / bn))
            covered = torch.zeros(N_q, N_k, dtype=torch.int64)
            for i, r0 in enumerate(range(0, N_q, bm)):
                r1 = min(r0 + bm, N_q)
                for j, c0 in enumerate(range(0, N_k, bn)):
                    k = int(kinds[i, j])
                    assert k == _needed_kind(vis, r0, r1, c0, bn, N_k), (N_q, N_k, i, j)
                    if k != plan.SKIPPED:
                        covered[r0:r1, c0:c0 + bn] += 1
            # every visible score is computed exactly once; skipped blocks hold none
            assert torch.all(covered[vis] == 1) and torch.all(covered <= 1)


def test_causal_computes_about_half_and_skips_the_rest():
    prev = 1.0
    for N in (512, 1024, 4096, 16384):
        f = plan.computed_fraction(N, N, 128, 64)
        assert f["visible"] == pytest.approx(0.5 + 0.5 / N)
        assert f["visible"] < f["computed"] <= f["visible"] + 128 / N  # the diagonal band
        assert f["computed"] < prev
        prev = f["computed"]
    counts = plan.kind_counts(plan.causal_block_kinds(4096, 4096, 128, 64))
    assert counts == {"skipped": 992, "unmasked": 992, "masked": 64}
    assert plan.computed_fraction(100, 100, 32, 16, causal=False) == {"computed": 1.0,
                                                                       "visible": 1.0}


def test_non_causal_masks_only_the_ragged_last_block():
    kinds = plan.causal_block_kinds(100, 100, 32, 16, causal=False)
    assert (kinds[:, :-1] == plan.UNMASKED).all() and (kinds[:, -1] == plan.MASKED).all()
    assert (plan.causal_block_kinds(64, 64, 32, 16, causal=False) == plan.UNMASKED).all()


def test_rows_that_see_no_key_skip_every_block():
    kinds = plan.causal_block_kinds(300, 200, 64, 32)
    assert (kinds[0] == plan.SKIPPED).all()  # rows 0..63 see keys j <= i - 100: none
    assert plan.causal_bounds(0, 300, 200, True, 64, 32) == (0, -36)


# ----------------------------------------------------------------------------- grid

def test_program_order_q_blocks_fastest_and_causal_longest_first():
    order = plan.program_order(B=2, H=4, H_kv=2, N_q=300, BLOCK_M=128)
    assert plan.grid(2, 4, 300, 128) == (3, 8) and len(order) == 24
    assert order[:7] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 1, 0, 0), (0, 1, 0, 1),
                         (0, 1, 0, 2), (0, 2, 1, 0)]
    old = plan.program_order(B=2, H=4, H_kv=2, N_q=300, BLOCK_M=128, order="heads_fastest")
    assert plan.grid(2, 4, 300, 128, "heads_fastest") == (8, 3)
    assert old[:5] == [(0, 0, 0, 0), (0, 1, 0, 0), (0, 2, 1, 0), (0, 3, 1, 0), (1, 0, 0, 0)]
    assert sorted(old) == sorted(order)
    causal = plan.program_order(B=1, H=8, H_kv=8, N_q=1024, BLOCK_M=128, causal=True)
    work = [plan.causal_bounds(m * 128, 1024, 1024, True, 128, 64)[1] for *_, m in causal]
    for h in range(8):  # longest rows of each head first
        assert work[8 * h:8 * h + 8] == sorted(work[8 * h:8 * h + 8], reverse=True)
    with pytest.raises(ValueError, match="multiple"):
        plan.program_order(1, 6, 4, 64, 64)
    with pytest.raises(ValueError, match="order"):
        plan.grid(1, 1, 64, 64, order="random")


def test_kv_reuse_distance_explains_measurement_1():
    fig2 = (64, 16, 16, 1024, 1024, 64, 128)
    new, old = (plan.kv_reuse(*fig2, order=o) for o in plan.ORDERS)
    assert new == {"order": "q_blocks_fastest", "programs_between": 0, "kv_bytes_between": 0}
    assert old["programs_between"] == 64 * 16 - 1
    assert old["kv_bytes_between"] == 1023 * 2 * 1024 * 64 * 2  # 256 MiB through a 50 MiB L2
    gqa = plan.kv_reuse(1, 8, 2, 512, 512, 64, 128, order="heads_fastest")
    assert gqa["programs_between"] == 8 - 4  # the other group's 4 heads


def test_measurement_1_is_the_every_reread_model():
    from course_lib.iomodel.attention import flash_v2_io

    m1 = {r["target"].split(",")[0].split(" (")[0]: r for r in plan.hbm_measurement_1()}
    model = flash_v2_io(1024, 1024, 64, 128, 64, 64, 16)["hbm_bytes"] / 1e9
    assert m1["v2 portable"]["gb"] == pytest.approx(model, rel=0.01)
    assert m1["SDPA FLASH_ATTENTION"]["x minimum"] < 1.05
    with pytest.raises(ValueError, match="no heading"):
        plan.markdown_table("# a\n", "b")
    with pytest.raises(ValueError, match="no table"):
        plan.markdown_table("# b\ntext\n", "b")


def test_programs_table():
    rows = plan.programs_table(ab.shapes(head_dims=(128,), causal=(False,)))
    last = rows[-1]
    assert (last["N"], last["v1 programs"], last["v2 programs"]) == (16384, 32, 32 * 128)


# ----------------------------------------------------------------------------- normalisation

def test_deferred_normalisation_counts_and_numbers():
    ops = plan.normalisation_ops(N_k=16384, BLOCK_M=128, BLOCK_N=64, D=128)
    assert ops["T_c"] == 256
    assert ops["saved"]["multiplications"] == 256 * 128 * 128
    assert ops["saved"]["divisions"] == 255 * 128 * 128
    # and the two orders give one O (fp64)
    gen = torch.Generator().manual_seed(0)
    S = torch.randn(8, 40, generator=gen, dtype=torch.float64) * 4
    V = torch.randn(40, 5, generator=gen, dtype=torch.float64)
    O = torch.zeros(8, 5, dtype=torch.float64)
    l, m = torch.zeros(8, dtype=torch.float64), torch.full((8,), -math.inf, dtype=torch.float64)
    acc, ld, md = O.clone(), l.clone(), m.clone()
    for c0 in range(0, 40, 16):
        O, l, m = rescale_update_solution(O, l, m, S[:, c0:c0 + 16], V[c0:c0 + 16])
        md, ld, acc = ex.online_softmax_step_solution(S[:, c0:c0 + 16], md, ld, acc,
                                                      V[c0:c0 + 16], ex.LOG2E)
    torch.testing.assert_close(acc / ld[:, None], torch.softmax(S, -1) @ V)
    torch.testing.assert_close(O, acc / ld[:, None])


# ----------------------------------------------------------------------------- stored results

def _fake_sweep(tmp_path):
    providers = ab.provider_names("fwd", ("portable", "hopper"))
    speed = {"v1": 0.1, "v2-portable": 0.6, "v2-hopper": 0.9, "sdpa-FLASH_ATTENTION": 0.5,
             "sdpa-CUDNN_ATTENTION": 1.0, "sdpa-EFFICIENT_ATTENTION": 0.3, "sdpa-MATH": 0.05}
    rows = ab.run_sweep(ab.shapes(seq_lens=(4096,)), providers,
                        lambda name, shape: {"ms": 1.0 / speed[name]}, progress=False)
    return ab.write(ab.make_result(rows, providers, "fwd", "fp16"), tmp_path, plot=False)


def test_stored_results_are_read_through_the_bench_loader(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "DATA_DIR", tmp_path)
    assert common.load_result("attention_fwd") is None
    _fake_sweep(tmp_path)
    result = common.load_result("attention_fwd")
    rows = plan.speed_rows(result)
    assert len(rows) == 4 and {r["D"] for r in rows} == {64, 128}
    for r in rows:
        assert r["v2-hopper/FA2"] == pytest.approx(1.8) and r["v2-portable/FA2"] == pytest.approx(
            1.2)
        assert set(r) >= {"sdpa-FLASH_ATTENTION", "sdpa-CUDNN_ATTENTION"}
    gains = hp.impl_gain_rows(result)
    assert all(g["hopper/portable"] == pytest.approx(1.5) and g["hopper/cuDNN"] ==
               pytest.approx(0.9) for g in gains)
    assert isinstance(plot_attention(result), Figure)

    hbm = {"shape": {}, "minimum_gb": 0.54, "rows": [
        {"target": "v2-portable", "total_gb": 0.55, "predicted_gb": 0.54, "x minimum": 1.02},
        {"target": "v2-hopper", "total_gb": 0.60, "predicted_gb": 0.54, "x minimum": 1.11},
        {"target": "v1", "total_gb": None, "predicted_gb": 9.0, "x minimum": None,
         "error": "boom"}]}
    (tmp_path / "hbm.json").write_text(json.dumps(hbm))
    got = {r["target"]: r for r in plan.hbm_rows(common.load_result("hbm"))}
    assert got["v2-portable"]["meets goal"] and not got["v2-hopper"]["meets goal"]
    assert "meets goal" not in got["v1"] and got["v1"]["error"] == "boom"


# ----------------------------------------------------------------------------- Hopper numbers

def test_shared_memory_per_stage():
    assert hp.smem_bytes(128, 128, 128, 3) == {"q": 32768, "per_stage": 65536, "stages": 3,
                                              "total": 229376}
    assert hp.max_stages(128, 128, 128, 227 * 1024) == 3
    assert hp.max_stages(128, 128, 256, 227 * 1024) == 1
    assert hp.max_stages(256, 64, 256, 64 * 1024) == 0
    rows = hp.config_rows()
    assert len(rows) == 3 * len(kc.HOPPER_CONFIGS)
    for r in rows:
        assert not r["kept"] or r["fits"], r  # the table never runs what cannot fit
    kept256 = [r["config"] for r in rows if r["D"] == 256 and r["kept"]]
    assert kept256 == ["64x64 w4 s2 Q smem pinned"]
    assert all(r["fits"] for r in rows if r["D"] == 64)  # everything fits at D 64 ...
    kept64 = [r["config"] for r in rows if r["D"] == 64 and r["kept"]]
    assert kept64 == ["128x64 w4 s3 pinned", "64x64 w4 s3 pinned"]  # measured (short causal)


def test_ceiling_model():
    c64, c128 = hp.score_costs(64), hp.score_costs(128)
    assert c64["bound"] == "softmax" and c128["bound"] == "MMA"
    assert c128["mma_ps"] == pytest.approx(2 * c64["mma_ps"])
    assert c64["exp2_ps"] == pytest.approx(1e12 * 4096 / (16 * 989.4e12))
    for c in (c64, c128):
        assert c["serial_tflops"] < c["overlapped_tflops"] <= c["peak_tflops"]
    assert c128["overlapped_tflops"] == pytest.approx(989.4)
    assert hp.softmax_fp32_ops(128, 64)["rescale acc by α (FMUL, D / BLOCK_N)"] == 2


def test_tma_clips_loads_and_stores():
    d = hp.tma_tile_demo(N=20, D=16, start=16, BLOCK=8)
    x, tile, buf = d["x"][0, 0], d["tile"], d["buf"][0, 0]
    assert torch.equal(tile[:4], x[16:20]) and torch.all(tile[4:] == 0)
    assert torch.equal(buf[16:20], x[16:20] + 1)
    assert torch.all(buf[:16] == 0) and torch.all(buf[20:] == 0)  # rows past N: dropped


def test_probe_one_parses():
    probe = hp.load_probe()
    assert probe["environment"]["triton"] == "3.6.0" and "H100" in probe["environment"]["gpu"]
    assert len(probe["rows"]) == 8 and probe["providers"] == [
        "v2-portable", "v2-hopper", "sdpa-FLASH_ATTENTION", "sdpa-CUDNN_ATTENTION"]
    row = next(r for r in probe["rows"] if (r["D"], r["causal"], r["N"]) == (128, False, 16384))
    assert row["results"]["v2-hopper"]["tflops"] == 443.4
    assert isinstance(plot_attention(probe), Figure)
    text = ("# x\n## Forward, probe 2\n\n| D | causal | N | portable | SDPA FLASH |\n"
            "|--|--|--|--|--|\n| 64 | 1 | 512 | 10.5 | 20.0 |\n\nmore\n")
    p2 = hp.parse_probe_table(text, "probe 2")
    assert p2["rows"] == [{"D": 64, "causal": True, "N": 512, "results": {
        "v2-portable": {"tflops": 10.5, "ms": None, "error": None},
        "sdpa-FLASH_ATTENTION": {"tflops": 20.0, "ms": None, "error": None}}}]
    with pytest.raises(ValueError, match="no heading"):
        hp.parse_probe_table(text, "probe 3")


@pytest.mark.parametrize("impl", ["portable", "hopper"])
@pytest.mark.parametrize("extra", [{}, {"Q_IN_REGS": True}])  # a Hopper config runs both kernels
def test_launch_config_runs_one_fixed_config(impl, extra):
    q = fresh_randn(1, 2, 70, 64, dtype=torch.float16)
    k, v = (fresh_randn(1, 1, 90, 64, dtype=torch.float16) for _ in range(2))
    cfg = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16, **extra}, num_warps=4, num_stages=2)
    o, lse, _ = hp.launch_config(impl, q, k, v, True, cfg)
    assert_close_2x(o, attention(q, k, v, causal=True),
                    attention_same_precision(q, k, v, causal=True), name=impl)
    with pytest.raises(ValueError, match="impl"):
        hp.launch_config("cuda", q, k, v, True, cfg)


def test_count_instructions_and_bucket():
    sass = ("  /*0100*/  HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;\n"
            "  /*0110*/  MUFU.EX2 R3, R2 ;\n  /*0120*/  HGMMA.64x128x16.F32 R24 ;\n")
    assert hp.count_instructions(sass, "HGMMA") == 2
    assert hp.count_instructions(sass, "MUFU.EX2") == 1
    assert hp.autotune_bucket(1000, 4097) == 8192 and hp.autotune_bucket(17, 1) == 32


# ----------------------------------------------------------------------------- figures, exercises

def test_figures():
    for name, make in {**plan.FIGURES, **hp.FIGURES}.items():
        fig = make()
        assert isinstance(fig, Figure), name


def test_exercise_solutions_pass_and_stubs_do_not_crash(capsys):
    def stub(*args):
        raise NotImplementedError

    for checker, solution in ((ex.check_online_softmax_step, ex.online_softmax_step_solution),
                              (ex.check_block_kinds, ex.block_kinds_solution),
                              (ex.check_max_stages, ex.max_stages_solution),
                              (ex.check_two_numbers, ex.two_numbers_solution)):
        assert checker(solution)
        assert checker(stub).status == "todo"
    # a wrong answer is reported with a nudge
    assert not ex.check_max_stages(lambda *a: 1)
    assert "Nudge" in capsys.readouterr().out
    # a wrong answer is reported with where it differs
    assert not ex.check_block_kinds(lambda *a: ["masked"] * len(ex.block_kinds_solution(*a)))
    assert not ex.check_block_kinds(lambda *a: ["maybe"])
    # a step that divides by l every time passes step by step only if it matches the spec
    assert not ex.check_online_softmax_step(
        lambda qk, m, l, acc, v, s: ex.online_softmax_step_solution(qk, m, l, acc, v, s * 0.9))


# ----------------------------------------------------------------------------- Q in registers

def test_q_in_regs_configs_labels_and_smem():
    assert hp.config_label(hop.hopper_config(64, False, 1 << 14)) == "128x64 w4 s3 pinned"
    assert hp.config_label(hop.hopper_config(256, False, 1 << 14)) == "64x64 w4 s2 Q smem pinned"
    # Q in registers frees the Q tile's buffer: 128 x 128 with 3 stages fits easily at D 128
    assert hp.smem_bytes(128, 128, 128, 3, q_in_regs=True)["total"] == 192 * 1024
    assert hp.smem_bytes(128, 128, 128, 3)["total"] == 224 * 1024


@pytest.mark.parametrize("q_in_regs", [False, True])
def test_hopper_kernel_with_q_in_registers_or_not(q_in_regs):
    q = fresh_randn(1, 2, 45, 64, dtype=torch.float16)
    k, v = (fresh_randn(1, 2, 70, 64, dtype=torch.float16) for _ in range(2))
    cfg = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16, "Q_IN_REGS": q_in_regs}, num_warps=4,
                        num_stages=2)
    o, lse, _ = hp.launch_config("hopper", q, k, v, True, cfg)
    assert_close_2x(o, attention(q, k, v, causal=True),
                    attention_same_precision(q, k, v, causal=True), name=f"regs={q_in_regs}")


def test_bench_hopper_pairs_configs_and_reports_gains():
    from course_lib.bench import hopper as bh

    speed = {"sdpa-FLASH_ATTENTION": 1.0, "sdpa-CUDNN_ATTENTION": 1.5}
    calls = []

    def measure(name, shape):
        calls.append(name)
        return {"ms": 1.0 / speed.get(name, 1.1 if name.endswith("Q smem") else 1.4)}

    result = bh.run(bh.shapes(head_dims=(64,), seq_lens=(4096,), causal=(True,)), measure,
                    rounds=2, progress=False)
    names = bh.providers(64)
    assert calls == names + names  # interleaved: every provider, then every provider again
    rows = bh.gain_rows(result)
    assert [r["config"] for r in rows] == ["128x64 w4 s3", "128x64 w4 s4", "64x64 w4 s3"]
    assert all(r["regs/smem"] == pytest.approx(1.4 / 1.1) and r["regs/FA2"] == pytest.approx(1.4)
               for r in rows)
    assert "regs/smem" in bh.report(result)


def test_bench_hopper_providers_run_the_configs():
    from course_lib.bench import attention as ab
    from course_lib.bench import hopper as bh

    assert bh.provider_fn("sdpa-CUDNN_ATTENTION", True) is not None
    with pytest.raises(ValueError, match="unknown provider"):
        bh.provider_fn("96x64 w4 s3", False)
    q = fresh_randn(1, 1, 70, 64, dtype=torch.float16)
    k, v = (fresh_randn(1, 1, 70, 64, dtype=torch.float16) for _ in range(2))
    for name in bh.providers(64)[2:4]:  # one config with Q in shared memory, then in registers
        o = bh.provider_fn(name, True)(q, k, v)
        assert_close_2x(o, attention(q, k, v, causal=True),
                        attention_same_precision(q, k, v, causal=True), name=name)
    assert ab.GPUMeasure("fwd", torch.float16, provider=bh.provider_fn).provider is bh.provider_fn


# ----------------------------------------------------------------------- tiles per head dim

def test_hopper_configs_per_head_dim():
    def kept(d, causal):
        return [hp.config_label(hop.hopper_config(d, causal, 1 << 14))]

    # one config per row: it won every paired point (hopper_pinned.json)
    assert kept(64, True) == kept(64, False) == ["128x64 w4 s3 pinned"]
    assert kept(128, False) == kept(128, True) == ["64x64 w4 s3 l-MMA pinned"]
    # every config of the table is one of the candidates the benchmarks timed
    labels = {hp.config_label(c) for c in kc.HOPPER_CONFIGS}
    assert {hp.config_label(c) for c in (*hop.HOPPER_TABLE.values(), hop.SHORT_CAUSAL_64)} <= labels
    assert [d for d in (16, 32, 64, 128, 256) if kc.kept(kc.HOPPER_CONFIGS[10], d)] == [16, 32, 64]


def test_short_causal_sequences_at_d64_take_64_row_tiles():
    def kept(d, causal, n_bucket):
        return [hp.config_label(hop.hopper_config(d, causal, n_bucket))]

    assert hop.SHORT_CAUSAL_N == 2048
    for n in (16, 1024, 2048):
        assert kept(64, True, n) == kept(32, True, n) == ["64x64 w4 s3 pinned"]
        assert kept(64, False, n) == ["128x64 w4 s3 pinned"]  # non-causal: as before
        assert kept(128, True, n) == ["64x64 w4 s3 l-MMA pinned"]  # other head dims: as before
    assert kept(64, True, 4096) == ["128x64 w4 s3 pinned"]
    # the stored paired run the rule was read off: 64-row tiles won at every causal point up to
    # SHORT_CAUSAL_N in most rounds, and lost at B 8, N 4k and longer
    rows = [r for r in load_result("hopper_short_causal")["rows"] if r["causal"]]
    assert rows and all(r["won_64x64_vs_128x64"] >= 5 for r in rows
                        if r["N"] <= hop.SHORT_CAUSAL_N)
    assert any(r["won_64x64_vs_128x64"] <= 2 for r in rows if r["N"] > hop.SHORT_CAUSAL_N)


def test_tile_idea_rows_from_the_stored_paired_runs():
    data = hp.load_tiles()
    assert data["environment"]["gpu"].startswith("NVIDIA H")
    rows = hp.tile_idea_rows(data)
    ideas = {r["idea"] for r in rows}
    assert len(ideas) == len(hp.TILE_IDEAS)  # every idea has stored rows
    for r in rows:
        assert r["with / without"] == pytest.approx(r["with / FA2"] / r["without / FA2"])
    small = [r for r in rows if r["idea"].startswith("64 x 64 tiles at D 128") and r["N"] <= 8192]
    assert small and all(r["with / without"] > 1.0 for r in small)  # why 64 x 64 comes first
    persistent = [r for r in rows if r["idea"].startswith("persistent")]
    assert persistent and all(r["with / without"] < 0.9 for r in persistent)
    # the ratio of a fake run is computed from its own numbers
    fake = {"runs": {"exp8": [{"D": 128, "N": 4096, "causal": False, "variants": {
        "64x64w4s3": {"ratio": 1.5}, "128x128w8s3": {"ratio": 1.2}}}], "exp7": [], "exp9": []}}
    (row,) = hp.tile_idea_rows(fake)
    assert row["with / without"] == pytest.approx(1.25)


# --------------------------------------------------------------------------------- l on MMA

_LMMA_CFG = hop._cfg(32, 16, 4, 2, True, True)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1, 64), (1, 4, 2, 97, 130, 64),
                                   (1, 2, 1, 130, 97, 128), (2, 2, 2, 17, 17, 32)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_row_sums_on_the_tensor_cores(shape, causal, dtype):
    """ROWSUM_MMA: l accumulated as P @ ones; O and the lse stay within the 2x rule."""
    B, H, H_kv, N_q, N_k, D = shape
    q = fresh_randn(B, H, N_q, D, dtype=dtype)
    k, v = (fresh_randn(B, H_kv, N_k, D, dtype=dtype) for _ in range(2))
    out = (poison_(torch.empty(B, H, N_q, D, dtype=dtype, device=q.device)),
           poison_(torch.empty(B, H, N_q, device=q.device)))
    assert hp.config_label(_LMMA_CFG) == "32x16 w4 s2 l-MMA"
    o, lse, _ = hp.launch_config("hopper", q, k, v, causal, _LMMA_CFG, out=out)
    ref_o, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    assert not torch.isnan(o).any()
    assert_close_2x(o, ref_o, attention_same_precision(q, k, v, causal=causal), name="O l-MMA")
    # l sums P rounded to the inputs' dtype: at most a factor 1 +- u off (hop.lse_rounding)
    u = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    assert u == hop.lse_rounding(dtype, 128)
    assert_close_2x(lse, ref_lse, ref_lse, name="lse l-MMA", atol=1e-4 + u)


def test_row_sums_on_the_tensor_cores_extreme_logits_and_blind_rows():
    q = fresh_randn(1, 2, 50, 32, dtype=torch.float16)
    k, v = (fresh_randn(1, 2, 10, 32, dtype=torch.float16) for _ in range(2))
    o, lse, _ = hp.launch_config("hopper", q, k, v, True, _LMMA_CFG, sm_scale=1e4)
    assert torch.all(o[:, :, :40] == 0) and torch.all(torch.isinf(lse[:, :, :40]))
    assert torch.isfinite(o).all() and torch.isfinite(lse[:, :, 40:]).all()
    ref_lse = attention(q, k, v, causal=True, sm_scale=1e4, return_lse=True)[1]
    torch.testing.assert_close(lse[:, :, 40:], ref_lse[:, :, 40:], atol=1e-2, rtol=1e-5)


@pytest.mark.parametrize("D, rowsum", [(64, False), (128, True)])
def test_the_interpreter_runs_the_gpu_code_path(monkeypatch, D, rowsum):
    """flash_attn_v2's Hopper kernel in the interpreter takes the switches of the config the
    GPU runs first (small tiles): the pinned max, and at D 128 the row sums on the tensor
    cores."""
    from course_lib import INTERPRET
    from course_lib.ops import flash_attn_v2

    first = hop.hopper_config(D, False, 1 << 14)
    assert first.kwargs["ROWSUM_MMA"] is rowsum and first.kwargs["Q_IN_REGS"]
    assert first.kwargs["PINNED_MAX"]
    if not INTERPRET:
        pytest.skip("checks the interpreter's launch")
    seen = {}
    kernel = hop._flash_fwd_v2_hopper_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(kwargs)
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(hop, "_flash_fwd_v2_hopper_kernel", Spy())
    q, k, v = (fresh_randn(1, 2, 20, D, dtype=torch.float16) for _ in range(3))
    o = flash_attn_v2(q, k, v, causal=True, impl="hopper")
    assert seen["ROWSUM_MMA"] is rowsum and seen["Q_IN_REGS"] and seen["BLOCK_M"] == 32
    assert seen["PINNED_MAX"]
    assert_close_2x(o, attention(q, k, v, causal=True),
                    attention_same_precision(q, k, v, causal=True), name="spied")


def test_rowsum_and_clock_rows_from_the_stored_runs():
    rows = hp.rowsum_rows()
    ideas = {r["idea"] for r in rows}
    assert ideas == {i[0] for i in hp.ROWSUM_IDEAS}
    d128 = [r["with / without"] for r in rows if r["idea"].startswith("l on MMA, 64 x 64")]
    assert len(d128) == 12 and sum(d128) / len(d128) > 1.0  # why the D 128 configs adopt it
    clocks = hp.clock_rows()
    assert {r["kernel"] for r in clocks} >= {"FA2", "flash_attn_v2"}
    assert all(600 < r["W"] < 720 and 1000 < r["SM MHz"] < 2000 for r in clocks)


# --------------------------------------------------------------------------------- pinned max

def _pinned_cfg(rowsum):
    return hop._cfg(32, 16, 4, 2, True, rowsum, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1, 64), (1, 4, 2, 97, 130, 64),
                                   (1, 2, 1, 130, 97, 128), (2, 2, 2, 17, 17, 32),
                                   (1, 2, 2, 64, 16, 16)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rowsum", [False, True], ids=["l-FADD", "l-MMA"])
def test_pinned_max(shape, causal, dtype, rowsum):
    """PINNED_MAX: every block after the first uses the first block's row max; O and the lse
    within the 2x rule, on ragged, GQA and causal shapes (N_k 16 = one key block only)."""
    B, H, H_kv, N_q, N_k, D = shape
    q = fresh_randn(B, H, N_q, D, dtype=dtype)
    k, v = (fresh_randn(B, H_kv, N_k, D, dtype=dtype) for _ in range(2))
    out = (poison_(torch.empty(B, H, N_q, D, dtype=dtype, device=q.device)),
           poison_(torch.empty(B, H, N_q, device=q.device)))
    cfg = _pinned_cfg(rowsum)
    assert hp.config_label(cfg) == "32x16 w4 s2" + (" l-MMA" if rowsum else "") + " pinned"
    o, lse, _ = hp.launch_config("hopper", q, k, v, causal, cfg, out=out)
    ref_o, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert_close_2x(o, ref_o, attention_same_precision(q, k, v, causal=causal), name="O pinned")
    u = 0.0 if dtype == torch.float32 or not rowsum else torch.finfo(dtype).eps / 2
    assert_close_2x(lse, ref_lse, ref_lse, name="lse pinned", atol=1e-4 + u)


def _spike(grow_log2, dtype):
    """q, k, v whose keys after the first block score ``grow_log2`` (log2 units) above the
    first block's: the first 16 keys score 0, the rest grow_log2 · ln 2 (sm_scale 1)."""
    D = 16
    q = torch.zeros(1, 1, 40, D, dtype=dtype, device=fresh_randn(1).device)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 48, D, dtype=dtype, device=q.device)
    k[:, :, 16:, 0] = grow_log2 * 0.6931471805599453
    k[:, :, :, 1:] = fresh_randn(1, 1, 48, D - 1, dtype=dtype) * 1e-3
    v = fresh_randn(1, 1, 48, D, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("grow_log2", [14.0, 30.0, 200.0])
@pytest.mark.parametrize("rowsum", [False, True], ids=["l-FADD", "l-MMA"])
def test_pinned_max_when_later_keys_score_far_higher(grow_log2, dtype, rowsum):
    """Later keys 2^14 above the pinned reference: P reaches 16384, still exact in fp16.
    2^30 and 2^200: fp16 P (or fp32 P, at 2^200) overflows, the program sees inf in its
    accumulator and runs again with the running max. Either way the answer is right."""
    q, k, v = _spike(grow_log2, dtype)
    out = (poison_(torch.empty_like(q)), poison_(torch.empty(1, 1, 40, device=q.device)))
    o, lse, _ = hp.launch_config("hopper", q, k, v, False, _pinned_cfg(rowsum), sm_scale=1.0,
                                 out=out)
    ref_o, ref_lse = attention(q, k, v, sm_scale=1.0, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert_close_2x(o, ref_o, attention_same_precision(q, k, v, sm_scale=1.0), name="O spike")
    u = 0.0 if dtype == torch.float32 or not rowsum else torch.finfo(dtype).eps / 2
    torch.testing.assert_close(lse, ref_lse, atol=1e-4 + u, rtol=1e-5)


def test_pinned_max_extreme_logits_and_blind_rows():
    q = fresh_randn(1, 2, 50, 32, dtype=torch.float16)
    k, v = (fresh_randn(1, 2, 40, 32, dtype=torch.float16) for _ in range(2))
    o, lse, _ = hp.launch_config("hopper", q, k, v, True, _pinned_cfg(False), sm_scale=1e4)
    assert torch.all(o[:, :, :10] == 0) and torch.all(torch.isinf(lse[:, :, :10]))
    assert torch.isfinite(o).all() and torch.isfinite(lse[:, :, 10:]).all()
    ref_o, ref_lse = attention(q, k, v, causal=True, sm_scale=1e4, return_lse=True)
    assert_close_2x(o, ref_o, attention_same_precision(q, k, v, causal=True, sm_scale=1e4),
                    name="O 1e4")
    torch.testing.assert_close(lse[:, :, 10:], ref_lse[:, :, 10:], atol=1e-2, rtol=1e-5)


def test_pinned_rows_timeline_and_mma_only_from_the_stored_runs():
    data = hp.load_pinned()
    assert data["environment"]["gpu"].startswith("NVIDIA H")
    rows = hp.pinned_rows(data)
    assert {r["idea"] for r in rows} == {i[0] for i in hp.PINNED_IDEAS}
    for r in rows:
        assert r["with / without"] == pytest.approx(r["with / FA2"] / r["without / FA2"])
    # why the D 64 and D 128 rows of HOPPER_TABLE pin the max: it won at every paired point
    for idea in ("pinned max, 128 x 64 (D 64)", "pinned max + l on MMA, 64 x 64 (D 128)"):
        gains = [r["with / without"] for r in rows if r["idea"] == idea]
        assert len(gains) == 6 and min(gains) > 1.0
    # the worst case: every program runs twice, a little less than half the speed
    spike = hp.pinned_rows(data, spike=True)
    assert spike and all(0.4 < r["with / without"] < 0.7 for r in spike)
    # the stamps: the SM's two programs take turns in the softmax far more than chance would
    tl_rows = hp.timeline_rows(data)
    assert tl_rows and all(r["both in softmax"] < r["if independent"] for r in tl_rows)
    # the MMAs alone are faster than the whole loop, and each part of the softmax costs
    for r in hp.mma_only_rows(data):
        assert r["MMAs only (P = S)"] > r["MMAs + exp2"] > r["full online softmax"]
        assert r["torch matmul"] > r["MMAs only (P = S)"]
