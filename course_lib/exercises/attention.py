"""Exercises of notebooks/04_attention_io, 05_one_pass_attention and 06_flash_v1_algorithm.

* 04 ``standard_io``: the elements a framework's attention moves through HBM, with the causal
  mask and dropout run as kernels of their own (a variant of the lesson's closed form, for
  N_q != N_k: the formula of section 3 alone does not pass);
* 04 ``fused_attention``: one head as a single fused loop that keeps S and P on chip and
  reports each load and store to an ``HBMCounter``; the checker compares O with
  ``reference.attention`` in fp64 *and* each tensor's count with ``iomodel.flash_v2_io`` (Q read
  once, K and V once per block of query rows, O written once), so a loop that is right but
  moves too much is told what it moved;
* 05 ``one_pass_step``: one key's step of 1-pass attention for many rows, masked scores
  (−∞) included, also at a row's very first step;
* 06 ``rescale_update``: one (j, i) step of Algorithm 1; ``paper_block_sizes``: B_r and B_c for
  an SRAM of M elements.

Each is registered (``course_lib.exercises``) with the stub the notebook shows, its reference
solution (``*_solution``, also tested in tests/test_iomodel_attention.py), the mistakes
students make, and a ladder of hints. The think-questions of the three lessons are registered
here too.
"""
from __future__ import annotations

import math

import torch

from course_lib.exercises import (
    TODO,
    Exercise,
    Mistake,
    Question,
    Result,
    _compare,
    _nudge,
    _report,
    check,
    register,
)
from course_lib.iomodel.attention import (
    HBMCounter,
    flash_attention_io,
    flash_v2_io,
    paper_block_sizes,
)
from course_lib.reference import attention

# --- 04: standard attention's HBM traffic, as a training framework runs it ------------------


def standard_io(N_q, N_k, d, causal=False, dropout=False):
    # TODO: add up what each kernel reads from HBM and writes to it
    raise NotImplementedError


def standard_io_solution(N_q, N_k, d, causal=False, dropout=False):
    """Q, K read and S written; each extra kernel (mask, dropout) reads and writes an N_q×N_k
    matrix, as the softmax does; P, V read and O written."""
    return 2 * N_q * d + 2 * N_k * d + (4 + 2 * causal + 2 * dropout) * N_q * N_k


def _framework_kernels(N_q, N_k, d, causal=False, dropout=False):
    """(kernel, elements read, elements written) of each kernel, in the order they run."""
    scores = N_q * N_k
    kernels = [("S = QKᵀ", N_q * d + N_k * d, scores)]
    if causal:
        kernels.append(("causal mask", scores, scores))
    kernels.append(("softmax", scores, scores))
    if dropout:
        kernels.append(("dropout", scores, scores))
    kernels.append(("O = PV", scores + N_k * d, N_q * d))
    return kernels


def _standard_io_spec(N_q, N_k, d, causal=False, dropout=False):
    return sum(r + w for _, r, w in _framework_kernels(N_q, N_k, d, causal, dropout))


STANDARD_IO_HINTS = (
    "list the kernels that run for these flags, in order, and for each one what it reads from "
    "HBM and what it writes there (section 2 does this for the three kernels of the plain "
    "case); then add up.",
    "Q and O are N_q × d, K and V are N_k × d; every matrix handed from one kernel to the next "
    "(S, the masked S, P, the dropped P) is N_q × N_k, not N × N.",
    "a matrix handed on is written by one kernel and read by the next: it costs its size "
    "twice. In arithmetic, True counts as 1 and False as 0.",
)


def check_standard_io(student, show: bool = True) -> Result:
    """``student(N_q, N_k, d, causal, dropout)``: elements moved through HBM for one head."""
    cases = [(1, 1, 1, False, False), (128, 128, 64, False, False), (100, 300, 64, False, False),
             (100, 300, 64, True, False), (300, 100, 80, False, True),
             (1000, 1000, 128, True, True), (4096, 1024, 64, True, True)]
    return check("standard_io", student, _standard_io_spec, cases, hints=STANDARD_IO_HINTS,
                 rtol=0, atol=0, show=show,
                 describe=lambda c: "N_q = {}, N_k = {}, d = {}, causal = {}, dropout = {}"
                 .format(*c))


register(Exercise(
    name="standard_io", lesson="04_attention_io", kind="python",
    writes="HBM elements of standard attention with mask and dropout kernels", lines=1,
    check=check_standard_io, solution=standard_io_solution, stub=standard_io,
    mistakes=(Mistake("the closed form of section 3, N_q = N_k = N",
                      lambda N_q, N_k, d, causal=False, dropout=False:
                      4 * N_q * d + 4 * N_q * N_q, "values differ"),
              Mistake("the three kernels only, the flags ignored",
                      lambda N_q, N_k, d, causal=False, dropout=False:
                      2 * N_q * d + 2 * N_k * d + 4 * N_q * N_k, "causal = True"),
              Mistake("an extra kernel counted once (its write, not the next kernel's read)",
                      lambda N_q, N_k, d, causal=False, dropout=False:
                      2 * N_q * d + 2 * N_k * d + (4 + causal + dropout) * N_q * N_k,
                      "values differ"),
              Mistake("the score matrices as N_q × N_q",
                      lambda N_q, N_k, d, causal=False, dropout=False:
                      2 * N_q * d + 2 * N_k * d + (4 + 2 * causal + 2 * dropout) * N_q * N_q,
                      "values differ")),
    hints=STANDARD_IO_HINTS))


def _fused_share(N=4096, d=64):
    fused = _standard_io_spec(N, N, d)  # S = QKᵀ, one mask+softmax+dropout kernel, O = PV
    return fused / _standard_io_spec(N, N, d, True, True)


register(Question(
    name="q04_fused_share", lesson="04_attention_io",
    asks="If one kernel applies the causal mask, the softmax and dropout (it reads S and writes "
         "the dropped P), what fraction of the five-kernel traffic is left at N_q = N_k = 4096, "
         "d = 64? Which term did fusing remove, and which is left?",
    answer="Five kernels move 4Nd + 8N² elements: the mask and dropout kernels each read and "
           "write an N × N matrix. The fused kernel reads S once and writes P once, so the "
           "three kernels move 4Nd + 4N², the same as plain standard attention. The fraction "
           "left is (4Nd + 4N²)/(4Nd + 8N²) = (d + N)/(d + 2N) = 4160/8256 ≈ 0.504: about "
           "half. Fusing the element-wise kernels removed the extra 4N²; the 4N² of writing S "
           "and P to HBM and reading them back is left, and it grows with N² while the useful "
           "4Nd grows with N. It goes only when the two matmuls are fused with the softmax "
           "too, so that S and P never leave the chip: FlashAttention (lesson 06).",
    value=_fused_share()))


# --- 04: the fused kernel, its traffic counted -------------------------------------------------


def fused_attention(q, k, v, hbm, block_m, block_n):
    """One head, q (N_q, d), k and v (N_k, d), as one fused kernel: S and P stay on chip.
    Report every load from HBM with hbm.read(name, block) and every store to HBM with
    hbm.write(name, block), by the names of section 2: "Q", "K", "V", "O"."""
    N_q, d = q.shape
    N_k = k.shape[0]
    sm_scale = 1 / math.sqrt(d)
    O = torch.full_like(q, float("nan"))          # (N_q, d): the output in HBM, not yet written
    # TODO: for each block of block_m query rows: load its rows of Q; load K a block of
    # block_n keys at a time and fill those columns of the block's scores; softmax; load V a
    # block at a time and accumulate the block's output; store it in O
    raise NotImplementedError
    return O


def fused_attention_solution(q, k, v, hbm, block_m, block_n):
    """Q_i loaded once per block of query rows; K_j and V_j once per (i, j) pair; S_i and P_i
    (B_r, N_k) never leave the chip; O_i stored once. FlashAttention-2's loop order, with the
    softmax taken over a whole row of scores instead of a running one (lesson 05)."""
    N_q, d = q.shape
    N_k = k.shape[0]
    sm_scale = 1 / math.sqrt(d)
    O = torch.full_like(q, float("nan"))          # (N_q, d): the output in HBM, not yet written
    for r0 in range(0, N_q, block_m):             # the last block may have fewer rows
        Q_i = q[r0:r0 + block_m]                  # (B_r, d)
        hbm.read("Q", Q_i)
        S_i = torch.empty(len(Q_i), N_k, dtype=q.dtype)           # (B_r, N_k), on chip
        for c0 in range(0, N_k, block_n):
            K_j = k[c0:c0 + block_n]              # (B_c, d)
            hbm.read("K", K_j)
            S_i[:, c0:c0 + block_n] = Q_i @ K_j.T * sm_scale
        P_i = torch.softmax(S_i, dim=-1)          # (B_r, N_k), on chip
        O_i = torch.zeros(len(Q_i), d, dtype=q.dtype)             # (B_r, d), on chip
        for c0 in range(0, N_k, block_n):
            V_j = v[c0:c0 + block_n]              # (B_c, d)
            hbm.read("V", V_j)
            O_i += P_i[:, c0:c0 + block_n] @ V_j
        O[r0:r0 + block_m] = O_i
        hbm.write("O", O_i)
    return O


def _fused_variant(store_s=False, kv_per_row=False, kv_once=False, q_per_step=False,
                   o_per_step=False, drop_rows=False, drop_keys=False, scaled=True):
    """The reference with one mistake students make switched on."""
    def wrong(q, k, v, hbm, block_m, block_n):
        N_q, d = q.shape
        N_k = k.shape[0]
        if kv_per_row:
            block_m = 1                           # a loop over rows, not over blocks of rows
        if drop_keys:
            N_k = N_k // block_n * block_n
        sm_scale = 1 / math.sqrt(d) if scaled else 1.0
        O = torch.full_like(q, float("nan"))
        if kv_once:
            for c0 in range(0, N_k, block_n):
                hbm.read("K", k[c0:c0 + block_n]), hbm.read("V", v[c0:c0 + block_n])
        T_r = N_q // block_m if drop_rows else math.ceil(N_q / block_m)
        for i in range(T_r):
            Q_i = q[i * block_m:(i + 1) * block_m]
            if not q_per_step:
                hbm.read("Q", Q_i)
            S_i = torch.empty(len(Q_i), N_k, dtype=q.dtype)
            for c0 in range(0, N_k, block_n):
                if q_per_step:
                    hbm.read("Q", Q_i)
                if not kv_once:
                    hbm.read("K", k[c0:c0 + block_n])
                S_i[:, c0:c0 + block_n] = Q_i @ k[c0:c0 + block_n].T * sm_scale
                if store_s:
                    hbm.write("S", S_i[:, c0:c0 + block_n])
            P_i = torch.softmax(S_i, dim=-1)
            O_i = torch.zeros(len(Q_i), d, dtype=q.dtype)
            for c0 in range(0, N_k, block_n):
                if not kv_once:
                    hbm.read("V", v[c0:c0 + block_n])
                O_i += P_i[:, c0:c0 + block_n] @ v[c0:c0 + block_n]
                if o_per_step:
                    O[i * block_m:(i + 1) * block_m] = O_i
                    hbm.write("O", O_i)
            if not o_per_step:
                O[i * block_m:(i + 1) * block_m] = O_i
                hbm.write("O", O_i)
        return O
    return wrong


FUSED_HINTS = (
    "three loops: an outer one over blocks of block_m query rows; inside it, one over blocks "
    "of block_n keys that fills the block's scores, then the softmax, then a second one over "
    "the same key blocks for V. The store comes after both inner loops.",
    "slicing clips at the end: the last block of rows (or of keys) is shorter when N_q is not "
    "a multiple of block_m (N_k of block_n), and a range with a step of block_m visits it. "
    "Report each slice to the counter where you take it, with its name: Q, K, V, O.",
    "the block's scores are Q_i times K_j transposed, times sm_scale, written into the "
    "columns of this key block; the softmax runs along each row once all of them are there. "
    "The block's output starts at zero and gains, per key block, its columns of P times V_j; "
    "write it into O once, and report that store.",
)
FUSED_NUDGES = {
    "must match the existing size": "the last block of rows (or keys) can be shorter than "
                                    "block_m (block_n): size the block's scores and output by "
                                    "the rows of Q you loaded, not by block_m.",
    "never written": "each block's output must land in O, the tensor the function returns: "
                     "hbm.write only counts, it stores nothing.",
    "differs from attention": FUSED_HINTS[2],
}

#: (N_q, N_k, d, block_m, block_n): ragged rows and keys with N_q > N_k (case 0 tells the
#: classic mistakes apart: T_r = 3, T_c = 4, N_q = 37 rows), B_r = 1, one block of each,
#: N_q < N_k with ragged blocks, a single query row.
FUSED_CASES = ((37, 29, 8, 16, 8), (24, 40, 16, 1, 16), (20, 33, 8, 32, 64), (18, 50, 4, 7, 5),
               (1, 5, 3, 4, 2))
FUSED_TOL = (1e-5, 1e-6)  # rtol, atol against fp64: on-chip buffers in fp32 pass too


def _fused_traffic(N_q, N_k, d, block_m, block_n) -> tuple[dict, dict]:
    """The model's reads and writes, in elements: FlashAttention-2's (``flash_v2_io``) without
    the log-sum-exp, which this forward-only kernel does not keep."""
    model = flash_v2_io(N_q, N_k, d, block_m, block_n)
    return dict(model["reads"]), {"O": model["writes"]["O"]}


def _fused_output_diagnosis(q, k, v, got, block_m, block_n) -> str:
    """What a wrong O says about the loop: rows never written, keys left out, no 1/√d."""
    N_q, d = q.shape
    N_k = k.shape[0]
    want = attention(q[None, None], k[None, None], v[None, None])[0, 0]
    full = N_q // block_m * block_m
    blocks = (f"N_q = {N_q} is {N_q // block_m} block{'s' * (N_q // block_m != 1)} of "
              f"{block_m} rows and one of {N_q - full}")
    if N_q % block_m and got.shape == want.shape and \
            _compare(got[:full].numpy(), want[:full].numpy(), *FUSED_TOL) is None:
        right = f"rows 0 to {full - 1} are right, " if full else "no row is right: "
        return (f"{right}the last {N_q - full} are not: the ragged last block of query rows "
                f"was left out ({blocks}).")
    if N_q % block_m and got.shape == (full, d):
        return (f"O has {full} rows, not {N_q}: the ragged last block of query rows was left "
                f"out ({blocks}).")
    keys = N_k // block_n * block_n
    if N_k % block_n and keys and got.shape == want.shape:
        short = attention(q[None, None], k[None, None, :keys], v[None, None, :keys])[0, 0]
        if _compare(got.numpy(), short.numpy(), *FUSED_TOL) is None:
            return (f"O is attention over the first {keys} keys only: the ragged last block "
                    f"of keys was left out (N_k = {N_k} is {N_k // block_n} blocks of "
                    f"{block_n} keys and one of {N_k - keys}).")
    if got.shape == want.shape:
        plain = attention(q[None, None], k[None, None], v[None, None], sm_scale=1.0)[0, 0]
        if _compare(got.numpy(), plain.numpy(), *FUSED_TOL) is None:
            return "O is softmax(QKᵀ)V without the 1/√d: scale the scores by sm_scale."
    return ""


def _times(n: int, unit: int) -> str:
    return f"{n / unit:.4g}×" if unit else str(n)


def _fused_traffic_diagnosis(reads, writes, N_q, N_k, d, block_m, block_n) -> list[str]:
    """What a right O with the wrong counts says about the loop, one line per finding."""
    T_r, T_c = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    if not reads and not writes:
        return ["nothing was reported to hbm: call hbm.read at every load from HBM and "
                "hbm.write at every store to it."]
    found = []
    extra = {f"{kind} {name}": n for kind, counts, allowed in
             (("read", reads, ("Q", "K", "V")), ("wrote", writes, ("O",)))
             for name, n in counts.items() if name not in allowed and n}
    if extra:
        scores = {what: n for what, n in extra.items()
                  if what.split()[1].upper().startswith(("S", "P")) or n % (N_q * N_k) == 0}
        if scores:
            listed = ", ".join(f"{w} {n}" for w, n in scores.items())
            found.append(f"scores went through HBM ({listed}; N_q·N_k = {N_q * N_k}). In a "
                         "fused kernel S and P stay on chip: their N_q·N_k term is exactly "
                         "what fusing removes.")
        others = {w: n for w, n in extra.items() if w not in scores}
        if others:  # the counts of Q, K, V, O cannot be judged then
            return found + [f"names the model does not know ({', '.join(others)}): report "
                            "loads as Q, K, V and the store as O, the names of section 2."]
    kv = N_k * d
    wrong = [name for name in ("K", "V") if reads.get(name, 0) != T_r * kv]
    same = len(wrong) == 2 and reads.get("K", 0) == reads.get("V", 0)
    for name in (["K and V"] if same else wrong):
        got, were, them = (reads.get(name[0], 0), "were" if same else "was",
                           "them" if same else "it")
        if got == N_q * kv and N_q != T_r:
            found.append(f"{name} {were} loaded once per query row ({N_q} times), not once per "
                         f"block of block_m = {block_m} rows ({T_r} times): a block's rows "
                         "share one load of each K_j and V_j.")
        elif got == kv and T_r > 1:
            found.append(f"{name} {were} loaded once in all, before the loop over query "
                         "blocks. On a GPU each block of query rows is a program with its own "
                         f"SRAM, so every block loads {them} itself: {T_r} times here.")
        else:
            found.append(f"{name} {were} read {_times(got, kv)} (N_k·d = {kv} elements), not "
                         f"{T_r}×: once per block of query rows.")
    got = reads.get("Q", 0)
    if got != N_q * d:
        if T_c > 1 and got in (T_c * N_q * d, 2 * T_c * N_q * d):
            found.append(f"Q was read {_times(got, N_q * d)}: Q_i was loaded in every key step. "
                         "Load it once per block of query rows, before the key loop.")
        elif T_r > 1 and got == T_r * N_q * d:
            found.append(f"Q was read {T_r}×: every block reported all of Q, not its own rows "
                         "Q_i. Report the block you load.")
        else:
            found.append(f"Q was read {_times(got, N_q * d)} (N_q·d = {N_q * d} elements), "
                         "not once: each block loads its own rows of Q, once.")
    got = writes.get("O", 0)
    if got != N_q * d:
        if T_c > 1 and got == T_c * N_q * d:
            found.append(f"O was written {T_c}×: O_i was stored in every key step. Store it once, "
                         "after the loop over V.")
        else:
            found.append(f"O was written {_times(got, N_q * d)} (N_q·d = {N_q * d} elements), "
                         "not once: each block stores its rows of O once.")
    return found


def _counts(counts: dict) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()) if n) or "nothing"


def check_fused_attention(student, show: bool = True) -> Result:
    """``student(q, k, v, hbm, block_m, block_n)``: O must equal ``reference.attention`` (fp64),
    and the loads and stores it reports to ``hbm`` must be the fused kernel's."""
    name = "fused_attention"
    gen = torch.Generator().manual_seed(4)

    def fail(why: str, found=()) -> Result:
        if found:  # a diagnosis says what is wrong; the ladder has more
            why += "".join(f"\n  Diagnosis: {f}" for f in found) + \
                f"\n  More: hint('{name}')."
        else:
            why += _nudge(name, FUSED_HINTS, why, FUSED_NUDGES)
        return _report(Result(name, False, why), show)

    for n, (N_q, N_k, d, block_m, block_n) in enumerate(FUSED_CASES):
        q, k, v = (torch.randn(rows, d, generator=gen, dtype=torch.float64)
                   for rows in (N_q, N_k, N_k))
        hbm = HBMCounter()
        where = (f"case {n} (N_q = {N_q}, N_k = {N_k}, d = {d}, block_m = {block_m}, "
                 f"block_n = {block_n})")
        try:
            got = student(q.clone(), k.clone(), v.clone(), hbm, block_m, block_n)
        except NotImplementedError:
            return _report(Result(name, False, TODO, "todo"), show)
        except Exception as exc:  # a student's bug is a message, not a crash
            return fail(f"{where} raised {type(exc).__name__}: {exc}")
        if got is None:
            return _report(Result(name, False, TODO + " (it returns None: return O)", "todo"),
                           show)
        got = torch.as_tensor(got).detach().double()
        want = attention(q[None, None], k[None, None], v[None, None])[0, 0]   # (N_q, d)
        why = _compare(got.numpy(), want.numpy(), *FUSED_TOL)
        if why:
            seen = _fused_output_diagnosis(q, k, v, got, block_m, block_n)
            return fail(f"{where}: O differs from attention(q, k, v): {why}",
                        [seen] if seen else ())
        reads = {k_: n_ for k_, n_ in hbm.reads.items() if n_}
        writes = {k_: n_ for k_, n_ in hbm.writes.items() if n_}
        want_reads, want_writes = _fused_traffic(N_q, N_k, d, block_m, block_n)
        if (reads, writes) != (want_reads, want_writes):
            T_r = math.ceil(N_q / block_m)
            return fail(f"{where}: O is right, but the traffic is not the fused kernel's "
                        f"(elements):\n    yours: reads {_counts(reads)}; writes "
                        f"{_counts(writes)}\n    model: reads {_counts(want_reads)}; writes "
                        f"{_counts(want_writes)} (Q read and O written once, K and V read "
                        f"T_r = ⌈N_q/block_m⌉ = {T_r} times)",
                        _fused_traffic_diagnosis(reads, writes, N_q, N_k, d, block_m, block_n))
    return _report(Result(name, True, f"all {len(FUSED_CASES)} cases: O = attention(q, k, v), "
                                      "and every load and store is the fused kernel's"), show)


register(Exercise(
    name="fused_attention", lesson="04_attention_io", kind="python",
    writes="one head as a fused loop: S and P on chip, each load and store counted", lines=16,
    check=check_fused_attention, solution=fused_attention_solution, stub=fused_attention,
    mistakes=(Mistake("S written to HBM block by block", _fused_variant(store_s=True),
                      "stay on chip"),
              Mistake("K and V loaded once per query row, not per block",
                      _fused_variant(kv_per_row=True), "once per query row"),
              Mistake("K and V loaded once, before the loop over query blocks",
                      _fused_variant(kv_once=True), "once in all"),
              Mistake("Q_i loaded inside the key loop", _fused_variant(q_per_step=True),
                      "loaded in every key step"),
              Mistake("O_i stored after every key block", _fused_variant(o_per_step=True),
                      "stored in every key step"),
              Mistake("the ragged last block of rows dropped (range(N_q // block_m))",
                      _fused_variant(drop_rows=True), "ragged last block of query rows"),
              Mistake("the ragged last block of keys dropped", _fused_variant(drop_keys=True),
                      "ragged last block of keys"),
              Mistake("the scores not scaled by 1/√d", _fused_variant(scaled=False),
                      "without the 1/√d")),
    hints=FUSED_HINTS))


# --- 05: one step of 1-pass attention ---------------------------------------------------------


def one_pass_step(o, m, l, x, v_j):
    # TODO: the new maximum, the new normaliser, then the rescaled o plus the new term
    raise NotImplementedError


def one_pass_step_solution(o, m, l, x, v_j):
    """After key j, for every row: o (rows, d), m and l (rows,), the new score x (rows,) and
    v_j (d,). Returns (o′, m′, l′): o′ is the output over the keys seen so far. A masked score
    is x = −∞; a row that has seen no key yet keeps o = 0, m = −∞, l = 0."""
    m_new = torch.maximum(m, x)
    shift = torch.where(m_new == float("-inf"), 0.0, m_new)  # e^(−∞ − (−∞)) would be NaN
    alpha, p = torch.exp(m - shift), torch.exp(x - shift)
    l_new = l * alpha + p
    inv_l = 1.0 / torch.where(l_new > 0, l_new, 1.0)  # l′ = 0: no key seen yet, o′ stays 0
    o_new = o * (l * alpha * inv_l)[:, None] + (p * inv_l)[:, None] * v_j[None, :]
    return o_new, m_new, l_new


def _one_pass_cases():
    gen = torch.Generator().manual_seed(5)
    cases = []
    for rows, d, first in ((1, 1, True), (4, 3, False), (7, 8, False), (5, 2, True)):
        o = torch.randn(rows, d, generator=gen, dtype=torch.float64)
        m = torch.randn(rows, generator=gen, dtype=torch.float64)
        l = torch.rand(rows, generator=gen, dtype=torch.float64) * 3 + 1
        if first:  # before the first key: o = 0, m = -inf, l = 0
            o, m, l = torch.zeros_like(o), torch.full_like(m, float("-inf")), torch.zeros_like(l)
        x = torch.randn(rows, generator=gen, dtype=torch.float64) * 2
        cases.append((o, m, l, x, torch.randn(d, generator=gen, dtype=torch.float64)))
    # Masked scores (causal): rows 0-2 at their first key, rows 3-5 later; rows 0, 1, 3, 4
    # masked. Rows 0 and 1 have seen no key before nor now: they stay o = 0, m = -inf, l = 0.
    o = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    m = torch.randn(6, generator=gen, dtype=torch.float64)
    l = torch.rand(6, generator=gen, dtype=torch.float64) * 3 + 1
    o[:3], m[:3], l[:3] = 0.0, float("-inf"), 0.0
    x = torch.randn(6, generator=gen, dtype=torch.float64) * 2
    x[[0, 1, 3, 4]] = float("-inf")
    cases.append((o, m, l, x, torch.randn(4, generator=gen, dtype=torch.float64)))
    return cases


def _describe_one_pass(case) -> str:
    o, m, _, x, _ = case
    masked = int(torch.isinf(x).sum())
    first = int(torch.isinf(m).sum())
    return (f"{o.shape[0]} rows, d = {o.shape[1]}, {first} at their first key, "
            f"{masked} scores masked (−∞); outputs (o′, m′, ℓ′)")


ONE_PASS_HINTS = (
    "o′ must be the attention output over the keys seen so far (section 3). The old o is "
    "normalised by the old ℓ against the old max: undo that, move it to the new max, add the "
    "new key's term, and divide by the new ℓ.",
    "a masked score is x = −∞. At a row's very first key m is −∞ too, so m′ = −∞ and "
    "e^(m − m′) = e^(−∞ + ∞) is NaN. Where m′ is −∞, subtract 0 instead (section 4): such a "
    "row has seen no key and keeps o = 0, ℓ = 0.",
    "work on all rows at once: torch.maximum, torch.exp and torch.where act elementwise on "
    "(rows,) vectors; f[:, None] makes a per-row factor a column that scales o row by row, "
    "v_j[None, :] a row. Dividing by ℓ′ = 0 needs its own guard.",
)
ONE_PASS_NUDGES = {
    "NaN": "a NaN where the expected value is a number, in a row whose scores so far are all "
           "masked (x = −∞): m and m′ are both −∞ there, and ℓ′ = 0. Section 4 says what the "
           "library does with each.",
    "m′:": "o′ matches, m′ does not: the running max after this key is the larger of the "
              "old max and the new score.",
    "ℓ′:": "o′ and m′ match, ℓ′ does not: the old ℓ was a sum against the old max; move it "
              "to the new max before adding the new key's term.",
}


def check_one_pass_step(student, show: bool = True) -> Result:
    return check("one_pass_step", student, one_pass_step_solution, _one_pass_cases(),
                 hints=ONE_PASS_HINTS, nudges=ONE_PASS_NUDGES, rtol=1e-9, atol=1e-12,
                 show=show, describe=_describe_one_pass, names=("o′", "m′", "ℓ′"))


def _one_pass_unguarded(o, m, l, x, v_j):
    m_new = torch.maximum(m, x)
    alpha, p = torch.exp(m - m_new), torch.exp(x - m_new)
    l_new = l * alpha + p
    o_new = o * (l * alpha / l_new)[:, None] + (p / l_new)[:, None] * v_j[None, :]
    return o_new, m_new, l_new


def _one_pass_no_l_guard(o, m, l, x, v_j):
    m_new = torch.maximum(m, x)
    shift = torch.where(m_new == float("-inf"), 0.0, m_new)  # the −∞ guard of section 4
    alpha, p = torch.exp(m - shift), torch.exp(x - shift)
    l_new = l * alpha + p
    o_new = o * (l * alpha / l_new)[:, None] + (p / l_new)[:, None] * v_j[None, :]  # 0 / 0
    return o_new, m_new, l_new


def _one_pass_no_alpha_on_o(o, m, l, x, v_j):
    _, m_new, l_new = one_pass_step_solution(o, m, l, x, v_j)
    safe_l = torch.where(l_new > 0, l_new, 1.0)
    p = torch.exp(x - torch.where(m_new == float("-inf"), 0.0, m_new))
    return o * (l / safe_l)[:, None] + (p / safe_l)[:, None] * v_j[None, :], m_new, l_new


def _one_pass_l_not_rescaled(o, m, l, x, v_j):
    o_new, m_new, l_new = one_pass_step_solution(o, m, l, x, v_j)
    p = torch.exp(x - torch.where(m_new == float("-inf"), 0.0, m_new))
    return o_new, m_new, l + p


def _one_pass_not_renormalised(o, m, l, x, v_j):
    _, m_new, l_new = one_pass_step_solution(o, m, l, x, v_j)
    shift = torch.where(m_new == float("-inf"), 0.0, m_new)
    alpha, p = torch.exp(m - shift), torch.exp(x - shift)
    return o * alpha[:, None] + p[:, None] * v_j[None, :], m_new, l_new


register(Exercise(
    name="one_pass_step", lesson="05_one_pass_attention", kind="python",
    writes="one key's step of 1-pass attention for many rows, masked scores included", lines=6,
    check=check_one_pass_step, solution=one_pass_step_solution, stub=one_pass_step,
    mistakes=(Mistake("no guard: e^(−∞ − (−∞)) at a masked first key", _one_pass_unguarded,
                      "NaN"),
              Mistake("the old o rescaled by ℓ/ℓ′, its factor e^(m − m′) forgotten",
                      _one_pass_no_alpha_on_o, "o′:"),
              Mistake("ℓ′ = ℓ + e^(x − m′), the old ℓ not moved to the new max",
                      _one_pass_l_not_rescaled, "ℓ′:"),
              Mistake("o kept unnormalised (v2's accumulator) while the spec wants o′",
                      _one_pass_not_renormalised, "o′:"),
              Mistake("the −∞ guard, but o′ divided by ℓ′ = 0 in a row that has seen no key",
                      _one_pass_no_l_guard, "NaN")),
    hints=ONE_PASS_HINTS))


# --- 06: Algorithm 1's rescale update of O, and block sizes for an SRAM -----------------------


def rescale_update(O_i, l_i, m_i, S_ij, V_j):
    # TODO: block statistics (m̃, P̃, l̃), then the new m and ℓ, then the new O_i
    raise NotImplementedError


def rescale_update_solution(O_i, l_i, m_i, S_ij, V_j):
    """One (j, i) step of FlashAttention v1 (no mask, no dropout).

    O_i (B_r, d), l_i and m_i (B_r,) as read from HBM; S_ij (B_r, B_c) the block's scaled
    scores; V_j (B_c, d). Returns the (O_i, l_i, m_i) to write back.
    """
    m_tilde = S_ij.amax(dim=-1)
    P_tilde = torch.exp(S_ij - m_tilde[:, None])
    l_tilde = P_tilde.sum(dim=-1)
    m_new = torch.maximum(m_i, m_tilde)
    alpha, beta = torch.exp(m_i - m_new), torch.exp(m_tilde - m_new)
    l_new = alpha * l_i + beta * l_tilde
    O_new = ((l_i * alpha)[:, None] * O_i + beta[:, None] * (P_tilde @ V_j)) / l_new[:, None]
    return O_new, l_new, m_new


def _rescale_cases():
    gen = torch.Generator().manual_seed(6)
    cases = []
    for B_r, B_c, d, first in ((1, 1, 1, True), (4, 3, 2, False), (8, 16, 4, False),
                               (3, 5, 8, True)):
        O = torch.randn(B_r, d, generator=gen, dtype=torch.float64)
        l = torch.rand(B_r, generator=gen, dtype=torch.float64) * 4 + 1
        m = torch.randn(B_r, generator=gen, dtype=torch.float64)
        if first:  # the first K/V block: HBM holds O = 0, l = 0, m = -inf
            O, l, m = torch.zeros_like(O), torch.zeros_like(l), torch.full_like(m, float("-inf"))
        S = torch.randn(B_r, B_c, generator=gen, dtype=torch.float64) * 2
        cases.append((O, l, m, S, torch.randn(B_c, d, generator=gen, dtype=torch.float64)))
    # A block whose scores are lower than the running max in half of the rows: there the old
    # state keeps its scale and the block is scaled down.
    O, S = (torch.randn(6, n, generator=gen, dtype=torch.float64) for n in (3, 4))
    l = torch.rand(6, generator=gen, dtype=torch.float64) * 4 + 1
    m = S.amax(dim=-1) + torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, -2.0], dtype=torch.float64)
    cases.append((O, l, m, S, torch.randn(4, 3, generator=gen, dtype=torch.float64)))
    return cases


def _describe_rescale(case) -> str:
    O, _, m, S, _ = case
    first = "the first K/V block (m = −∞)" if torch.isinf(m).all() else "a later K/V block"
    return f"B_r = {S.shape[0]}, B_c = {S.shape[1]}, d = {O.shape[1]}, {first}; outputs (O, l, m)"


RESCALE_HINTS = (
    "two stages (section 1): summarise the block on its own (its row max, the exponentials "
    "against that max, their row sum), then merge the summary with the m_i, ℓ_i, O_i read "
    "from HBM.",
    "the merge moves everything to the new max, the larger of m_i and m̃: the old state was "
    "computed against m_i, the block's summary against m̃, and each gets its own factor "
    "e^(its max − the new max), in ℓ and in O alike.",
    "O_i is stored normalised: multiply by ℓ_i to undo that before rescaling, and divide by the "
    "new ℓ at the end. amax(dim=-1) and sum(dim=-1) reduce rows; a per-row (B_r,) factor needs "
    "[:, None] to scale a (B_r, d) matrix.",
)


RESCALE_NUDGES = {
    "ℓ_i:": "O_i matches, ℓ does not: l̃ sums exponentials against the block's own max, "
              "and the new ℓ adds ℓ_i and l̃, each moved to the new max by its own factor.",
    "m_i:": "O_i and ℓ match, m does not: the new m is the larger of m_i and the block's max.",
}


def check_rescale_update(student, show: bool = True) -> Result:
    return check("rescale_update", student, rescale_update_solution, _rescale_cases(),
                 hints=RESCALE_HINTS, nudges=RESCALE_NUDGES, rtol=1e-9, atol=1e-12, show=show,
                 describe=_describe_rescale, names=("O_i", "ℓ_i", "m_i"))


def _rescale_parts(O_i, l_i, m_i, S_ij, V_j, subtract_block_max=True):
    m_tilde = S_ij.amax(dim=-1)
    P_tilde = torch.exp(S_ij - m_tilde[:, None]) if subtract_block_max else torch.exp(S_ij)
    m_new = torch.maximum(m_i, m_tilde)
    return (P_tilde, P_tilde.sum(dim=-1), m_new, torch.exp(m_i - m_new),
            torch.exp(m_tilde - m_new))


def _rescale_no_alpha(O_i, l_i, m_i, S_ij, V_j):
    P, l_t, m_new, alpha, beta = _rescale_parts(O_i, l_i, m_i, S_ij, V_j)
    l_new = alpha * l_i + beta * l_t
    return (l_i[:, None] * O_i + beta[:, None] * (P @ V_j)) / l_new[:, None], l_new, m_new


def _rescale_no_beta(O_i, l_i, m_i, S_ij, V_j):
    P, l_t, m_new, alpha, beta = _rescale_parts(O_i, l_i, m_i, S_ij, V_j)
    l_new = alpha * l_i + beta * l_t
    return ((l_i * alpha)[:, None] * O_i + P @ V_j) / l_new[:, None], l_new, m_new


def _rescale_unshifted_exp(O_i, l_i, m_i, S_ij, V_j):
    P, l_t, m_new, alpha, beta = _rescale_parts(O_i, l_i, m_i, S_ij, V_j, False)
    l_new = alpha * l_i + beta * l_t
    return ((l_i * alpha)[:, None] * O_i + beta[:, None] * (P @ V_j)) / l_new[:, None], l_new, \
        m_new


def _rescale_plain_sum(O_i, l_i, m_i, S_ij, V_j):
    P, l_t, m_new, alpha, beta = _rescale_parts(O_i, l_i, m_i, S_ij, V_j)
    l_new = l_i + l_t
    return ((l_i * alpha)[:, None] * O_i + beta[:, None] * (P @ V_j)) / l_new[:, None], l_new, \
        m_new


register(Exercise(
    name="rescale_update", lesson="06_flash_v1_algorithm", kind="python",
    writes="one (j, i) step of Algorithm 1: m̃, P̃, l̃, the new m, ℓ and O_i", lines=7,
    check=check_rescale_update, solution=rescale_update_solution, stub=rescale_update,
    mistakes=(Mistake("the old O_i without e^(m_i − m_new)", _rescale_no_alpha, "O_i:"),
              Mistake("P̃V_j without e^(m̃ − m_new)", _rescale_no_beta, "O_i:"),
              Mistake("P̃ = exp(S_ij), the block max not subtracted", _rescale_unshifted_exp,
                      "values differ"),
              Mistake("ℓ_new = ℓ_i + l̃, the sums not moved to the new max", _rescale_plain_sum,
                      "values differ")),
    hints=RESCALE_HINTS))


def block_sizes(M, d):
    # TODO: B_c from M and d, then B_r
    raise NotImplementedError


BLOCK_HINTS = (
    "SRAM holds Q_i, K_j, V_j and O_i at once (section 6): which have B_r rows, which B_c? The "
    "paper sizes B_c from M first, then B_r from B_c and d.",
    "a block has a whole number of rows, and the paper rounds up: where M is not a multiple "
    "of 4d, // gives one row too few.",
    "B_r never exceeds the head dim. Return the pair in the order (B_r, B_c).",
)


def check_block_sizes(student, show: bool = True) -> Result:
    cases = [(98304, 64), (98304, 128), (65536, 64), (1000, 10), (64, 64), (300, 16)]
    return check("paper_block_sizes", student, paper_block_sizes, cases, hints=BLOCK_HINTS,
                 rtol=0, atol=0, show=show, describe=lambda c: f"M = {c[0]}, d = {c[1]}")


register(Exercise(
    name="paper_block_sizes", lesson="06_flash_v1_algorithm", kind="python",
    writes="B_r and B_c of Algorithm 1 for an SRAM of M elements", lines=2,
    check=check_block_sizes, solution=paper_block_sizes, stub=block_sizes,
    mistakes=(Mistake("M // (4d): rounded down",
                      lambda M, d: (min(M // (4 * d), d), M // (4 * d)), "values differ"),
              Mistake("B_r = d, no min with B_c",
                      lambda M, d: (d, math.ceil(M / (4 * d))), "values differ"),
              Mistake("(B_c, B_r): the pair swapped",
                      lambda M, d: paper_block_sizes(M, d)[::-1], "values differ")),
    hints=BLOCK_HINTS))


def _largest_useful_M(N=4096, d=64):
    """The M past which v1's traffic stops falling: T_c = ⌈N / B_c⌉ reaches 1 there."""
    M = 4 * d * (N - 1)  # B_c = N − 1 here; one element more gives B_c = N, T_c = 1
    assert flash_attention_io(N, d, M + 1)["elements"] < flash_attention_io(N, d, M)["elements"]
    assert flash_attention_io(N, d, M + 1)["elements"] == flash_attention_io(N, d, 2 * M)[
        "elements"]
    return M


register(Question(
    name="q06_largest_useful_M", lesson="06_flash_v1_algorithm",
    asks="With B_c = ⌈M/4d⌉ and B_r = min(B_c, d), what is the largest SRAM size M (in "
         "elements) at which a larger M still reduces v1's traffic, for N = 4096, d = 64?",
    answer="v1's traffic depends on M only through T_c = ⌈N/B_c⌉ (section 5: 2Nd + T_cN(2d+2) "
           "reads, (1 + T_c)N(d+2) writes; B_r does not appear). It falls each time T_c drops, "
           "and the last drop is to T_c = 1, when one K/V block holds all N keys: B_c ≥ N, "
           "i.e. ⌈M/256⌉ ≥ 4096, i.e. M > 256·4095 = 1 048 320. Up to M = 1 048 320 "
           "elements a larger M can still help (one more element makes T_c = 1); past it, "
           "nothing changes. That is about 4Nd = 2^20 elements, 2 MiB in fp16: ten times an "
           "A100 SM's 192 KiB, so at this N real GPUs never get there. Between drops the "
           "traffic is flat: T_c = 2 for M from 256·2047 + 1 to 256·4095, for example.",
    value=_largest_useful_M()))
