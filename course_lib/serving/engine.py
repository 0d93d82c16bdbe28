"""A small LLM serving engine: the scheduler's batches run through a transformers model whose
attention is the course's paged varlen kernel.

Introduced in notebooks/16_serving.ipynb. ``course_lib.serving.scheduler`` decides what each step
runs; this module runs it:

    engine = Engine(model, num_blocks=64, block_size=16, max_tokens_per_step=64)
    engine.add_request(prompt_ids, max_new_tokens=20)             # a list of token ids
    engine.add_request(other_ids, max_new_tokens=5, arrival_step=3)
    outputs = engine.run()                                       # {request_id: generated ids}

One step is one forward pass of the model over **all** the step's tokens, packed into a single
row: prefill chunks and decode tokens of different requests one after another, each with its
own position (``position_ids``, so the rotary embedding is right), batch size 1. The model is
called with ``use_cache=False``: transformers' cache is not used, the engine's pages are the
cache. Each layer's attention then has three things to do, in ``paged_attention_forward``:

1. write this step's K and V rows into the layer's pages (num_blocks, block_size, H_kv, D), at
   the slots the scheduler's block tables give (token n of a request lives at
   ``pages[block_table[n // block_size], n % block_size]``, lesson 13's layout);
2. attend: every chunk's queries against its request's whole cache, this step's rows included,
   in ONE call of ``course_lib.ops.flash_attn_varlen(..., block_table=)`` (FlashAttention's
   ``flash_attn_varlen_func`` over a paged cache): ``cu_seqlens_q`` cuts the packed queries
   into chunks, the differences of ``cu_seqlens_k`` are each request's key count, and causal
   attention aligned bottom-right lets query i of a chunk of n_q queries see keys j <= L - n_q +
   i: exactly the keys before it and itself. Decodes (n_q = 1) and prefill chunks are the same
   call, which is what makes a mixed step one launch (Sarathi-Serve's batches, vLLM's paged
   varlen path);
3. return the output as transformers expects it, (1, N, H, D).

How the step's metadata reaches the attention. transformers 5.24 passes the keyword arguments
of a model's forward down to every layer's attention function (the route its FlashAttention
path uses for ``cu_seq_lens_q``); the engine passes ``paged_step=PagedStep(...)`` that way, so
no global state is needed. No mask is built: the attention name is registered as an attention
function only, and ``create_causal_mask`` returns None for a name it has no mask function for
(its rule for external backends such as vLLM's); the kernel's causal alignment and per-request
lengths are the mask.

The variants as transformers passes them (lesson 15): ``sliding_window`` W on a sliding layer
(Mistral every layer, Gemma 2 every other) is ``window_size = (W - 1, 0)``; Gemma 2's
``softcap`` and ``scaling`` pass through. The pages keep every token even where a window no
longer sees it (vLLM frees such blocks; we keep the engine simple). Attention sinks (GPT-OSS's
``s_aux``) are refused. Sampling is greedy (the argmax of each request's last logit), so the
engine's tokens can be checked against ``model.generate``'s, request by request.

References: the scheduling (Orca, Sarathi-Serve, PagedAttention, vLLM's prefix caching) is cited
in ``course_lib.serving.scheduler``. The paged varlen call is FlashAttention's
``flash_attn_varlen_func(..., block_table=)`` (Dao et al., FlashAttention,
https://github.com/Dao-AILab/flash-attention). transformers' attention functions:
https://huggingface.co/docs/transformers/en/attention_interface.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.kvquant import quantize_kv
from course_lib.ops import flash_attn_varlen
from course_lib.serving.scheduler import Batch, Scheduler
from course_lib.validate import KV_QUANT_DTYPES

try:
    from transformers import AttentionInterface
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "course_lib.serving.engine needs Hugging Face transformers, an optional extra of the "
        "course: pip install -e '.[hf]' (or pip install transformers)") from e

ATTN_IMPLEMENTATION = "course_serving"


@dataclass
class PagedStep:
    """What one step's attention needs besides the layer's q, k and v (one per step, shared by
    every layer; the pages are the layers' own)."""

    k_pages: list[torch.Tensor]  # per layer, (num_blocks, block_size, H_kv, D)
    v_pages: list[torch.Tensor]
    slots: torch.Tensor          # (N,) int64: token t's K/V row in the flattened pages
    block_table: torch.Tensor    # (B, max_blocks) int32, -1 past a request's blocks
    cu_seqlens_q: torch.Tensor   # (B + 1,) int32: chunk b is packed tokens cu[b] : cu[b + 1]
    cu_seqlens_k: torch.Tensor   # (B + 1,) int32: differences are the key counts L_b
    max_seqlen_q: int
    max_seqlen_k: int
    k_scales: list | None = None  # 8-bit pages: per layer, (num_blocks, block_size, H_kv) fp32
    v_scales: list | None = None


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, paged_step: PagedStep | None = None, **kwargs):
    """transformers' attention-function signature over the engine's paged cache.

    query (1, H, N, D) after the rotary embedding; key, value (1, H_kv, N, D): this step's N
    packed tokens only (``use_cache=False``). Writes key and value into the layer's pages, then
    one ``flash_attn_varlen`` over the pages. Returns (attn_output (1, N, H, D), None)."""
    if paged_step is None:
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} attention runs inside Engine.step(), which "
                         "passes the step's paged_step to the model's forward")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (GPT-OSS's s_aux) are not served by the "
                                  "serving engine")
    if dropout:
        raise NotImplementedError("the serving engine has no attention dropout: call model.eval()")
    _, H, N, D = query.shape
    H_kv = key.shape[1]
    k_pages = paged_step.k_pages[module.layer_idx]  # (num_blocks, block_size, H_kv, D)
    v_pages = paged_step.v_pages[module.layer_idx]
    # 1. this step's rows into their slots (a view of the pages: written in place)
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (N, H_kv, D)
    scales = {}
    if k_pages.dtype in KV_QUANT_DTYPES:  # an 8-bit cache: each row quantised as it is written
        for name, rows, pages in (("k", key, k_pages), ("v", value, v_pages)):
            rows, scale = quantize_kv(rows, pages.dtype)  # scale (N, H_kv)
            scales[f"{name}_scale"] = getattr(paged_step, f"{name}_scales")[module.layer_idx]
            scales[f"{name}_scale"].view(-1, H_kv).index_copy_(0, paged_step.slots, scale)
            if name == "k":
                key = rows
            else:
                value = rows
    for pages, rows in ((k_pages, key), (v_pages, value)):
        if pages.dtype in KV_QUANT_DTYPES:  # 8-bit rows copied as bytes (index_copy_ has no e4m3)
            pages, rows = pages.view(torch.uint8), rows.view(torch.uint8)
        pages.view(-1, H_kv, D).index_copy_(0, paged_step.slots, rows)
    # 2. every chunk against its request's whole cache, one call
    window = kwargs.get("sliding_window")
    out = flash_attn_varlen(
        query[0].transpose(0, 1).reshape(N, H, D),  # (N, H, D)
        k_pages, v_pages, paged_step.cu_seqlens_q, paged_step.cu_seqlens_k,
        paged_step.max_seqlen_q, paged_step.max_seqlen_k, causal=True, sm_scale=scaling,
        window_size=(window - 1, 0) if window else (-1, -1),
        softcap=float(kwargs.get("softcap") or 0.0), block_table=paged_step.block_table,
        **scales)
    return out[None], None  # (1, N, H, D)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


class Engine:
    """Continuous batching with chunked prefill and prefix caching over a paged cache, greedy
    (``static=True``: static batching instead, the baseline; ``Scheduler``). ``kv_dtype``
    torch.int8 or torch.float8_e4m3fn: an 8-bit cache, each K and V row quantised with its own
    scale as it is written (``course_lib.kvquant``), read back by the same kernel.

    ``model``: a transformers causal LM whose layers take ``AttentionInterface`` functions
    (LLaMA, Mistral, Gemma 2, ...). The engine switches its attention to
    ``ATTN_IMPLEMENTATION`` for good (``model.set_attn_implementation`` switches it back). The
    pages take 2 · layers · num_blocks · block_size · H_kv · D numbers of the model's dtype.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16,
                 max_tokens_per_step: int = 64, max_running: int = 8,
                 prefix_caching: bool = True, static: bool = False, kv_dtype=None):
        self.scheduler = Scheduler(num_blocks, block_size, max_tokens_per_step, max_running,
                                   prefix_caching, static)
        config = model.config
        H_kv = config.num_key_value_heads
        D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = next(model.parameters())
        self.device = weight.device
        shape = (num_blocks, block_size, H_kv, D)
        dtype = kv_dtype or weight.dtype
        if dtype not in (weight.dtype, *KV_QUANT_DTYPES):
            raise ValueError(f"kv_dtype must be None (the model's {weight.dtype}), torch.int8 or "
                             f"torch.float8_e4m3fn, got {kv_dtype}")
        layers = range(config.num_hidden_layers)
        self.k_pages = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in layers]
        self.v_pages = [torch.zeros_like(p) for p in self.k_pages]
        scaled = dtype in KV_QUANT_DTYPES  # one fp32 scale per token and head
        self.k_scales = [torch.ones(shape[:-1], device=self.device) if scaled else None
                         for _ in layers]
        self.v_scales = [torch.ones_like(s) if scaled else None for s in self.k_scales]
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.logits = None

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    def add_request(self, prompt, max_new_tokens: int, arrival_step: int = 0):
        """Queue a prompt (token ids); returns its request id."""
        return self.scheduler.add_request(prompt, max_new_tokens, arrival_step).request_id

    def paged_step(self, batch: Batch) -> PagedStep:
        """The batch's metadata as tensors on the model's device."""
        def ints(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        width = max(len(c.block_table) for c in batch.chunks)
        table = [c.block_table + [-1] * (width - len(c.block_table)) for c in batch.chunks]
        seqlens_k = batch.seqlens_k
        cu_k = [0]
        for n in seqlens_k:
            cu_k.append(cu_k[-1] + n)
        return PagedStep(self.k_pages, self.v_pages,
                         ints(batch.slot_mapping(self.block_size), torch.int64), ints(table),
                         ints(batch.cu_seqlens_q), ints(cu_k),
                         max(c.num_tokens for c in batch.chunks), max(seqlens_k),
                         self.k_scales, self.v_scales)

    @torch.inference_mode()
    def step(self) -> Batch:
        """Schedule a step, run it as one forward pass, sample greedily, hand the tokens back."""
        batch = self.scheduler.step()
        next_tokens = []
        if batch.chunks:
            positions = torch.tensor(batch.positions, device=self.device)
            logits = self.model(
                input_ids=torch.tensor(batch.token_ids, device=self.device)[None],
                position_ids=positions[None], use_cache=False,
                logits_to_keep=torch.tensor(batch.sample_indices, device=self.device,
                                            dtype=torch.long),
                paged_step=self.paged_step(batch)).logits  # (1, samples, vocab)
            self.logits = logits[0]  # (samples, vocab): the last step's, for inspection
            next_tokens = logits[0].argmax(-1).tolist()
        self.scheduler.update(batch, next_tokens)
        return batch

    def run(self, max_steps: int = 100_000) -> dict:
        """Step until every request has its tokens; returns {request_id: generated ids}."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        return {r.request_id: list(r.output) for r in self.scheduler.requests.values()}
