"""Shared pytest set-up: the ``gpu`` marker skips visibly in interpreter mode; one inductor
cache per CPU capability; fixtures several test files use."""
import getpass
import os
import tempfile

import pytest
import torch

import course_lib

# TorchInductor's on-disk cache of compiled C++ is not keyed by the CPU capability ATen runs
# with: a cache written by a plain run and read back under ATEN_CPU_CAPABILITY=default failed
# to compile here (torch 2.13: "'at::vec' has not been declared"). One cache per capability;
# an explicit TORCHINDUCTOR_CACHE_DIR is kept. Set before any compile, and inherited by the
# notebooks' kernels and the JupyterLab server the tests start.
try:
    _USER = getpass.getuser()
except (KeyError, OSError):  # a container's user without a passwd entry
    _USER = "user"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(),
    f"torchinductor_{_USER}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))


def pytest_collection_modifyitems(config, items):
    if course_lib.DEVICE == "cuda":
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: course_lib.DEVICE is 'cpu' (Triton interpreter mode)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return course_lib.DEVICE


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every floating-point tensor ``torch.empty`` and ``torch.empty_like`` allocate while the
    test runs starts as NaN: a kernel's output (dq, dk, dv, delta, lse₂, O, ...) that it forgets
    to write fails the test."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
