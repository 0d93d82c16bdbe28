"""The course's Triton kernels. Import ``course_lib`` first (it is, via this package).

Each file holds private ``_..._kernel`` functions and their launchers (strides, grid, launch);
the checked public calls are ``course_lib.ops``.
"""
import course_lib  # noqa: F401  (the device switch must run before any @triton.jit)
