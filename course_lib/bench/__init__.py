"""Benchmarks of the course, one module per subject, run as ``python -m course_lib.bench NAME``.

Introduced in notebooks/08_triton_flash_v2.ipynb. Every run times the course's kernels and
PyTorch's in the same process, so speed is always a ratio measured in one run. Results are
written as JSON (with the GPU name and the torch/triton versions) to ``course_lib/data/`` where
the notebooks and ``course_lib.figures`` read them back.
"""
