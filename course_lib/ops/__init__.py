"""The course's attention and matmul kernels as functions to call: the public API, in one place.

    from course_lib.ops import flash_attn_v2, flash_decode

* ``flash_attn_v1``: FlashAttention v1 (lesson 07);
* ``flash_attn_v2(q, k, v, causal=False, sm_scale=None, return_lse=False, impl=None, *,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None)``: FlashAttention-2, forward
  and backward (lessons 08–10), the Hopper kernel on sm_90; the variants of open models (15);
* ``flash_attn_varlen``: packed sequences of different lengths, FlashAttention's varlen layout,
  the same variants (15); with ``block_table=``, against a paged cache (a serving step, 16);
* ``flash_decode`` and ``paged_decode``: Flash-Decoding, contiguous and paged (12, 13), the same
  variants (15; causal, and a window reads only its band);
* ``plan_decode(...)`` then ``plan.run(...)`` each step: decode with no host work but two
  launches, capturable in a CUDA graph (12), the variants fixed by the plan;
* ``cascade_decode`` and ``merge_state``: a prefix shared by many requests attended once, each
  request's suffix by ``paged_decode``, and the log-sum-exp merge of the two (16);
* ``flash_attn_fp8``: the forward with Q, K, V and P in e4m3, block scales and a random
  rotation (09b);
* ``matmul(a, b)``, ``vector_add(x, y)``: the tiled matmul (03) and the first kernel (00).

Shapes are (batch, heads, sequence, head dim); ``causal`` is bottom-right aligned; GQA by
H_kv dividing H; head dims are multiples of 8 from 16 to 256. Every function checks its inputs
(a ``ValueError``/``TypeError`` names the argument) and runs compiled on an NVIDIA GPU or in
Triton's interpreter on a CPU. ``flash_attn_v2``, ``flash_attn_varlen``, ``flash_decode`` and
``paged_decode`` are also ``torch.library`` operators (``torch.ops.course.*``), so
``torch.compile(fullgraph=True)`` keeps them in its graph.
"""
from course_lib.kernels.flash_v1 import flash_attn_v1
from course_lib.kernels.matmul import matmul
from course_lib.kernels.vector_add import vector_add
from course_lib.ops.attention import IMPLS, best_impl, flash_attn_v2, flash_attn_varlen
from course_lib.ops.cascade import cascade_decode, merge_state
from course_lib.ops.decode import DecodePlan, flash_decode, paged_decode, plan_decode
from course_lib.ops.fp8 import flash_attn_fp8
from course_lib.reference import decode_reference

__all__ = ["DecodePlan", "IMPLS", "best_impl", "cascade_decode", "decode_reference",
           "flash_attn_fp8", "flash_attn_v1", "flash_attn_v2", "flash_attn_varlen", "flash_decode",
           "matmul", "merge_state", "paged_decode", "plan_decode", "vector_add"]
