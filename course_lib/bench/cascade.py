"""Cascade attention against attending each request's whole context, one decode step.

``python -m course_lib.bench cascade`` (a GPU): B requests share a P-token prefix and each has
its own suffix of S tokens in the paged cache (pages of 16). Both providers read the same pages
through the same harness (``in_turns``: every provider once to compile, then rounds in turns,
``do_bench`` median), each called eagerly and replayed as a CUDA graph (the GPU's time without
the host's, as serving engines run a decode step). ``whole context``: one ``paged_decode`` over
P + S keys per request (its block table points at the shared prefix pages, then its own).
``cascade``: ``ops.cascade.cascade_decode`` (the prefix as one dense product, the suffixes by
``paged_decode``, the merge). Also each part of the cascade alone, eagerly. Result:
course_lib/data/cascade.json.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from course_lib.bench.common import environment, graphed, in_turns, require_gpu, save_result

H, H_KV, D = 32, 8, 128
BLOCK = 16
SHAPES = [(64, 4096, 256), (16, 4096, 256), (64, 1024, 256), (64, 16384, 256)]  # B, P, S


def _inputs(B: int, P: int, S: int, g: torch.Generator) -> dict:
    """The shared prefix's pages, each request's suffix pages, both block tables."""
    from course_lib.kernels.attention_common import cdiv

    n_prefix, n_suffix = cdiv(P, BLOCK), cdiv(S, BLOCK)
    num_blocks = n_prefix + B * n_suffix
    k_pages = torch.randn(num_blocks, BLOCK, H_KV, D, device="cuda", dtype=torch.float16,
                          generator=g)
    v_pages = torch.randn_like(k_pages)
    prefix = torch.arange(n_prefix, device="cuda", dtype=torch.int32)
    own = n_prefix + torch.arange(B * n_suffix, device="cuda", dtype=torch.int32)
    suffix_table = own.view(B, n_suffix)
    whole_table = torch.cat([prefix[None].expand(B, -1), suffix_table], dim=1)
    # the prefix as one (H_kv, P, D) tensor, what the dense product reads
    prefix_k = k_pages[:n_prefix].reshape(-1, H_KV, D)[:P].transpose(0, 1).contiguous()
    prefix_v = v_pages[:n_prefix].reshape(-1, H_KV, D)[:P].transpose(0, 1).contiguous()
    lens = torch.full((B,), S, device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16, generator=g)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, prefix_k=prefix_k, prefix_v=prefix_v,
                suffix_table=suffix_table.contiguous(), whole_table=whole_table.contiguous(),
                lens=lens, whole_lens=lens + P)


def rows(rounds: int = 5, shapes=SHAPES) -> list[dict]:
    from course_lib.ops import flash_attn_v2, paged_decode
    from course_lib.ops.cascade import cascade_decode, merge_state, prefix_splits

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, P, S in shapes:
        x = _inputs(B, P, S, g)
        q, kp, vp = x["q"], x["k_pages"], x["v_pages"]
        G, C = H // H_KV, prefix_splits(H // H_KV * B, H_KV, P)
        # the cascade's prefix product alone, as cascade_decode lays it out
        rows_q = q.reshape(B, H_KV, G, D).permute(1, 2, 0, 3).reshape(1, H_KV, G * B, D)
        rows_q = rows_q.expand(C, -1, -1, -1)
        chunks_k = x["prefix_k"].view(H_KV, C, P // C, D).transpose(0, 1)
        chunks_v = x["prefix_v"].view(H_KV, C, P // C, D).transpose(0, 1)
        o_s, lse_s = paged_decode(q, kp, vp, x["suffix_table"], x["lens"], return_lse=True)
        fns = {
            "whole context": lambda: paged_decode(q, kp, vp, x["whole_table"], x["whole_lens"]),
            "cascade": lambda: cascade_decode(q, x["prefix_k"], x["prefix_v"], kp, vp,
                                              x["suffix_table"], x["lens"]),
            "cascade: prefix": lambda: flash_attn_v2(rows_q, chunks_k, chunks_v, return_lse=True),
            "cascade: suffixes": lambda: paged_decode(q, kp, vp, x["suffix_table"], x["lens"],
                                                      return_lse=True),
            "a merge of two states": lambda: merge_state(o_s, lse_s, o_s, lse_s),
        }
        error = (fns["cascade"]().float() - fns["whole context"]().float()).abs().max().item()
        fns.update({f"{name} (graph)": graphed(fns[name]) for name in ("whole context",
                                                                        "cascade")})
        times, errors = in_turns(fns, rounds=rounds, rep_ms=100)
        ms = {name: statistics.median(t) for name, t in times.items() if t}
        row = {"B": B, "P": P, "S": S, "H": H, "H_kv": H_KV, "D": D, "dtype": "float16",
               "prefix_splits": C, "rounds_ms": times, "errors": errors, "ms": ms,
               "max_abs_diff": error, "speedup": ms["whole context"] / ms["cascade"],
               "speedup_graph": ms["whole context (graph)"] / ms["cascade (graph)"]}
        print(f"B {B:3d} P {P:5d} S {S} C {C}: whole {ms['whole context'] * 1e3:7.1f} us  "
              f"cascade {ms['cascade'] * 1e3:7.1f} us  x{row['speedup']:.2f}  (prefix "
              f"{ms['cascade: prefix'] * 1e3:.1f}, suffixes {ms['cascade: suffixes'] * 1e3:.1f},"
              f" merge {ms['a merge of two states'] * 1e3:.1f})  graphs: whole "
              f"{ms['whole context (graph)'] * 1e3:.1f} cascade {ms['cascade (graph)'] * 1e3:.1f}"
              f" x{row['speedup_graph']:.2f}  max diff {error:.1e}", flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench cascade",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    require_gpu("the cascade benchmark")
    result = {"environment": environment(), "method": __doc__, "rows": rows(args.rounds)}
    print("saved", save_result("cascade", result))
    return 0
