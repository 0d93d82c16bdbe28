"""Shared pytest set-up: the ``gpu`` marker skips visibly in interpreter mode."""
import pytest

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
