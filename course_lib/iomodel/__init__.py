"""IO models: how many elements and bytes an algorithm moves between HBM and the chip.

FlashAttention's speed-up is an argument about memory traffic, not arithmetic (Dao et al.
2022, §3.2), so the course counts traffic the way the paper does, twice for every algorithm:
a simulator that runs the loop nest and counts each access, and a closed-form formula that the
tests check against it.

* ``course_lib.iomodel.matmul``: C = A·B, naive and tiled; global (HBM) and shared-memory
  traffic (notebooks/03_tiled_matmul.ipynb; the roofline of notebooks/02_gpu_memory.ipynb).
* ``course_lib.iomodel.attention``: standard attention and FlashAttention v1/v2
  (notebooks/04_attention_io.ipynb and 06_flash_v1_algorithm.ipynb).

Both modules' public names are available here: ``from course_lib.iomodel import ...``.
"""
from course_lib.iomodel.matmul import *  # noqa: F401,F403

try:  # written alongside this package; absent in a partial checkout
    from course_lib.iomodel.attention import *  # noqa: F401,F403
except ImportError:  # pragma: no cover
    pass
