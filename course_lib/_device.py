"""The one place that decides where every Triton kernel of the course runs.

Introduced in notebooks/00_setup.ipynb.

Rule (decided once, at import, before any ``@triton.jit`` decoration runs):

* CUDA present            -> real Triton on the GPU (``DEVICE = "cuda"``).
* no CUDA                 -> Triton's interpreter on CPU tensors (``DEVICE = "cpu"``).
* ``COURSE_DEVICE=cpu``   -> the interpreter even on a GPU machine (for debugging).
* ``COURSE_DEVICE=cuda``  -> insist on the GPU; a clear error if there is none.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so this module must be
imported before any kernel module. ``course_lib/__init__.py`` imports it first. Nothing else
in the code base reads or sets ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import os

import torch

_VAR = "TRITON_INTERPRET"


def _decide() -> tuple[str, bool]:
    wanted = os.environ.get("COURSE_DEVICE", "").strip().lower()
    if wanted not in ("", "auto", "cpu", "cuda"):
        raise ValueError(f"COURSE_DEVICE must be 'cpu', 'cuda' or unset, got {wanted!r}")
    has_cuda = torch.cuda.is_available()
    if wanted == "cuda" and not has_cuda:
        raise RuntimeError("COURSE_DEVICE=cuda but torch sees no CUDA device")
    if wanted == "cpu" or not has_cuda:
        return "cpu", True
    return "cuda", False


DEVICE, INTERPRET = _decide()
if INTERPRET:
    os.environ[_VAR] = "1"
else:
    # A stray TRITON_INTERPRET=1 in the shell would silently run GPU tensors through the
    # interpreter at a thousandth of the speed: the switch owns this variable.
    os.environ.pop(_VAR, None)

import triton  # noqa: E402  (imported only after the variable is settled)

try:  # triton >= 3.4 keeps its settings in ``triton.knobs``; refresh it if it cached the value
    from triton import knobs as _knobs

    _knobs.runtime.interpret = INTERPRET
except (ImportError, AttributeError):  # pragma: no cover - older triton reads the env var
    pass


def gpu_name() -> str | None:
    """The name of the GPU in use, or None in interpreter mode."""
    return torch.cuda.get_device_name() if DEVICE == "cuda" else None


def versions() -> dict[str, str]:
    import numpy

    return {"torch": torch.__version__, "triton": triton.__version__, "numpy": numpy.__version__}


def describe(file=None) -> dict:
    """Print (and return) where the course's kernels run and with which versions."""
    info = {
        "device": DEVICE,
        "mode": "Triton interpreter on CPU tensors" if INTERPRET else "compiled Triton on the GPU",
        "gpu": gpu_name() or "none",
        **versions(),
    }
    if DEVICE == "cuda":
        major, minor = torch.cuda.get_device_capability()
        info["compute capability"] = f"sm_{major}{minor}"
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}} : {value}", file=file)
    return info


def refuse_bf16_in_interpreter(*tensors: torch.Tensor, names: tuple[str, ...] = ()) -> None:
    """Raise TypeError if a bf16 tensor would reach ``tl.dot`` in the interpreter.

    The interpreter's ``tl.dot`` on bfloat16 returns wrong numbers (numpy has no bf16),
    so CPU runs use float32 or float16 instead of returning garbage.
    """
    if not INTERPRET:
        return
    for i, t in enumerate(tensors):
        if t.dtype == torch.bfloat16:
            name = names[i] if i < len(names) else f"argument {i}"
            raise TypeError(
                f"{name} is bfloat16, which the Triton interpreter computes wrongly; "
                "on the CPU use float32 or float16 (bf16 works on a GPU)"
            )
