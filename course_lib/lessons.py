"""The lesson map: one entry per notebook, in teaching order (mirrors the README's table).

Used by notebooks/00_setup.ipynb to print the map and by the tests to keep the README,
the notebooks and the slide decks in step.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lesson:
    notebook: str
    teaches: str
    deck: str | None  # slides/<deck>.md, or None


LESSONS = (
    Lesson("00_setup", "the environment, CPU interpreter vs GPU, a first Triton kernel", None),
    Lesson("01_softmax", "naive → safe → online → blocked softmax, counted FLOPs and memory "
           "accesses, overflow and log-sum-exp, the (m, d) merge", "01_softmax"),
    Lesson("01b_softmax_numerics", "overflow and underflow, log-sum-exp and its gradient, fully "
           "masked rows", "01_softmax"),
    Lesson("02_gpu_memory", "SMs, warps, the memory hierarchy, real GPU specs, the roofline",
           "02_gpu_tiling"),
    Lesson("02b_triton_puzzles", "Triton puzzles: masked loads and stores, the program id, "
           "2-D blocks by broadcasting, strides and views, reductions, a row softmax, tl.dot, "
           "the launch", None),
    Lesson("03_tiled_matmul", "HBM accesses of naive vs tiled matmul (65536 → 4096), a Triton "
           "matmul", "02_gpu_tiling"),
    Lesson("04_attention_io", "standard attention's three kernels and their Θ(Nd + N²) HBM "
           "traffic", "03_attention_io"),
    Lesson("05_one_pass_attention", "from online softmax to 2-pass and 1-pass attention",
           "03_attention_io"),
    Lesson("06_flash_v1_algorithm", "FlashAttention v1: tiling, mask, dropout, Θ(N²d²/M) IO",
           "04_flash_v1"),
    Lesson("07_triton_flash_v1", "the v1 algorithm as a Triton kernel, and why it is slow",
           "05_triton_flash"),
    Lesson("08_triton_flash_v2", "v2: loop order, deferred rescale, exp2, causal skipping, "
           "measured speed and HBM bytes", "05_triton_flash"),
    Lesson("08a_flash_v2_measurements", "appendix: the measurements behind lesson 08 (grid "
           "order and L2, DRAM bytes in full, the speed sweep as a table, a live sweep), "
           "printed from the stored runs", None),
    Lesson("09_hopper", "FlashAttention-3 ideas in Triton: TMA descriptors, pipelining, "
           "warp-group MMA, FlashAttention-3's schedules, the pinned max", "05_triton_flash"),
    Lesson("09a_hopper_case_study", "appendix: the H100 experiments behind the Hopper kernel "
           "(compiler resources, Q in registers, tiles, clock stamps, ideas that did and did not "
           "pay), printed from the stored runs", None),
    Lesson("09b_fp8", "FP8's accuracy, emulated: e4m3 rounding, block scales, a random Hadamard "
           "rotation of Q and K", "05_triton_flash"),
    Lesson("10_backward", "the backward pass, recomputation, Theorem 5, memory saved",
           "06_backward"),
    Lesson("11_kv_cache_gqa", "KV-cache sizes, MQA/GQA, why decoding is memory-bound",
           "07_decoding"),
    Lesson("12_flash_decoding", "split-KV and the LSE merge, bandwidth against the copy ceiling",
           "07_decoding"),
    Lesson("12a_decode_tuning", "appendix: the measurements behind the decode kernel's choices "
           "(split count, tile order, merge, tiles per GPU), printed from the stored runs", None),
    Lesson("13_paged_attention", "block tables, copy-on-write, waste simulation, paged decode",
           "07_decoding"),
    Lesson("14_llama_capstone", "the course kernels inside Hugging Face LLaMA", "07_decoding"),
    Lesson("14a_capstone_measurements", "appendix: the capstone's measurements (the harness in "
           "turns, the eager and compiled runs in full), printed from the stored runs", None),
    Lesson("15_attention_variants", "the attention of open models: sliding windows, softcap, "
           "ALiBi, sinks, packed sequences; each a block map plus a score change",
           "08_variants"),
    Lesson("15a_variants_on_gpu", "appendix: the variants on a GPU: the TMA kernel and its pinned "
           "max in a band, the stored forward, backward and packed-sequence runs", None),
    Lesson("16_serving", "serving: continuous batching, chunked prefill, prefix caching, cascade "
           "attention, an 8-bit KV cache, token-tree verification", "09_serving"),
)


def print_map(available=None) -> None:
    """Print the lesson map; mark lessons whose notebook is not in ``available`` (a set)."""
    for lesson in LESSONS:
        mark = "" if available is None or lesson.notebook in available else "  (coming soon)"
        print(f"{lesson.notebook:<24} {lesson.teaches}{mark}")
