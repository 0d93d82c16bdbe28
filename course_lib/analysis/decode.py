"""The decode step's stored measurement read as bandwidth: K and V's bytes over a step's time,
against the device-to-device copy measured in the same run.

Introduced in notebooks/12_flash_decoding.ipynb (section 7); lesson 11, deck 07 and the README
read the same rows. The run is the drop-in benchmark's (``python -m course_lib.bench dropin``,
course_lib/data/dropin.json): a decode step of N_q = 1 query token, ``flash_decode`` as a planned
step and SDPA's CUDNN_ATTENTION and FLASH_ATTENTION backends, each replayed as a CUDA graph
(``triton.testing.do_bench`` median, L2 flushed). The bytes are the IO model's
(``iomodel.decode.decode_attention_io``: K and V read once, 2·B·H_kv·N·D·2 in fp16); the copy
reads and writes every byte, so its bytes count twice (``bench.common.copy_bandwidth_gbs``).
"""
from __future__ import annotations

#: Each side of the drop-in run's decode rows: its name and the column of its CUDA-graph time.
SIDES = {"flash_decode": "ours_graph_us",
         "SDPA cuDNN": "sdpa_cudnn_graph_us",
         "SDPA FLASH": "sdpa_flash_graph_us"}


def bandwidth_rows(result: dict | None = None) -> list[dict]:
    """One dict per decode shape of the drop-in run ``result`` (the stored one by default):
    ``B``, ``N``, ``kv_bytes``, and per side of ``SIDES`` its graph time ``us``, its KV bandwidth
    ``gbs`` (GB/s) and ``share``, that bandwidth over the run's copy bandwidth. An empty list
    where nothing is stored."""
    from course_lib.bench.common import load_result
    from course_lib.iomodel.decode import decode_attention_io

    result = load_result("dropin") if result is None else result
    if result is None:
        return []
    shape, copy = result["decode_shape"], result["copy_gbs"]
    out = []
    for r in result["decode"]:
        kv = decode_attention_io(r["B"], shape["H"], shape["H_kv"], shape["N_q"], r["N"],
                                 shape["D"])["kv_bytes"]
        row = {"B": r["B"], "N": r["N"], "kv_bytes": kv, "us": {}, "gbs": {}, "share": {}}
        for side, col in SIDES.items():
            if r.get(col):
                row["us"][side] = r[col]
                row["gbs"][side] = kv / (r[col] * 1e-6) / 1e9
                row["share"][side] = row["gbs"][side] / copy
        out.append(row)
    return out
