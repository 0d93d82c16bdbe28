"""The GPU table, live-device matching and the roofline."""
import dataclasses
from types import SimpleNamespace

import matplotlib
import pytest

from course_lib import hardware, roofline
from course_lib.hardware import GPUS, GPUSpec, current_gpu, from_properties, get_gpu, match_name

matplotlib.use("Agg")

REQUIRED = ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "RTX-4090", "L4")


def test_table_has_the_required_gpus_with_sources():
    for key in REQUIRED:
        g = GPUS[key]
        assert isinstance(g, GPUSpec)
        assert g.sms > 0 and g.smem_per_sm_kib > 0 and g.l2_mib > 0 and g.hbm_gib > 0
        assert g.hbm_tbs > 0 and g.fp16_tensor_tflops > g.fp32_tflops > 0
        assert "http" in g.source, f"{key} needs a datasheet or whitepaper URL"
        assert g.smem_per_block_kib <= g.smem_per_sm_kib


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPUS["H100-SXM"].sms = 1


def test_known_figures():
    # the numbers the lessons quote (A100: FlashAttention paper §2.1; H100: datasheet)
    a100 = GPUS["A100-80GB"]
    assert (a100.sms, a100.fp16_tensor_tflops, a100.fp32_tflops) == (108, 312, 19.5)
    assert a100.l2_mib == 40 and 1.5 <= a100.hbm_tbs <= 2.1
    h100 = GPUS["H100-SXM"]
    assert (h100.sms, h100.smem_per_sm_kib, h100.hbm_tbs) == (132, 228, 3.35)
    assert GPUS["H200"].fp16_tensor_tflops == h100.fp16_tensor_tflops
    assert GPUS["H200"].hbm_tbs > h100.hbm_tbs
    assert h100.ridge_point() == pytest.approx(989.4 / 3.35)
    assert h100.ridge_point("fp32") == pytest.approx(67 / 3.35)


@pytest.mark.parametrize("driver_name, key", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", None),
    ("Tesla T4", None),
])
def test_match_driver_names(driver_name, key):
    assert match_name(driver_name) == key


def test_get_gpu():
    assert get_gpu("h100-sxm") is GPUS["H100-SXM"]
    assert get_gpu("NVIDIA H200") is GPUS["H200"]
    assert get_gpu(GPUS["L4"]) is GPUS["L4"]
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("Voodoo 2")
    with pytest.raises(TypeError):
        get_gpu(3)


def _props(name, sms=132, mem=80 * 2**30, l2=50 * 2**20, smem=228 * 1024, major=9, minor=0):
    return SimpleNamespace(name=name, multi_processor_count=sms, total_memory=mem,
                           L2_cache_size=l2, shared_memory_per_multiprocessor=smem,
                           shared_memory_per_block_optin=smem - 1024, major=major, minor=minor)


def test_from_properties_known_and_unknown():
    g = from_properties(_props("NVIDIA H100 80GB HBM3", l2=50 * 2**20))
    assert g.fp16_tensor_tflops == GPUS["H100-SXM"].fp16_tensor_tflops
    assert g.l2_mib == 50 and g.sms == 132 and g.compute_capability == "9.0"
    assert "live" in g.source
    u = from_properties(_props("NVIDIA Mystery", sms=10, smem=100 * 1024, major=8, minor=9))
    assert u.fp16_tensor_tflops is None and u.ridge_point() is None
    assert u.sms == 10 and u.smem_per_sm_kib == 100


def test_current_gpu_matches_torch():
    import torch

    g = current_gpu()
    if not torch.cuda.is_available():
        assert g is None
    else:
        assert g.sms == torch.cuda.get_device_properties(0).multi_processor_count


def test_table_text():
    text = hardware.table()
    for key in REQUIRED:
        assert key in text


def test_roofline_math():
    h = GPUS["H100-SXM"]
    assert roofline.attainable_tflops(h, 1.0) == pytest.approx(3.35)
    assert roofline.attainable_tflops(h, 1e4) == pytest.approx(989.4)
    rows = roofline.classify(h, [("small", 1e6, 1e6), ("big", 1e12, 1e8)])
    assert [r["bound"] for r in rows] == ["memory", "compute"]
    assert rows[0]["time_floor_us"] == pytest.approx(1e6 / 3.35e12 * 1e6)
    with pytest.raises(ValueError, match="bytes must be positive"):
        roofline.intensity(1.0, 0)
    with pytest.raises(ValueError, match="dtype"):
        h.peak_tflops("int8")


def test_roofline_draws(tmp_path):
    import matplotlib.pyplot as plt

    ax = roofline.roofline("A100-80GB", [("softmax", 5e6, 4e6), ("matmul", 1.4e11, 1e8)])
    assert len(ax.get_legend().get_texts()) == 2
    ax.figure.savefig(tmp_path / "r.png")
    plt.close(ax.figure)
    fig = roofline.FIGURES["roofline"]()
    fig.savefig(tmp_path / "r2.png")
    plt.close(fig)
