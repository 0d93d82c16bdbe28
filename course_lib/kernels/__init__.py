"""The course's Triton kernels. Import ``course_lib`` first (it is, via this package).

Each kernel is a private ``_..._kernel`` plus a public wrapper named after the operation that
validates its inputs, allocates, builds the grid with ``triton.cdiv`` and launches.
"""
import course_lib  # noqa: F401  (the device switch must run before any @triton.jit)
