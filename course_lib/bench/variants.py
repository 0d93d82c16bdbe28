"""The variants (kernels.flash_variants, flash_variants_bwd) on a GPU: causal, sliding window,
softcap, ALiBi and sinks against the course's dense kernels and FlexAttention, one harness, in
turns; and packed sequences (varlen) against the dense kernel at their mean length.

    python -m course_lib.bench variants [--backward | --varlen | --tiles] [--out FILE]

B 2, H 16, N 16k, D 128, bf16. The forward (course_lib/data/variants_fwd.json):
every provider called eagerly. The backward (variants_bwd.json): for every provider, ours and
FlexAttention alike, the forward runs once outside the timing and the timed call is
``torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)``. Timing: ``triton.testing.do_bench``
(median, L2 flushed), 7 rounds in turns (A B C ..., A B C ...), the median of its rounds kept.
TFLOP/s count the visited area only: 4·B·H·D per (query, key) pair a row sees
(``course_lib.masks.visible``; the backward 2.5 times that), so a window's throughput compares
with the dense kernel's on equal terms. FlexAttention (``torch.nn.attention.flex_attention``) is
compiled once per mask and score modification (the same mask and score change as ours; it has
no sinks), its block mask made once, outside the timing.

Varlen (variants_varlen.json): 64 causal sequences of random lengths 1 to 4096 (seeded), H 16,
D 128, bf16, forward and backward timed as above, against flash_attn_v2 (portable kernel) on as
many causal sequences of the mean length; TFLOP/s on the pairs each sequence's rows see.

Tiles (variants_hopper_tiles.json): the TMA forward (kernels.flash_variants_hopper) with each
candidate config fixed, for causal, window 1024, causal softcap, ALiBi and sinks, beside the
portable variants' kernel and the dense kernels, at the shape above; 3 rounds in turns, the
median kept.
"""
from __future__ import annotations

import argparse
import json

import torch

from course_lib.bench.common import DATA_DIR, describe_error, environment, in_turns, require_gpu
from course_lib.masks import visible_pairs

B, H, N, D = 2, 16, 16384, 128
WINDOW = 1024
SOFTCAP = 30.0
CAUSAL, WINDOWED = (-1, 0), (WINDOW, 0)


def _cases() -> dict:
    """The variants timed, {name: (window, keywords)}: the window also says which pairs the
    FLOPs count. The ALiBi slopes and the sinks are drawn once, for every provider."""
    return {"causal": (CAUSAL, {}), f"window {WINDOW}": (WINDOWED, {}),
            "causal softcap": (CAUSAL, {"softcap": SOFTCAP}),
            "causal alibi": (CAUSAL, {"alibi_slopes": torch.rand(H, device="cuda") * 0.1}),
            "causal sinks": (CAUSAL, {"sinks": torch.randn(H, device="cuda")})}


def _ours(q, k, v, backward, window, impl="portable", config=None, softcap=0.0,
          alibi_slopes=None, sinks=None):
    """Our variants' kernels (also for plain causal, which ``flash_attn_v2`` would send to the
    dense ones): the launcher directly for the forward (no lse; ``impl`` "portable" or
    "hopper", the latter with a fixed ``config`` if given), the operator under autograd for the
    backward."""
    from course_lib.kernels.flash_variants import forward_variants
    from course_lib.kernels.flash_variants_hopper import forward_variants_hopper
    from course_lib.masks import Variant

    variant = Variant(window, softcap, alibi_slopes, sinks)
    if not backward and impl == "hopper":
        return lambda: forward_variants_hopper(q, k, v, D ** -0.5, variant, store_lse=False,
                                               config=config)
    if not backward:
        return lambda: forward_variants(q, k, v, D ** -0.5, variant, store_lse=False)
    return _grad_of(lambda *t: torch.ops.course.flash_attn_variants_fwd(
        *t, D ** -0.5, *window, softcap, alibi_slopes, sinks)[0], q, k, v)


def _grad_of(fn, q, k, v):
    """The backward only: O made once, then each call is autograd.grad of it."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    do = torch.randn_like(o)
    return lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)


def _providers(q, k, v, backward):
    from course_lib.ops import flash_attn_v2

    cases = _cases()
    slopes = cases["causal alibi"][1]["alibi_slopes"]  # (FlexAttention's score mod below)
    # name: (fn, window the FLOPs count); the TMA forward too (the backward is one for both)
    fns = {f"variants {name}": (_ours(q, k, v, backward, w, **kw), w)
           for name, (w, kw) in cases.items()}
    if not backward:
        fns.update({f"variants hopper {name}": (_ours(q, k, v, False, w, "hopper", **kw), w)
                    for name, (w, kw) in cases.items()})
    for impl, label in (("portable", "portable"), (None, "auto")):
        def dense(*t, impl=impl):
            return flash_attn_v2(*t, causal=True, impl=impl)
        fn = _grad_of(dense, q, k, v) if backward else (lambda dense=dense: dense(q, k, v))
        fns[f"flash_attn_v2 causal ({label})"] = (fn, CAUSAL)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)

        def causal_mask(b, h, i, j):
            return j <= i

        def window_mask(b, h, i, j):
            return (j <= i) & (i - j <= WINDOW)

        def softcap_mod(score, b, h, i, j):
            return SOFTCAP * torch.tanh(score / SOFTCAP)

        def alibi_mod(score, b, h, i, j):
            return score - slopes[h] * (i - j)  # causal: i >= j

        masks = {}
        for name, mask, mod, w in (("flex causal", causal_mask, None, CAUSAL),
                                   (f"flex window {WINDOW}", window_mask, None, WINDOWED),
                                   ("flex causal softcap", causal_mask, softcap_mod, CAUSAL),
                                   ("flex causal alibi", causal_mask, alibi_mod, CAUSAL)):
            if mask not in masks:
                masks[mask] = create_block_mask(mask, None, None, N, N, device="cuda")

            def call(*t, bm=masks[mask], mod=mod):
                return flex(*t, score_mod=mod, block_mask=bm)
            fn = _grad_of(call, q, k, v) if backward else (lambda call=call: call(q, k, v))
            fns[name] = (fn, w)
    except Exception as exc:  # an older torch: recorded, the rest goes on
        print("FlexAttention unavailable:", describe_error(exc))
    return fns


def _time_in_turns(fns, rounds):
    """{name: [ms per round]}, {name: error}: ``in_turns`` with 200 ms per timing."""
    return in_turns(fns, rounds, rep_ms=200)


def _median(xs):
    return sorted(xs)[len(xs) // 2] if xs else None


def run(rounds: int = 7, backward: bool = False) -> dict:
    require_gpu("the variants benchmark")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    fns = _providers(q, k, v, backward)
    times, errors = _time_in_turns({name: fn for name, (fn, _) in fns.items()}, rounds)
    rows = []
    for name, (_, window) in fns.items():
        ms = _median(times[name])
        flops = (2.5 if backward else 1.0) * 4.0 * B * H * D * visible_pairs(N, N, window)
        rows.append({"provider": name, "window": list(window), "ms": ms, "rounds_ms": times[name],
                     "tflops_visited": flops / (ms * 1e-3) / 1e12 if ms else None,
                     "error": errors.get(name)})
        print(rows[-1]["provider"], ms, rows[-1]["tflops_visited"], errors.get(name), flush=True)
    return {"environment": environment(), "direction": "backward" if backward else "forward",
            "shape": {"B": B, "H": H, "N": N, "D": D, "dtype": "bf16", "window": WINDOW,
                      "softcap": SOFTCAP},
            "method": __doc__.strip().split("\n\n")[2].replace("\n", " "), "rows": rows}


def tile_candidates() -> list:
    """The TMA variants kernel's candidate configs (lesson 09's ``_cfg``: BLOCK_M, BLOCK_N,
    warps, stages, Q_IN_REGS, ROWSUM_MMA, PINNED_MAX), from which its table
    (``flash_variants_hopper.VARIANTS_HOPPER_TABLE``) took one per head dim."""
    from course_lib.kernels.flash_v2_hopper import _cfg

    return [_cfg(64, 64, 4, 3, True, True, True), _cfg(64, 64, 4, 3, True, False, True),
            _cfg(128, 64, 8, 3, True, False, True), _cfg(128, 64, 4, 3, True, False, True),
            _cfg(64, 64, 4, 3, True, True, False), _cfg(128, 128, 8, 2, True, False, True),
            _cfg(64, 64, 4, 2, True, False, True)]


def _shape(c) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages, ROWSUM_MMA, PINNED_MAX): a candidate's name in
    variants_hopper_tiles.json."""
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages,
            c.kwargs["ROWSUM_MMA"], c.kwargs["PINNED_MAX"])


def run_tiles(rounds: int = 3) -> dict:
    """Every candidate tile config of the TMA variants' forward, fixed, in turns (see above)."""
    from course_lib.ops import flash_attn_v2

    require_gpu("the variants' tile benchmark")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    fns = {}  # (config, case, window): fn
    for case, (w, kw) in _cases().items():
        for c in tile_candidates():
            fns[(str(list(_shape(c))), case, w)] = _ours(q, k, v, False, w, "hopper", c, **kw)
        fns[("portable", case, w)] = _ours(q, k, v, False, w, **kw)
    for impl in ("portable", "hopper"):
        fns[(f"dense {impl}", "causal", CAUSAL)] = (
            lambda impl=impl: flash_attn_v2(q, k, v, causal=True, impl=impl))
    times, errors = _time_in_turns(fns, rounds)
    rows = []
    for (config, case, w), t in times.items():
        ms = _median(t)
        flops = 4.0 * B * H * D * visible_pairs(N, N, w)
        rows.append({"D": D, "H": H, "config": config, "case": case, "ms": ms, "rounds_ms": t,
                     "tflops_visited": flops / (ms * 1e-3) / 1e12 if ms else None,
                     "error": errors.get((config, case, w))})
        print(config, case, ms, rows[-1]["tflops_visited"], flush=True)
    return {"environment": environment(),
            "shape": {"B": B, "N": N, "H·D": H * D, "dtype": "bf16", "window": WINDOW,
                      "softcap": SOFTCAP},
            "config_fields": ["BLOCK_M", "BLOCK_N", "warps", "stages", "ROWSUM_MMA",
                              "PINNED_MAX"],
            "method": __doc__.strip().split("\n\n")[4].replace("\n", " "), "rows": rows}


def run_varlen(rounds: int = 7, n_seq: int = 64, longest: int = 4096) -> dict:
    """Packed causal sequences against the dense kernel at their mean length (see above)."""
    from course_lib.ops import flash_attn_v2, flash_attn_varlen

    require_gpu("the varlen benchmark")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, longest + 1, (n_seq,), generator=g).tolist()
    total, mean = sum(lens), round(sum(lens) / n_seq)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qd, kd, vd = (torch.randn(n_seq, H, mean, D, device="cuda", dtype=torch.bfloat16)
                  for _ in range(3))

    def packed(*t):
        return flash_attn_varlen(*t, cu, cu, max(lens), max(lens), causal=True)

    def dense(*t):
        return flash_attn_v2(*t, causal=True, impl="portable")
    pairs = {"varlen": sum(visible_pairs(n, n, CAUSAL) for n in lens),
             "dense": n_seq * visible_pairs(mean, mean, CAUSAL)}
    fns = {("varlen", "forward"): lambda: packed(q, k, v),
           ("dense", "forward"): lambda: dense(qd, kd, vd),
           ("varlen", "backward"): _grad_of(packed, q, k, v),
           ("dense", "backward"): _grad_of(dense, qd, kd, vd)}
    times, errors = _time_in_turns(fns, rounds)
    rows = []
    for (what, direction), ms in ((key, _median(t)) for key, t in times.items()):
        flops = (2.5 if direction == "backward" else 1.0) * 4.0 * H * D * pairs[what]
        rows.append({"provider": what, "direction": direction, "ms": ms,
                     "rounds_ms": times[(what, direction)],
                     "tflops_visited": flops / (ms * 1e-3) / 1e12 if ms else None,
                     "error": errors.get((what, direction))})
        print(what, direction, ms, rows[-1]["tflops_visited"], flush=True)
    return {"environment": environment(),
            "shape": {"sequences": n_seq, "longest": longest, "lengths": lens, "total": total,
                      "mean": mean, "dense_B": n_seq, "H": H, "D": D, "dtype": "bf16",
                      "causal": True},
            "method": __doc__.strip().split("\n\n")[3].replace("\n", " "), "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench variants")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backward", action="store_true")
    which.add_argument("--varlen", action="store_true")
    which.add_argument("--tiles", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    stem = "variants_varlen" if args.varlen else "variants_hopper_tiles" if args.tiles else (
        "variants_bwd" if args.backward else "variants_fwd")
    out = args.out or str(DATA_DIR / f"{stem}.json")
    if args.tiles:
        result = run_tiles(min(args.rounds, 3))
    else:
        result = (run_varlen(args.rounds) if args.varlen
                  else run(args.rounds, backward=args.backward))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    if not (args.varlen or args.tiles):
        by = {r["provider"]: r for r in result["rows"]}
        c, w = by["variants causal"]["ms"], by[f"variants window {WINDOW}"]["ms"]
        print(f"window {WINDOW} / full causal speed-up: {c / w:.2f}x (visited area "
              f"{visible_pairs(N, N, CAUSAL) / visible_pairs(N, N, WINDOWED):.2f}x smaller)")
        if "variants hopper causal" in by:
            c, w = by["variants hopper causal"]["ms"], by[f"variants hopper window {WINDOW}"]["ms"]
            print(f"TMA kernel: window {WINDOW} / full causal speed-up: {c / w:.2f}x")
    return 0
