"""The course's kernels inside Hugging Face transformers (lessons 14 and 15).

Introduced in notebooks/14_llama_capstone.ipynb; the variants of other open models (padding,
sliding windows, softcap, sinks) are lesson 15's (notebooks/15_attention_variants.ipynb).
Importing ``course_lib.hf`` registers the attention implementation ``"course_kernels"``.

Two rooms, both re-exported here:

* ``course_lib.hf.attention``: the attention function and the mask that transformers calls by
  name, and which of the course's kernels serves each call (``CALLS``, ``VARIANTS``);
* ``course_lib.hf.capstone``: lesson 14's models (random weights, built from configs), greedy
  decoding, the GPU timing against SDPA, and the stored runs (``python -m course_lib.hf
  [--compiled]``).

transformers is an optional extra of the course (``pip install -e ".[hf]"``).
"""
from course_lib.hf.attention import (
    ATTN_IMPLEMENTATION,
    CALLS,
    DECODE_MAX_QUERIES,
    NO_WINDOW,
    VARIANTS,
    course_attention_forward,
    course_attention_mask,
    mask_pattern,
    register,
)
from course_lib.hf.capstone import (
    CONFIG_KEYS,
    SMALL_WINDOW,
    benchmark,
    compiled_result,
    config_record,
    count_graph_recordings,
    count_parameters,
    decode_step_rows,
    greedy,
    llama_1b_config,
    llama_result,
    main,
    make_llama,
    n_parameters,
    paired,
    small_config,
    small_llama_config,
    static_compile_config,
    time_compiled_decodes_in_turns,
    time_decode,
    time_decodes_in_turns,
    time_prefills_in_turns,
)

__all__ = [
    "ATTN_IMPLEMENTATION", "CALLS", "CONFIG_KEYS", "DECODE_MAX_QUERIES", "NO_WINDOW",
    "SMALL_WINDOW", "VARIANTS", "benchmark", "compiled_result", "config_record",
    "count_graph_recordings", "count_parameters", "course_attention_forward",
    "course_attention_mask", "decode_step_rows", "greedy", "llama_1b_config", "llama_result",
    "main", "make_llama", "mask_pattern", "n_parameters", "paired", "register", "small_config",
    "small_llama_config", "static_compile_config", "time_compiled_decodes_in_turns",
    "time_decode", "time_decodes_in_turns", "time_prefills_in_turns",
]
