"""Analysis: the lessons' helpers that study the kernels without being kernels.

Shared-memory budgets, launch orders, block maps, readers of the stored GPU measurements in
course_lib/data/, probes of the compiled code: what notebooks 08 and 09 compute about the
FlashAttention-2 kernels (``flash_v2``) and their Hopper version (``hopper``), and the decode
step's stored run read as bandwidth against the copy (``decode``, notebooks 11 and 12). The
kernels themselves are in ``course_lib.kernels``; the public functions in ``course_lib.ops``.
"""
