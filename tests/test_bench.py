"""The benchmark commands: their pure-Python parts on any machine, a tiny sweep on a GPU."""
import json

import pytest
from matplotlib.figure import Figure

from course_lib.bench import attention as ab
from course_lib.bench import common, hbm
from course_lib.bench.__main__ import main as bench_main
from course_lib.bench.plots import FIGURES, plot_attention, plot_hbm


def test_the_sweep_is_the_flashattention2_papers():
    shapes = ab.shapes()
    assert len(shapes) == 2 * 2 * 6
    for s in shapes:
        assert s["B"] * s["N"] == 32 * 1024 and s["H"] * s["D"] == 2048
    assert {s["N"] for s in shapes} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {(s["D"], s["causal"]) for s in shapes} == {(64, False), (64, True), (128, False),
                                                        (128, True)}
    assert {s["N"] for s in ab.shapes(seq_lens=ab.QUICK_SEQ_LENS)} == {1024, 4096, 16384}


def test_flop_formula():
    s = {"B": 2, "H": 16, "N": 16384, "D": 128, "causal": False}
    assert ab.shape_flops(s, "fwd") == 4 * 2 * 16 * 16384 ** 2 * 128
    assert ab.shape_flops({**s, "causal": True}, "fwd") == ab.shape_flops(s, "fwd") / 2
    assert ab.shape_flops(s, "bwd") == 2.5 * ab.shape_flops(s, "fwd")
    assert ab.tflops(1e12, 1000.0) == 1.0 and ab.tflops(1e12, None) is None


def test_providers():
    fwd = ab.provider_names("fwd", ("portable", "hopper"))
    assert fwd == ["v1", "v2-portable", "v2-hopper", "sdpa-FLASH_ATTENTION",
                   "sdpa-CUDNN_ATTENTION", "sdpa-EFFICIENT_ATTENTION", "sdpa-MATH"]
    assert "v1" not in ab.provider_names("bwd", ("portable",))
    with pytest.raises(ValueError, match="unknown provider"):
        ab.provider_fn("sdpa-FAST", causal=False)


def test_math_only_where_it_fits():
    s = {"B": 2, "H": 16, "N": 16384, "D": 128, "causal": False}
    need = 2 * 16 * 16384 ** 2 * 6
    assert ab.math_fits(s, "fwd", free_bytes=3 * need)
    assert not ab.math_fits(s, "fwd", free_bytes=2 * need)
    assert not ab.math_fits(s, "bwd", free_bytes=3 * need)


def _fake_result(mode="fwd"):
    """A sweep with injected timings: v2 twice as fast as FA2, one provider failing."""
    providers = ab.provider_names(mode, ("portable", "hopper"))
    speed = {"v1": 0.1, "v2-portable": 0.9, "v2-hopper": 1.0, "sdpa-FLASH_ATTENTION": 0.5,
             "sdpa-CUDNN_ATTENTION": 0.8, "sdpa-EFFICIENT_ATTENTION": 0.3}

    def measure(name, shape):
        if name == "sdpa-MATH":
            raise MemoryError("out of memory\nmore lines")
        return {"ms": 1.0 / speed[name]}

    shapes = ab.shapes(seq_lens=(1024, 4096))
    rows = ab.run_sweep(shapes, providers, measure, mode=mode, progress=False)
    return ab.make_result(rows, providers, mode, "fp16")


def test_sweep_records_timings_and_failures():
    result = _fake_result()
    row = result["rows"][0]
    assert row["results"]["v2-hopper"]["tflops"] == pytest.approx(row["flops"] / 1e-3 / 1e12)
    assert row["results"]["sdpa-MATH"] == {"ms": None, "error": "MemoryError: out of memory",
                                           "tflops": None}
    assert ab.best_v2(row) == ("v2-hopper", row["results"]["v2-hopper"]["tflops"])
    summary = ab.summary_rows(result)
    assert all(r["v2/FA2"] == pytest.approx(2.0) and r["v1/v2"] == pytest.approx(0.1)
               for r in summary)


def test_report_ends_with_the_summary(capsys):
    result = _fake_result()
    text = ab.report(result)
    assert "4·B·H·N_q·N_k·D" in text and "sdpa-MATH: MemoryError" in text
    last = text.rsplit("\n\n", 1)[1]
    assert last.startswith("summary") and "v2/FA2" in last and "2.00" in last
    assert "2.5 ×" in ab.report(_fake_result("bwd"))


def test_write_json_and_png(tmp_path):
    result = _fake_result()
    path = ab.write(result, tmp_path)
    assert path == tmp_path / "attention_fwd.json" and path.with_suffix(".png").stat().st_size
    stored = json.loads(path.read_text())
    assert stored["environment"]["torch"] and stored["rows"] == json.loads(json.dumps(
        result["rows"]))
    fig = plot_attention(stored)
    assert isinstance(fig, Figure) and len(fig.axes) == 4


def test_cli_parsing():
    a = ab.parse_args(["--mode", "bwd", "--dtype", "bf16", "--heads-dims", "64", "--quick",
                       "--providers", "v2-portable,sdpa-MATH", "sdpa-FLASH_ATTENTION"])
    assert (a.mode, a.dtype, a.head_dims, a.quick) == ("bwd", "bf16", "64", True)
    assert [p for c in a.providers for p in ab._csv(c)] == ["v2-portable", "sdpa-MATH",
                                                             "sdpa-FLASH_ATTENTION"]


def test_commands_need_a_gpu(monkeypatch):
    import course_lib

    monkeypatch.setattr(course_lib, "DEVICE", "cpu")
    for subject in ("attention", "hbm"):
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench_main([subject, "--quick"] if subject == "attention" else [subject])



NCU_CSV = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "kernel_a" - 0: 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",\
"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","void gemm<a, b>(x)","1","7","(128, 1, 1)","(64, 1, 1)",\
"0","9.0","Command line profiler metrics","dram__bytes_read.sum","Gbyte","1.50"
"0","4242","python3.12","127.0.0.1","void gemm<a, b>(x)","1","7","(128, 1, 1)","(64, 1, 1)",\
"0","9.0","Command line profiler metrics","dram__bytes_write.sum","Mbyte","2,048.00"
"1","4242","python3.12","127.0.0.1","softmax","1","7","(128, 1, 1)","(64, 1, 1)",\
"0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,000,000"
"1","4242","python3.12","127.0.0.1","softmax","1","7","(128, 1, 1)","(64, 1, 1)",\
"0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","500"
==PROF== Disconnected from process 4242
"""


def test_parse_ncu_csv_sums_every_kernel():
    got = hbm.parse_ncu_csv(NCU_CSV)
    assert got["read"] == pytest.approx(1.5e9 + 1e6)
    assert got["write"] == pytest.approx(2.048e9 + 5e5)
    assert got["kernels"] == 2 and got["kernel_names"] == ["softmax", "void gemm<a, b>(x)"]
    with pytest.raises(ValueError, match="no metric table"):
        hbm.parse_ncu_csv("==PROF== ERR_NVGPUCTRPERM\n")


def test_ncu_command_and_lookup(tmp_path):
    cmd = hbm.ncu_command("/x/ncu", "v1")
    assert cmd[:5] == ["/x/ncu", "--clock-control", "none", "--profile-from-start", "off"]
    assert "dram__bytes_read.sum,dram__bytes_write.sum" in cmd and cmd[-2:] == ["--target", "v1"]
    assert hbm.find_ncu(str(tmp_path / "missing")) is None
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert hbm.find_ncu(str(fake)) == str(fake)


def test_ncu_not_found_is_a_clear_message(monkeypatch):
    monkeypatch.setattr(hbm, "require_gpu", lambda what: None)
    with pytest.raises(SystemExit, match="ncu was not found at /nowhere/ncu.*--ncu PATH"):
        hbm.main(["--ncu", "/nowhere/ncu"])


def test_hbm_predictions_and_table(tmp_path):
    pred = hbm.predictions(("portable",))
    t = pred["targets"]
    assert pred["minimum"] == pytest.approx(0.5411e9, rel=1e-3)  # Q, K, V, O fp16 + lse fp32
    assert t["v2-portable"][0] == pred["minimum"] == t["sdpa-FLASH_ATTENTION"][0]
    assert t["v1"][0] > 15 * pred["minimum"]  # O, l, m through HBM at every step
    assert t["sdpa-MATH"][0] > t["v1"][0] / 2
    measured = {"sdpa-MATH": {"read": 30e9, "write": 12e9, "kernels": 5, "kernel_names": ["a"]},
                "v1": {"error": "RuntimeError: boom"},
                "v2-portable": {"read": 0.4e9, "write": 0.15e9, "kernels": 1,
                                "kernel_names": ["b"]}}
    rows = hbm.make_rows(measured, t, pred["minimum"])
    assert rows[0]["total_gb"] == pytest.approx(42.0) and rows[1]["total_gb"] is None
    result = {"shape": hbm.FIGURE2, "minimum_gb": pred["minimum"] / 1e9, "rows": rows,
              "environment": {"gpu": "test"}, "iomodel_bytes": pred["model"]}
    text = hbm.report(result)
    assert "v1: RuntimeError: boom" in text and "v2-portable 1.017×" in text
    assert "flash_v2_min 0.541" in text
    assert isinstance(plot_hbm(result), Figure)


def test_figures_registry():
    assert {"bench_attention_fwd", "bench_attention_bwd", "bench_hbm"} <= set(FIGURES)
    for make in FIGURES.values():
        fig = make()
        assert fig is None or isinstance(fig, Figure)


# ----------------------------------------------------------------------------- on a GPU

def test_rounds_interleave_providers_and_keep_the_median():
    calls = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def measure(name, shape):
        calls.append(name)
        if name == "c":
            raise RuntimeError("refused")
        return {"ms": next(times[name]), "max_err": 0.5}

    out = common.sweep([{"N": 1}], ["a", "b", "c"], measure, lambda shape, rec: None, "t",
                       str, progress=False, rounds=3)
    assert calls == ["a", "b", "c", "a", "b", "a", "b"]  # a failing provider is not retried
    res = out[0][1]
    assert res["a"] == {"ms": 2.0, "ms_rounds": [3.0, 1.0, 2.0], "max_err": 0.5, "error": None}
    assert res["b"]["ms"] == 5.0 and res["c"]["ms"] is None and "refused" in res["c"]["error"]
    with pytest.raises(ValueError, match="rounds"):
        common.sweep([], ["a"], measure, lambda s, r: None, "t", str, progress=False, rounds=0)


def test_in_turns_calls_each_once_then_takes_turns(monkeypatch):
    """``common.in_turns``, the timing loop of the fp8, variants and backward_forms benches."""
    calls, timed = [], []

    def provider(name):
        def fn():
            calls.append(name)
            if name == "c":
                raise RuntimeError("out of shared memory\nmore")
        return fn

    def fake_median_ms(fn, rep_ms):
        fn()
        timed.append((calls[-1], rep_ms))
        return float(len(timed))

    monkeypatch.setattr(common, "median_ms", fake_median_ms)
    times, errors = common.in_turns({n: provider(n) for n in "abc"}, rounds=2, rep_ms=200)
    assert calls[:3] == ["a", "b", "c"]  # each once first; c fails and is left out
    assert [n for n, _ in timed] == ["a", "b", "a", "b"] and {r for _, r in timed} == {200}
    assert times == {"a": [1.0, 3.0], "b": [2.0, 4.0], "c": []}
    assert errors == {"c": "RuntimeError: out of shared memory"}


TINY = ["--seq-lens", "256,512", "--tokens", "2048", "--heads-dims", "64", "--warmup-ms", "5",
        "--rep-ms", "20"]


@pytest.mark.gpu
def test_gpu_tiny_forward_sweep(tmp_path, capsys):
    assert ab.main([*TINY, "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "attention_fwd.json").read_text())
    assert result["rounds"] == 2
    assert (tmp_path / "attention_fwd.png").exists()
    for row in result["rows"]:
        for name in ("v1", "sdpa-FLASH_ATTENTION", *[p for p in result["providers"]
                                                      if p.startswith("v2-")]):
            rec = row["results"][name]
            assert rec["error"] is None and rec["tflops"] > 0, (name, rec)
    assert "v2/FA2" in capsys.readouterr().out.rsplit("summary", 1)[1]


@pytest.mark.gpu
def test_gpu_tiny_backward_sweep(tmp_path):
    assert ab.main([*TINY, "--mode", "bwd", "--causal", "yes", "--out", str(tmp_path),
                    "--no-plot"]) == 0
    result = json.loads((tmp_path / "attention_bwd.json").read_text())
    assert "v1" not in result["providers"]
    assert all(r["results"]["sdpa-FLASH_ATTENTION"]["tflops"] for r in result["rows"])


@pytest.mark.gpu
def test_gpu_hbm_of_v1_is_measured(tmp_path):
    if hbm.find_ncu() is None:
        pytest.skip("Nsight Compute (ncu) is not installed")
    assert hbm.main(["--targets", "v1", "--out", str(tmp_path), "--no-plot"]) == 0
    (row,) = json.loads((tmp_path / "hbm.json").read_text())["rows"]
    assert row["error"] is None and row["total_gb"] > 0


def test_registers_reads_cuobjdump_and_covers_the_candidates():
    from course_lib.bench import common, registers

    text = ("Resource usage:\n Function _bwd_dkdv_kernel:\n  REG:255 STACK:48 SHARED:1024 "
            "LOCAL:0 CONSTANT[0]:608 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert registers.parse_usage(text) == {"registers": 255, "stack_bytes": 48,
                                           "shared_bytes": 1024}
    with pytest.raises(ValueError, match="no resource usage"):
        registers.parse_usage("nothing here")
    stored = common.load_result("backward_registers")
    tiles = {(r["D"], r["BLOCK_M"], r["BLOCK_N"], r["warps"], r["stages"]) for r in stored["rows"]}
    for d in registers.HEAD_DIMS:  # the stored run compiled every tile the autotuner may pick
        assert {(d, m, n, w, s) for m, n, _, w, s in registers._tiles(d)} <= tiles
    # 96.5 KiB twice fits an SM's 228 KiB, 128.5 KiB once; 255 registers x 128 threads twice
    assert registers.programs_per_sm({"shared_bytes": 98816, "registers": 255, "warps": 4}) == 2
    assert registers.programs_per_sm({"shared_bytes": 131584, "registers": 255, "warps": 4}) == 1
    assert registers.programs_per_sm({"shared_bytes": 40000, "registers": 255, "warps": 8}) == 1
