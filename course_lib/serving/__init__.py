"""Serving: many requests over one paged KV cache.

Introduced in notebooks/16_serving.ipynb. A small engine that drives the course's kernels with
a transformers model as its weights, and the verification step of speculative decoding:

* ``scheduler``: iteration-level scheduling (continuous batching), chunked prefill, preemption
  by recomputation and prefix blocks shared by hash, over lesson 13's block allocator. Pure
  Python: ``Scheduler``, ``Request``, ``Batch``.
* ``engine``: each scheduled step as one forward of a transformers model whose attention
  writes the layer's pages and reads them with one ``flash_attn_varlen(..., block_table=)``
  call (``Engine``; it needs transformers, so it is imported on first use).
* ``speculative``: a draft token tree, its mask, one verifying forward of the target, and the
  acceptance rule that keeps the target's distribution (``TokenTree``, ``accept_tree``).

Cascade attention, for prefixes many requests share, is ``course_lib.ops.cascade_decode``.
"""
from course_lib.serving.scheduler import (
    FINISHED,
    RUNNING,
    WAITING,
    Batch,
    Chunk,
    PrefixCache,
    Request,
    Scheduler,
    StepRecord,
    block_hash,
)
from course_lib.serving.speculative import (
    Acceptance,
    TokenTree,
    accept_greedy,
    accept_tree,
    draft_tree,
    tree_attention_mask,
    tree_decode,
    tree_mask,
    tree_positions,
    verify_tree,
)

_ENGINE = ("ATTN_IMPLEMENTATION", "Engine", "PagedStep", "paged_attention_forward")


def __getattr__(name):
    """``Engine`` and its kin from ``course_lib.serving.engine``, imported on first use: that
    module needs transformers, and importing it registers its attention function there."""
    if name in _ENGINE:
        from course_lib.serving import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'course_lib.serving' has no attribute {name!r}")


__all__ = ["FINISHED", "RUNNING", "WAITING", "Acceptance", "Batch", "Chunk", "PrefixCache",
           "Request", "Scheduler", "StepRecord", "TokenTree", "accept_greedy", "accept_tree",
           "block_hash", "draft_tree", "tree_attention_mask", "tree_decode", "tree_mask",
           "tree_positions",
           "verify_tree", *_ENGINE]
