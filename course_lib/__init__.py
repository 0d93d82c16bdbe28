"""course_lib: the shared code of "FlashAttention from First Principles".

The device switch is imported first: it decides, before any Triton kernel is defined,
whether kernels run compiled on a GPU or in Triton's interpreter on the CPU.

>>> import course_lib
>>> course_lib.DEVICE in ("cuda", "cpu")
True
"""
from course_lib._device import DEVICE, INTERPRET, describe, gpu_name, versions  # noqa: I001

__all__ = ["DEVICE", "INTERPRET", "describe", "gpu_name", "versions"]
__version__ = "0.1.0"
