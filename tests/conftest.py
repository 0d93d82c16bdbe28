"""Shared pytest set-up: the ``gpu`` marker skips visibly in interpreter mode; fixtures several
test files use."""
import pytest
import torch

import course_lib


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
