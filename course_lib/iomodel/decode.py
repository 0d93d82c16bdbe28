"""The KV cache and decode attention in numbers: bytes per token, arithmetic intensity, parallelism.

Introduced in notebooks/11_kv_cache_gqa.ipynb; used again by notebooks/12_flash_decoding.ipynb
(the bandwidth floor every decode kernel is measured against).

* **KV cache size.** Every layer keeps a key and a value vector of ``H_kv · D`` numbers for every
  token: ``kv_bytes_per_token = 2 · n_layers · H_kv · D · bytes_per_el``. Multi-query attention
  (MQA, Shazeer 2019) has ``H_kv = 1``; grouped-query attention (GQA, Ainslie et al. 2023)
  lets a group of ``G = H / H_kv`` query heads share one K/V head; MHA has ``H_kv = H``.
* **Decode is memory-bound.** Attending ``N_q`` new query tokens to ``L`` cached ones costs
  ``4 · H · N_q · L · D`` FLOPs (QKᵀ and PV) and must read ``2 · H_kv · L · D`` cached numbers:
  the arithmetic intensity is ``(H / H_kv) · N_q · 2 / bytes_per_el`` FLOP/byte — 1 for MHA in
  fp16 at N_q = 1, 4 for a GQA group of 4 — against a ridge point near 300 FLOP/byte on an H100.
  The kernel's time floor is the KV bytes over the memory bandwidth.
* **Parallelism.** A forward kernel built for training, with one program per (batch, head,
  ``BLOCK_M`` query rows) like the course's ``flash_attn_v2`` (lesson 08), launches
  ``B · H · ⌈N_q / BLOCK_M⌉`` programs; at N_q = 1 that is B·H, e.g. 32 for one sequence of a
  32-head model, against 132 SMs on an H100, and each program walks all L keys alone.
  Flash-Decoding launches ``B · H_kv · num_splits`` programs instead
  (``course_lib.kernels.decode``); the FlashAttention library has such a split-KV path for
  decoding too (``flash_attn_with_kvcache``, ``num_splits``; Dao et al., "Flash-Decoding for
  long-context inference", 2023). ``course_lib.diagrams.decode_parallelism`` draws both counts,
  with the split count the kernel's own rule chooses.

Model shapes are the published ``config.json`` values (layers, attention heads, key/value heads,
head dim) of the named checkpoints on the Hugging Face hub and in their papers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from matplotlib.figure import Figure

__all__ = [
    "ModelShape", "MODELS", "kv_bytes_per_token", "kv_cache_bytes", "decode_attention_io",
    "fa_forward_programs", "split_kv_programs", "sm_fraction", "max_cached_tokens",
    "VLLM_OPT13B_BYTES", "FIGURES",
]


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a decoder-only transformer (what the KV cache depends on)."""

    name: str
    n_params_b: float  # billions of parameters (weights: n_params_b · 1e9 · bytes_per_el)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    source: str

    @property
    def group(self) -> int:
        """Query heads per K/V head: 1 for MHA, n_heads for MQA."""
        return self.n_heads // self.n_kv_heads

    @property
    def kind(self) -> str:
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else f"GQA-{self.group}"


_HF = "config.json of {} on the Hugging Face hub"
MODELS: dict[str, ModelShape] = {
    "Llama-2-7B": ModelShape("Llama-2-7B", 6.74, 32, 32, 32, 128,
                             _HF.format("meta-llama/Llama-2-7b-hf") + "; Touvron et al. 2023"),
    "Llama-2-13B": ModelShape("Llama-2-13B", 13.0, 40, 40, 40, 128,
                              _HF.format("meta-llama/Llama-2-13b-hf") + "; Touvron et al. 2023"),
    "Llama-2-70B": ModelShape("Llama-2-70B", 69.0, 80, 64, 8, 128,
                              _HF.format("meta-llama/Llama-2-70b-hf")
                              + "; GQA with 8 K/V heads, Touvron et al. 2023 §2.2"),
    "Llama-3-8B": ModelShape("Llama-3-8B", 8.03, 32, 32, 8, 128,
                             _HF.format("meta-llama/Meta-Llama-3-8B")),
    "Qwen2.5-14B": ModelShape("Qwen2.5-14B", 14.7, 48, 40, 8, 128,
                              _HF.format("Qwen/Qwen2.5-14B")),
    "Llama-3-70B": ModelShape("Llama-3-70B", 70.6, 80, 64, 8, 128,
                              _HF.format("meta-llama/Meta-Llama-3-70B")),
}
"""Published shapes. Llama-2-13B has the attention shape of OPT-13B (40 layers, hidden size 5120
= 40 heads × 128), the model whose KV cache per token the vLLM paper counts
(``VLLM_OPT13B_BYTES``); Qwen2.5-14B is a 14B model with GQA."""

#: The vLLM paper's count of KV cache per token for OPT-13B: 2 (key and value vectors) × 5120
#: (hidden size) × 40 (layers) × 2 (bytes per fp16) = 800 KB (Kwon et al., "Efficient Memory
#: Management for Large Language Model Serving with PagedAttention", SOSP 2023, §3,
#: https://arxiv.org/abs/2309.06180).
VLLM_OPT13B_BYTES = 2 * 5120 * 40 * 2


def kv_bytes_per_token(model: ModelShape, bytes_per_el: float = 2, n_kv_heads: int | None = None
                       ) -> float:
    """Bytes of K and V cached per token, all layers: 2 · n_layers · H_kv · D · bytes_per_el.

    ``n_kv_heads`` overrides the model's (e.g. ``model.n_heads`` for "the same model without GQA").

    >>> kv_bytes_per_token(MODELS["Llama-2-13B"]) / 2**20    # MiB per token, fp16
    0.78125
    >>> kv_bytes_per_token(MODELS["Llama-2-70B"]) / 2**20
    0.3125
    """
    h_kv = model.n_kv_heads if n_kv_heads is None else n_kv_heads
    return 2 * model.n_layers * h_kv * model.head_dim * bytes_per_el


def kv_cache_bytes(model: ModelShape, tokens: int, batch: int = 1, bytes_per_el: float = 2
                   ) -> float:
    """The whole cache: batch sequences of ``tokens`` tokens each."""
    return batch * tokens * kv_bytes_per_token(model, bytes_per_el)


def max_cached_tokens(model: ModelShape, hbm_gib: float, bytes_per_el: float = 2,
                      reserve_gib: float = 0.0) -> int:
    """How many tokens' KV fit in the memory left once the weights (and ``reserve_gib``) are in.

    Returns 0 when the weights alone do not fit.
    """
    weights = model.n_params_b * 1e9 * bytes_per_el
    free = hbm_gib * 2**30 - weights - reserve_gib * 2**30
    return max(0, int(free // kv_bytes_per_token(model, bytes_per_el)))


def decode_attention_io(B: int, H: int, H_kv: int, N_q: int, L: int, D: int,
                        bytes_per_el: float = 2) -> dict:
    """FLOPs, HBM bytes and arithmetic intensity of one decode attention call (one layer).

    Bytes: K and V read once (2·B·H_kv·L·D), q read and o written once (2·B·H·N_q·D). FLOPs:
    4·B·H·N_q·L·D (the course's count for QKᵀ and PV; causal masking among the N_q ≪ L
    queries is ignored).

    >>> io = decode_attention_io(1, 32, 32, 1, 4096, 128)    # MHA
    >>> round(io["intensity"], 3)   # 1 FLOP per byte: q and o add 0.02% to the bytes
    1.0
    >>> round(decode_attention_io(1, 32, 8, 1, 4096, 128)["intensity"], 2)  # GQA, group of 4
    4.0
    """
    kv_bytes = 2 * B * H_kv * L * D * bytes_per_el
    qo_bytes = 2 * B * H * N_q * D * bytes_per_el
    flops = 4.0 * B * H * N_q * L * D
    total = kv_bytes + qo_bytes
    return {"flops": flops, "kv_bytes": kv_bytes, "qo_bytes": qo_bytes, "bytes": total,
            "intensity": flops / total}


def fa_forward_programs(B: int, H: int, N_q: int, block_m: int = 128) -> int:
    """Programs of a forward kernel with one program per (batch, head, BLOCK_M query rows): the
    course's ``flash_attn_v2`` (FlashAttention-2's training-time grid, without the split-KV path
    the FlashAttention library uses for decoding)."""
    return B * H * math.ceil(N_q / block_m)


def split_kv_programs(B: int, H_kv: int, num_splits: int) -> int:
    """Programs Flash-Decoding's split kernel launches: one per (batch, K/V head, split)."""
    return B * H_kv * num_splits


def sm_fraction(programs: int, sms: int) -> float:
    """Fraction of the SMs that have a program at all (one wave: min(programs, SMs) / SMs)."""
    return min(programs, sms) / sms


# ---------------------------------------------------------------------------------- figures

def kv_cache_figure() -> Figure:
    """KV bytes per token of published models, and the same models without GQA."""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax0, ax1 = fig.subplots(1, 2)
    names = list(MODELS)
    mib = [kv_bytes_per_token(MODELS[n]) / 2**20 for n in names]
    mha = [kv_bytes_per_token(MODELS[n], n_kv_heads=MODELS[n].n_heads) / 2**20 for n in names]
    y = range(len(names))
    ax0.barh([i + 0.2 for i in y], mha, height=0.4, color="tab:gray", label="as MHA (H_kv = H)")
    ax0.barh([i - 0.2 for i in y], mib, height=0.4, color="tab:blue", label="as published")
    ax0.set_yticks(list(y), [f"{n} ({MODELS[n].kind})" for n in names])
    ax0.invert_yaxis()
    ax0.set(xlabel="KV cache per token, MiB (fp16, all layers)",
            title="KV cache per token")
    ax0.axvline(VLLM_OPT13B_BYTES / 2**20, color="tab:orange", lw=2, ls="--",
                label="800 KB: OPT-13B in the vLLM paper")
    ax0.legend(fontsize=10, loc="center right", bbox_to_anchor=(1.0, 0.4))

    tokens = [2**k for k in range(10, 18)]
    for n, color in (("Llama-2-13B", "tab:red"), ("Qwen2.5-14B", "tab:green"),
                     ("Llama-3-70B", "tab:purple")):
        ax1.plot(tokens, [kv_cache_bytes(MODELS[n], t) / 2**30 for t in tokens], marker="o",
                 color=color, label=f"{n} ({MODELS[n].kind})")
    ax1.axhline(80, color="k", ls="--", lw=1, label="80 GiB (one H100)")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log", base=2)
    ax1.set_xticks(tokens, [f"{t // 1024}k" for t in tokens])
    ax1.set(xlabel="tokens in the cache (one sequence)", ylabel="GiB (fp16)",
            title="cache of one sequence")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=10)
    return fig


#: Figures of this module: image name -> function returning a matplotlib Figure.
FIGURES = {"11_kv_cache_per_token": kv_cache_figure}
