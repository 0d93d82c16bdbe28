"""How the course registers its ``torch.library`` operators (``torch.ops.course.*``).

An operator is a typed Python function; its schema is read from its type hints, as
``torch.library.custom_op`` reads it. Registered through ``torch.library.Library`` rather than
``custom_op``: the same schema, fake implementation and autograd, but a call skips
``custom_op``'s per-call guard and aliasing check of the outputs, which a compiled prefill would
pay at every layer. The implementations return fresh tensors, as that check demands;
tests/test_ops.py runs ``torch.library.opcheck`` on every operator.
"""
from __future__ import annotations

import torch

_LIB = torch.library.Library("course", "FRAGMENT")


def operator(fake, *, setup_context=None, backward=None):
    """Register the decorated function ``_name`` as the operator ``course::name``, with the
    fake implementation ``fake`` (shapes and dtypes only, for torch.compile) and, when given,
    the autograd formula ``backward`` with its ``setup_context``. Returns the operator."""
    def register(fn):
        name = fn.__name__.lstrip("_")
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"course::{name}", fake, lib=_LIB)
        if backward is not None:
            torch.library.register_autograd(f"course::{name}", backward,
                                            setup_context=setup_context, lib=_LIB)
        return getattr(torch.ops.course, name)
    return register
