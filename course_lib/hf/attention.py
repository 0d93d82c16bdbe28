"""The course's kernels inside Hugging Face transformers: the attention of open models is ours.

Introduced in notebooks/14_llama_capstone.ipynb (LLaMA); the variants of other open models
(padding, sliding windows, softcap, sinks) are lesson 15's (notebooks/15_attention_variants.ipynb).

transformers lets a model's attention be swapped by name: every attention layer of LLaMA (and
of most decoder models) calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
``(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)``, where
query is (B, H, N_q, D) after the rotary embedding and key/value are (B, H_kv, N_k, D): the
*whole* KV cache after this step's update. It must return ``(attn_output, attn_weights)`` with
attn_output (B, N_q, H, D). Importing this module registers ``"course_kernels"``:

    import course_lib.hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="course_kernels")
    # or LlamaConfig(..., attn_implementation="course_kernels"), or
    # model.set_attn_implementation("course_kernels") on a model already built

and routes every call to one of the course's kernels (``CALLS`` names the route):

* ``"prefill"`` (the prompt, or any step with more than ``DECODE_MAX_QUERIES`` new tokens, or
  any step whose gradient is needed): ``flash_attn_v2`` (notebook 08), causal bottom-right
  aligned, so a chunk of new tokens after a cache attends correctly; GQA without repeating K/V.
* ``"decode"`` (at most ``DECODE_MAX_QUERIES`` new tokens against a longer cache, no padding;
  a static cache's unused slots are left out by its key counts, ``cache_seqlens``):
  ``flash_decode`` (notebook 12), split-KV with the LSE merge. With the layer's variants where
  it has some, ``flash_decode(..., window_size=, softcap=, sinks=)`` (notebook 15): the window
  is aligned on each sequence's last key, and the splits read only its band (about W + N_q keys
  per sequence, not N_k).
* ``"variants"``: a prefill (as above) with a sliding window that hides keys, a softcap or
  sinks: ``flash_attn_v2(..., window_size=, softcap=, sinks=)`` (notebook 15).
* ``"varlen"``: sequences that use different keys, where ``flash_decode`` does not serve them:
  padding among the keys a step sees (a left-padded batch's prefill and decode steps, until a
  sliding layer's cache has dropped it), and a static cache's unused slots in a prefill whose
  sequences' lengths differ or, compiled, that has a variant, and in any step with a gradient:
  ``flash_attn_varlen`` over key ranges (below).

The variants come as transformers passes them, checked against its eager code (5.24):

* **sliding window** (Mistral on every layer, Gemma 2 and GPT-OSS on every other): the layer
  passes ``sliding_window=W``, and the mask function lets query t see keys t - W < j <= t (W
  keys, its own included): FlashAttention's ``window_size = (W - 1, 0)``, as transformers'
  FlashAttention path passes it. Applied where it hides a key (N_k > W); a sliding layer's
  cache that keeps only the window needs none in its decode steps.
* **softcap** (Gemma 2's ``attn_logit_softcapping``): ``softcap=c``, c·tanh(s / c) on the
  scaled scores, before the mask; ``scaling`` is Gemma 2's query_pre_attn_scalar^-0.5.
* **sinks** (GPT-OSS): ``s_aux``, the layer's (H,) parameter, a logit per head in the softmax's
  denominator with no value (eager concatenates it as one more column and drops its
  probability), cast to fp32; its gradient flows back to the parameter.

The mask. transformers builds one mask per forward (one per layer type) through
``ALL_MASK_ATTENTION_FUNCTIONS`` under the same name; ``course_attention_mask`` turns it into
the keys each sequence uses, without drawing an N_q x N_k mask for the causal and sliding
patterns (``mask_pattern``): ``None`` when every key of the cache is real (the kernels' own
masking is exact); the key counts L_b (B, 1, 1, 1) int32 when sequence b uses the first L_b
keys (a static cache not full yet); else the ranges (B, 1, 1, 4) int32 = (q_lo, q_hi, k_lo,
k_hi): sequence b's real queries and the keys they see, which is how a left-padded batch
(``generate``'s), a right-padded one, or padding inside a sliding layer's cache arrive. The
window is not in the mask: the layer applies its own. The ranges go to ``flash_attn_varlen``
with the batch's rows as they lie: each sequence is three packed pieces (padding before, the
real tokens, padding after), offsets computed on the device and ``max_seqlen`` bounded by N_q
and N_k, so nothing is read back and every shape is static; K and V are copied into the packed
layout (as FlashAttention's transformers integration gathers them). A padding token's own
output is not specified (transformers' eager path averages every key there, FlashAttention's
returns zeros; ours attends among the padding). Other mask functions (packed sequences,
chunked attention, overlays) are drawn and checked; a 4D mask handed to the model directly is
checked by the attention function the same way, against the layer's window.

Refused, with ``NotImplementedError`` and the reason (a silently wrong answer is worse than
none): a padding mask with holes inside a sequence (right padding followed by generated tokens),
packed sequences, chunked attention, any mask that is not causal (or the layer's window) over
one run of keys per sequence; a sliding window on bidirectional attention; attention dropout.

Read-backs. Eagerly, a 2D padding mask is read back once per forward (a few flags: its one-run
check and which form it takes; as transformers' SDPA path reads its mask to skip it), a drawn
mask likewise, and a static cache's L_b range once per forward where the cache is cut to it;
never once per layer. torch.compile (which ``generate`` applies on a GPU with a static cache,
``cache_implementation="static"``) traces both functions: the kernels are ``torch.library``
operators (``course_lib.ops``), the checks inside a graph are device-side assertions and padded
batches take the ranges, so nothing in the compiled path reads a tensor's value back and a
decode step can be one CUDA graph (``generate`` asks for the mask before each step, outside the
graph: with a 2D padding mask that call reads its flags back, without one it reads nothing).

``CALLS`` counts the routes taken by eager calls and ``VARIANTS`` the calls that applied a
``"window"``, a ``"softcap"`` or ``"sinks"``, so a test can show that every attention call of
``generate`` was served by the course and with which variants; a compiled graph shows its
kernels as ``course.*`` nodes instead.

The capstone's models, timing and stored runs are ``course_lib.hf.capstone``.
"""
from __future__ import annotations

import collections
import weakref

import torch

from course_lib.masks import NO_WINDOW  # FlashAttention's window_size for no window
from course_lib.ops import flash_attn_v2, flash_attn_varlen, flash_decode

try:
    from transformers import (  # noqa: F401 (the model classes: course_lib.hf.capstone's)
        AttentionInterface,
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )
    from transformers.masking_utils import (
        AttentionMaskInterface,
        and_masks,
        causal_mask_function,
        sdpa_mask,
        sliding_window_overlay,
    )
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "course_lib.hf needs Hugging Face transformers, an optional extra of the course: "
        "pip install -e '.[hf]' (or pip install transformers)") from e

ATTN_IMPLEMENTATION = "course_kernels"
DECODE_MAX_QUERIES = 16  # at most this many new tokens against a cache: flash_decode
CALLS: collections.Counter = collections.Counter()  # eager calls by route
VARIANTS: collections.Counter = collections.Counter()  # eager calls that applied each variant


# ---------------------------------------------------------------------------------------------
# the attention function and its mask
# ---------------------------------------------------------------------------------------------

# transformers' mask functions (masking_utils) that course_attention_mask reads without drawing
# the mask: the causal one, and the sliding window's ``and_masks(sliding_window_overlay(W),
# causal_mask_function)``, under which query q_idx sees key kv_idx iff q_idx - W < kv_idx <=
# q_idx: W keys, its own included, FlashAttention's window_size = (W - 1, 0).
_AND_CODE = and_masks(causal_mask_function).__code__
_WINDOW_CODE = sliding_window_overlay(1).__code__


def _closure(fn) -> dict:
    """The variables a nested function closes over, by name."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def mask_pattern(mask_function):
    """``("causal", None)``, ``("sliding", W)`` or None (any other pattern) for the mask function
    transformers hands a mask interface.

    W is read from the closure of transformers' own sliding-window mask function. Under
    ``torch.compile`` a function made inside the graph has no closure to read: only the plain
    causal one is recognised there, and the caller draws any other mask and checks it."""
    if mask_function is None or mask_function is causal_mask_function:
        return ("causal", None)
    if torch.compiler.is_compiling() or getattr(mask_function, "__code__", None) is not _AND_CODE:
        return None
    parts = _closure(mask_function).get("mask_functions", ())
    if len(parts) == 2 and causal_mask_function in parts:
        window = parts[1] if parts[0] is causal_mask_function else parts[0]
        if getattr(window, "__code__", None) is _WINDOW_CODE:
            return ("sliding", _closure(window)["sliding_window"])
    return None


def course_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                          mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers hands our attention, as the keys each sequence uses: None (every
    key of the cache, no padding), or a small int32 tensor that every layer receives:

    * the key counts L_b, (B, 1, 1, 1): sequence b uses keys [0, L_b) of the cache and its N_q
      queries are the last N_q of those (a static cache not full yet, a right-trimmed cache);
    * the ranges (B, 1, 1, 4) = (q_lo, q_hi, k_lo, k_hi): queries [q_lo, q_hi) of sequence b are
      real tokens and see keys [k_lo, k_hi) of the cache, the last query aligned with the last
      key (left padding, or padding on both sides). Queries outside [q_lo, q_hi) are padding:
      their outputs are not specified (transformers' FlashAttention path returns zeros there,
      its eager path an average over every key).

    The window is not in the mask: a sliding layer passes its ``sliding_window`` to the
    attention function, which applies it (as transformers' FlashAttention path does).

    Called once per forward by ``create_causal_mask`` and ``create_sliding_window_causal_mask``
    (once per layer type), and with a static cache once per step by ``generate``. The causal and
    the sliding-window mask functions (``mask_pattern``) are turned into key ranges without
    drawing an N_q x N_k mask: from the offsets alone when there is no 2D mask (a static cache
    gets L_b = q_offset + N_q - kv_offset, on the device: ``_keys_seen``), or from the 2D padding
    mask (``_keys_of_padding_mask``), which must hold one run of real tokens per sequence (left
    or right padding); eagerly that check and the choice of form read back a few flags, once per
    forward (as transformers' SDPA path reads its mask back to skip it); under ``torch.compile``
    the check is a device-side assertion and the ranges are always used, so nothing is read back.
    Any other mask function (packed sequences, chunked attention, an overlay) is drawn as
    ``sdpa_mask``'s 4D boolean mask and checked, once per forward (``_keys_in_mask``): a mask
    that is causal (or, when transformers passes ``local_size``, a sliding window of that size)
    over one range of keys and queries per sequence becomes that range; any other raises
    ``NotImplementedError`` (under ``torch.compile``, a device-side assertion): the kernels
    cannot express it, and a silently wrong answer is worse than none. A compiled prefill with
    no cache (N_q = N_k, no offsets), for which transformers draws the mask because it cannot
    rule out packed sequences in a graph, gets None after the device checks that it is plain
    causal.
    """
    pattern = mask_pattern(mask_function)
    if pattern is not None and not isinstance(kv_offset, torch.Tensor):
        if attention_mask is None:
            if (not isinstance(q_offset, torch.Tensor)
                    and q_offset + q_length == kv_offset + kv_length):
                return None  # every key of the cache, no padding: the kernels' own masking
            # No padding: the N_q queries are the last of the q_offset + N_q tokens seen, and the
            # cache holds them from kv_offset on. A static cache's offset (a tensor) stays on the
            # device.
            return _keys_seen(batch_size, q_length, q_offset, kv_offset, kwargs.get("device"))
        if attention_mask.ndim == 2:
            return _keys_of_padding_mask(q_length, kv_length, q_offset, kv_offset,
                                         attention_mask.bool(), windowed=pattern[0] != "causal")
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask.bool()
    kwargs.pop("allow_is_causal_skip", None)
    local_size = kwargs.get("local_size")
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     allow_is_causal_skip=False, **kwargs)  # (B, 1, N_q, N_k)
    left = None if local_size is None else local_size - 1
    plain_prefill = (torch.compiler.is_compiling() and attention_mask is None
                     and q_length == kv_length
                     and not any(isinstance(x, torch.Tensor) for x in (q_offset, kv_offset))
                     and q_offset == kv_offset == 0)
    # A compiled prefill with no cache: transformers drew the mask only because it cannot rule
    # out packed sequences in a graph. Checked (on the device) to be the plain causal mask over
    # all N keys, it becomes None: every layer runs the causal forward kernel with no key
    # ranges, as the eager prefill does.
    return _keys_in_mask(mask, q_length, kv_length, left, plain=plain_prefill)[0]


_REFUSED = (
    "course_kernels serves causal attention over one run of real tokens per sequence (left or "
    "right padding, a static cache's unused slots, a sliding window): this attention mask has "
    "packed sequences, holes in a sequence's padding mask, chunked attention or another "
    "pattern. Use attn_implementation='sdpa' for such batches.")
# The same refusal inside a compiled graph, as a device-side assertion: CUDA's device assert
# takes messages of at most 254 characters (a longer one fails to compile the graph).
_REFUSED_ON_DEVICE = ("course_kernels serves one run of real tokens per sequence; this mask has "
                      "another pattern (course_lib.hf.attention): use "
                      "attn_implementation='sdpa'")
# The last mask checked eagerly: (weak ref to the mask, its version, the window it was checked
# with, weak ref to the key tensor made from it, (min L_b, max L_b) or None). That tensor is what
# course_attention_mask hands every layer, so a layer finds its range by identity. Weak
# references: a tensor kept alive here from one ``generate`` to the next holds a block of
# PyTorch's caching allocator, the next static cache's tensors then get other addresses, and a
# compiled decode step records its CUDA graph anew (its inputs moved).
_checked_mask: tuple = (None, -1, None, None, None)


def _remember(mask, keys: torch.Tensor, length_range, left=None) -> None:
    global _checked_mask
    _checked_mask = (None if mask is None else weakref.ref(mask),
                     -1 if mask is None else _version(mask), left, weakref.ref(keys),
                     length_range)


def _remembered_range(lengths: torch.Tensor):
    ref = _checked_mask[3]
    return _checked_mask[4] if ref is not None and ref() is lengths else None


def _version(t: torch.Tensor):
    # an in-place change bumps a tensor's version; inference tensors have none (identity only)
    return None if t.is_inference() else t._version


def _run(flags: torch.Tensor):
    """(first, one past the last) index of the True entries of each row of flags (B, N), on the
    device; (0, 0) for a row with none."""
    n = flags.shape[-1]
    idx = torch.arange(n, device=flags.device)
    end = torch.where(flags, idx + 1, 0).amax(-1)
    first = torch.minimum(torch.where(flags, idx, n).amin(-1), end)
    return first, end


def _ranges(q_lo, q_hi, k_lo, k_hi) -> torch.Tensor:
    """The ranges form of the keys in use, (B, 1, 1, 4) int32."""
    return torch.stack([q_lo, q_hi, k_lo, k_hi], -1).to(torch.int32).view(-1, 1, 1, 4)


def _ranges_of_lengths(lengths: torch.Tensor, n_q: int) -> torch.Tensor:
    """The key counts L_b (B,) as ranges: every query real, keys [0, L_b)."""
    zeros = torch.zeros_like(lengths)
    return _ranges(zeros, zeros + n_q, zeros, lengths)


def _keys_in_mask(mask: torch.Tensor, n_q: int, n_k: int, left=None, plain: bool = False):
    """(keys, (min L_b, max L_b) or None) for a 4D mask: keys = the L_b (B, 1, 1, 1) int32 if
    ``mask`` is causal over the first L_b keys of each sequence, else the ranges (B, 1, 1, 4)
    if it is causal over keys [k_lo, k_hi) for the queries [q_lo, q_hi) (the rows that see some
    key), bottom-right aligned; with ``left``, also a sliding window of left + 1 keys. Anything
    else raises ``NotImplementedError``. ``plain`` (compiled prefill): the mask must be plain
    causal over all keys, and the keys are None.

    mask (B or 1, 1 or H, N_q, N_k): boolean (True = attend) or additive float (0 = attend).
    Computed on the device. Eagerly, the check, the form and the lengths' range are read back
    together, once per mask (every layer of a forward shares it: one synchronisation per
    forward, not one per layer); under ``torch.compile`` the check is a device-side assertion
    and the form is the ranges, so the compiled graph reads nothing back.
    """
    if mask.ndim != 4 or mask.shape[-2:] != (n_q, n_k):
        raise NotImplementedError(
            f"course_kernels: unexpected attention mask of shape {tuple(mask.shape)}; expected "
            f"(B, 1, {n_q}, {n_k})")
    compiling = torch.compiler.is_compiling()
    ref_mask, version, checked_left, ref_keys, length_range = _checked_mask
    if (not compiling and ref_mask is not None and ref_mask() is mask
            and version == _version(mask) and checked_left == left and ref_keys() is not None):
        return ref_keys(), length_range
    allowed = mask if mask.dtype == torch.bool else mask == 0
    first_row = allowed[:, 0]  # (B, N_q, N_k)
    q_lo, q_hi = _run(first_row.any(-1))  # (B,): the queries that see some key
    k_lo, k_hi = _run(first_row.any(-2))  # (B,): the keys that some query sees
    i = torch.arange(n_q, device=mask.device)[:, None]  # (N_q, 1)
    j = torch.arange(n_k, device=mask.device)[None, :]  # (1, N_k)
    p = i + (k_hi - q_hi)[:, None, None]  # (B, N_q, 1): query i's key position, bottom-right
    expected = ((i >= q_lo[:, None, None]) & (i < q_hi[:, None, None]) & (j <= p)
                & (j >= k_lo[:, None, None]) & (j < k_hi[:, None, None]))  # (B, N_q, N_k)
    if left is not None:
        expected &= j >= p - left
    ok = (allowed == expected[:, None]).all()
    simple = ((q_lo == 0) & (q_hi == n_q) & (k_lo == 0)).all()
    if plain:
        torch._assert_async(ok & simple & (k_hi == n_k).all(), _REFUSED_ON_DEVICE)
        return None, None
    if compiling:
        torch._assert_async(ok, _REFUSED_ON_DEVICE)
        return _ranges(q_lo, q_hi, k_lo, k_hi), None
    ok, simple, lo, hi = torch.stack([ok.to(torch.int64), simple.to(torch.int64), k_hi.min(),
                                      k_hi.max()]).tolist()
    if not ok:
        raise NotImplementedError(_REFUSED)
    if simple:
        keys, length_range = k_hi.to(torch.int32).view(-1, 1, 1, 1), (lo, hi)
    else:
        keys, length_range = _ranges(q_lo, q_hi, k_lo, k_hi), None
    _remember(mask, keys, length_range, left)
    return keys, length_range


def _keys_seen(batch_size: int, n_q: int, q_offset, kv_offset: int, device) -> torch.Tensor:
    """L_b = q_offset + N_q - kv_offset for every sequence, as the (B, 1, 1, 1) int32 tensor the
    layers get. ``generate`` with a static cache asks for a mask eagerly before every step, the
    compiled ones included, with its position as a tensor: computed on the device, nothing is
    read back (drawing the 4D mask and checking it launched about twenty small kernels and
    read the result back, every step)."""
    if isinstance(q_offset, torch.Tensor):
        seen = (q_offset.reshape(-1)[:1] + n_q - kv_offset).to(device=device or q_offset.device,
                                                               dtype=torch.int32)
        return seen.view(1, 1, 1, 1).expand(batch_size, 1, 1, 1).contiguous()
    return _all_lengths(batch_size, q_offset + n_q - kv_offset, device)


def _keys_of_padding_mask(n_q: int, n_k: int, q_offset, kv_offset: int,
                          padding_mask: torch.Tensor, windowed: bool = False):
    """The keys each sequence uses, from the 2D padding mask (B, T) (True: a real token) over the
    q_offset + N_q tokens seen (a mask longer than that, as long as a static cache, has a tail
    that no query sees); the cache holds the tokens from kv_offset on (a sliding layer's cache
    drops the oldest). Each sequence's real tokens must be one run [s_b, e_b): left padding,
    right padding or both; holes raise ``NotImplementedError``.

    Returns None if every sequence uses every key (no padding in the cache, N_q the last
    tokens); the key counts L_b = e_b - kv_offset (B, 1, 1, 1) if no sequence has padding
    inside the cache on the left and either none is padded on the right or a single query (a
    decode step; not ``windowed``: a window is aligned on the query's own position) sees them
    all; else the ranges (B, 1, 1, 4): queries of positions [s_b, e_b) among the N_q, keys of
    those positions in the cache. Eagerly this reads back one small vector, once per forward;
    under ``torch.compile`` nothing (the check is a device-side assertion, the form the ranges).

    transformers 5.17's ``generate`` keeps an all-ones 2D mask (5.24 drops it before the first
    step) and, with a static cache, asks for the mask with it before every step, the compiled
    ones included: a handful of small kernels and one read-back, not the 4D mask drawn over the
    whole cache (about twenty kernels)."""
    compiling = torch.compiler.is_compiling()
    device = padding_mask.device
    n_tokens = padding_mask.shape[-1]
    idx = torch.arange(n_tokens, device=device)
    seen = q_offset + n_q
    if isinstance(seen, torch.Tensor):
        seen = seen.reshape(-1)[:1].to(device)  # (1,)
        real = padding_mask & (idx < seen)
    else:
        real = padding_mask & (idx < seen) if n_tokens > seen else padding_mask
    n_real = real.sum(-1)  # (B,)
    s, e = _run(real)  # (B,): the run of real tokens, if it is one
    empty = n_real == 0
    s = torch.where(empty, seen, s)  # no real token: every query is padding
    e = torch.where(empty, seen, e)
    one_run = ((n_real == e - s) | empty).all()
    if compiling:
        torch._assert_async(one_run, _REFUSED_ON_DEVICE)
    else:
        lengths = (e - kv_offset).clamp(min=0)
        no_left = (s <= kv_offset).all()  # no padding inside the cache on the left
        no_right = (e >= seen).all()
        flags = torch.stack([one_run.to(torch.int64), no_left.to(torch.int64),
                             no_right.to(torch.int64), lengths.min(), lengths.max()])
        one_run, no_left, no_right, lo, hi = flags.tolist()  # the read-back
        if not one_run:
            raise NotImplementedError(_REFUSED)
        if no_left and (no_right or (n_q == 1 and not windowed)):
            if (no_right and not isinstance(q_offset, torch.Tensor)
                    and q_offset + n_q == kv_offset + n_k):
                return None
            lengths = lengths.to(torch.int32).view(-1, 1, 1, 1)
            _remember(None, lengths, (lo, hi))
            return lengths
    return _ranges((s - q_offset).clamp(0, n_q), (e - q_offset).clamp(0, n_q),
                   (s - kv_offset).clamp(0, n_k), (e - kv_offset).clamp(0, n_k))


def _all_lengths(batch_size: int, n: int, device) -> torch.Tensor:
    """L_b = n for every sequence, (B, 1, 1, 1) int32; eagerly, its range (n, n) is remembered
    for the layers (``_lengths_range``)."""
    lengths = torch.full((batch_size, 1, 1, 1), n, dtype=torch.int32, device=device)
    if not torch.compiler.is_compiling():
        _remember(None, lengths, (n, n))
    return lengths


def _lengths_range(lengths: torch.Tensor):
    """(min L_b, max L_b) of the key counts ``course_attention_mask`` made: known from its check
    when eager, or read back once (every layer gets the same tensor); None under
    ``torch.compile``."""
    if torch.compiler.is_compiling():
        return None
    known = _remembered_range(lengths)
    if known is not None:
        return known
    lo, hi = torch.stack([lengths.min(), lengths.max()]).tolist()  # read back, once per mask
    _remember(None, lengths, (lo, hi))
    return lo, hi


def _layer_window(module, kwargs: dict, causal: bool):
    """The left extent of a sliding layer's window (W - 1 for ``sliding_window`` = W), or None.

    transformers' sliding layers pass ``sliding_window`` to the attention function (Mistral:
    the config's, every layer; Gemma 2 and GPT-OSS: the layer's, None on full layers); a layer
    that does not may carry it as an attribute. Its causal mask function lets query t see keys
    t - W < j <= t (``sliding_window_overlay``): left = W - 1, right = 0."""
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    else:  # (vars(): a missing attribute through nn.Module.__getattr__ costs an exception)
        window = vars(module).get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise NotImplementedError(f"course_kernels: sliding_window={window!r} (layer "
                                  f"{getattr(module, 'layer_idx', '?')}) is not a positive int")
    if not causal:
        raise NotImplementedError(
            "course_kernels: a sliding window on bidirectional attention is not served (its mask, "
            "|q - k| <= W, is another window than the causal one's)")
    return window - 1


def _count(route: str, window, softcap: float, sinks) -> None:
    """Count an eager call: its route in CALLS, the variants it applied in VARIANTS."""
    if torch.compiler.is_compiling():
        return
    CALLS[route] += 1
    for name, applied in (("window", window != NO_WINDOW), ("softcap", softcap != 0.0),
                          ("sinks", sinks is not None)):
        if applied:
            VARIANTS[name] += 1


def _varlen(query, key, value, ranges, scaling, window, softcap, sinks) -> torch.Tensor:
    """Attention over the key ranges of each sequence, (B, N_q, H, D), by ``flash_attn_varlen``
    and no read-back.

    The (B, N, H, D) rows of the batch are packed sequences as they lie: sequence b's rows split
    into three pieces, [0, q_lo) x [0, k_lo) (padding before), [q_lo, q_hi) x [k_lo, k_hi) (the
    real tokens) and [q_hi, N_q) x [k_hi, N_k) (padding after, or a static cache's unused
    slots), so the offsets come from the ranges on the device and every shape is static:
    ``max_seqlen`` = N_q and N_k bound every piece. The padding's pieces attend among themselves
    (their outputs are not specified); an empty piece costs nothing. K and V are copied into
    the packed layout (as FlashAttention's transformers integration gathers them)."""
    B, H, n_q, D = query.shape
    H_kv, n_k = key.shape[1], key.shape[2]
    q_lo, q_hi, k_lo, k_hi = ranges.view(-1, 4).expand(B, 4).unbind(-1)  # (B,) each
    rows = torch.arange(B, device=query.device, dtype=torch.int32)
    zero = rows[:1] * 0

    def offsets(lo, hi, n):  # (3B + 1,) int32
        start = rows * n
        return torch.cat([zero, torch.stack([start + lo, start + hi, start + n], -1).flatten()])

    cu_q, cu_k = offsets(q_lo, q_hi, n_q), offsets(k_lo, k_hi, n_k)
    q = query.transpose(1, 2).reshape(B * n_q, H, D)  # a view when q is (B, N_q, H, D) in memory
    k = key.transpose(1, 2).reshape(B * n_k, H_kv, D)  # the cache is (B, H_kv, N_k, D): a copy
    v = value.transpose(1, 2).reshape(B * n_k, H_kv, D)
    _count("varlen", window, softcap, sinks)
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, n_q, n_k, causal=True, sm_scale=scaling,
                            window_size=window, softcap=softcap, sinks=sinks, validate=False)
    return out.view(B, n_q, H, D)


def _decode(query, key, value, lengths, scaling, window, softcap, sinks) -> torch.Tensor:
    """A decode step, (B, H, N_q, D), by ``flash_decode``: split-KV, causal among the N_q
    queries (the last ones of each sequence's L_b keys, or of N_k), with the variants that
    apply. A window (W - 1, 0) reads only its band of the cache: about W + N_q keys per
    sequence. The variants' keywords are passed only where one applies: a call at the defaults
    is the plain one, whose plan every layer of a step shares."""
    variants = {}
    if window != NO_WINDOW:
        variants["window_size"] = window
    if softcap != 0.0:
        variants["softcap"] = softcap
    if sinks is not None:
        variants["sinks"] = sinks
    _count("decode", window, softcap, sinks)
    return flash_decode(query, key, value, cache_seqlens=lengths, sm_scale=scaling, **variants)


def course_attention_forward(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, **kwargs):
    """transformers' attention-function signature, served by the course's Triton kernels.

    query (B, H, N_q, D); key, value (B, H_kv, N_k, D), the whole cache after this step's
    update. Returns (attn_output (B, N_q, H, D), None): no attention weights are ever formed.
    The variants come as transformers passes them: ``sliding_window`` W (``_layer_window``:
    window_size = (W - 1, 0), applied only where it hides a key), ``softcap`` (Gemma 2: c·tanh(s
    / c) on the scaled scores), ``s_aux`` (GPT-OSS's sinks, a per-head logit, cast to fp32; its
    gradient flows back), ``scaling`` (Gemma 2's query_pre_attn_scalar^-0.5). Traceable by
    ``torch.compile(fullgraph=True)``: the kernels are ``torch.library`` operators, and under
    compilation nothing is read back from the device.
    """
    if dropout:
        raise NotImplementedError("course_kernels has no attention dropout: call model.eval() "
                                  "or set config.attention_dropout = 0")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    B, n_q, n_k = query.shape[0], query.shape[2], key.shape[2]
    compiling = torch.compiler.is_compiling()
    left = _layer_window(module, kwargs, causal)
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.float()  # (H,): the kernels keep the softmax in fp32

    def window_for(n_keys):  # a window that hides no key (the last query's key position,
        # n_keys - 1, minus left is <= 0) is left out: the plain kernels serve the call
        return (left, 0) if left is not None and n_keys - 1 > left else NO_WINDOW

    lengths = ranges = length_range = None
    if attention_mask is not None:
        if not causal:
            raise NotImplementedError("course_kernels: a mask on non-causal attention (padding) "
                                      "is not supported")
        if attention_mask.dtype == torch.int32:  # from course_attention_mask (checked there)
            keys = attention_mask
        else:  # a mask made elsewhere (a 4D mask passed to the model): checked here
            keys, length_range = _keys_in_mask(attention_mask, n_q, n_k, left)
        if keys.shape[-1] == 4:
            ranges = keys
        else:
            lengths = keys.view(-1).expand(B)  # (B,)
    variant = window_for(n_k) != NO_WINDOW or softcap != 0.0 or sinks is not None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, sinks))
    # a decode step, with or without the layer's variants (flash_decode has them all)
    decode = (n_q <= DECODE_MAX_QUERIES and n_k > n_q and (causal or n_q == 1)
              and not needs_grad)
    if ranges is not None:
        return _varlen(query, key, value, ranges, scaling, window_for(n_k), softcap, sinks), None
    if lengths is not None and (decode or compiling):
        if decode or (not needs_grad and not variant):
            # A compiled prefill into a static cache cannot cut the cache to the keys in use (a
            # length read back from the device): flash_decode takes the lengths as a tensor.
            # Its window is aligned on each sequence's L_b, so the whole cache's N_k decides
            # only whether one is passed (a window that hides no key of N_k hides none of L_b).
            out = _decode(query, key, value, lengths, scaling, window_for(n_k), softcap, sinks)
            return out.transpose(1, 2).contiguous(), None
        # compiled, a prefill with a variant or a step with a gradient: the ranges, on the device
        ranges = _ranges_of_lengths(lengths, n_q)
        return _varlen(query, key, value, ranges, scaling, window_for(n_k), softcap, sinks), None
    if lengths is not None:  # eager: cut the cache to the keys in use
        lo, n_used = length_range or _lengths_range(attention_mask)  # read back once per mask
        if lo != n_used:  # sequences of different lengths: the ranges
            return _varlen(query, key, value, _ranges_of_lengths(lengths, n_q), scaling,
                           window_for(n_k), softcap, sinks), None
        key, value, n_k = key[:, :, :n_used], value[:, :, :n_used], n_used  # static cache
    window = window_for(n_k)
    if decode:
        out = _decode(query, key, value, None, scaling, window, softcap, sinks)
    elif window != NO_WINDOW or softcap != 0.0 or sinks is not None:
        _count("variants", window, softcap, sinks)
        out = flash_attn_v2(query, key, value, causal=causal, sm_scale=scaling,
                            window_size=window, softcap=softcap, sinks=sinks)
    else:
        _count("prefill", window, softcap, sinks)
        out = flash_attn_v2(query, key, value, causal=causal, sm_scale=scaling)  # (B, H, N_q, D)
    # O is laid out as q is, (B, N_q, H, D) in memory (ops.flash_attn_v2): no copy here
    return out.transpose(1, 2).contiguous(), None  # (B, N_q, H, D)


def register(name: str = ATTN_IMPLEMENTATION, fn=course_attention_forward) -> str:
    """Register an attention function ``fn`` and the course's mask under ``name``.

    Done at import for ``course_attention_forward``; notebook 14 registers its own too. A name
    containing "flash" would make transformers look for a kernel on the Hub: avoid it.
    """
    if "flash" in name:
        raise ValueError(f"{name!r}: transformers treats names with 'flash' as Hub kernels")
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, course_attention_mask)
    return name


register()
