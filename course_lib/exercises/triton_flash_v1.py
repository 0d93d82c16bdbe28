"""Exercise of notebooks/07_triton_flash_v1.ipynb: the bytes v1's carried state costs.

The spec is the IO model's count of ``course_lib.kernels.flash_v1`` (``flash_v1_io(...,
kernel_bookkeeping=True)``): the fp32 O_acc, l and m that go back to HBM after every step but a
row block's last, and come back before every step but its first.
"""
from __future__ import annotations

import math

from course_lib.exercises import Result, check
from course_lib.iomodel.attention import flash_v1_io

HINT = ("count the steps that hand the state on: each of the N rows meets T_c = ⌈N/BLOCK_N⌉ "
        "K/V blocks, and only the first step reads nothing and only the last writes the output "
        "instead; each hand-over writes and later reads D + 2 fp32 numbers per row "
        "(O_acc, l, m), 4 bytes each")


def v1_state_bytes_solution(N: int, D: int, block_n: int) -> int:
    """Bytes of O_acc, l, m moved per (batch, head) by flash_attn_v1, non-causal, N_q = N_k = N."""
    return 2 * (math.ceil(N / block_n) - 1) * N * (D + 2) * 4


def _spec(N: int, D: int, block_n: int) -> int:
    io = flash_v1_io(N, N, D, 64, block_n, kernel_bookkeeping=True)
    state = ("O_acc", "l", "m")
    return 4 * sum(io[kind].get(name, 0) for kind in ("reads", "writes") for name in state)


def check_v1_state_bytes(student) -> Result:
    cases = [(64, 64, 64), (128, 64, 64), (1024, 64, 64), (1000, 128, 64), (97, 32, 16),
             (16384, 128, 32)]
    return check("v1_state_bytes", student, _spec, cases, hint=HINT, rtol=0, atol=0)
