"""python -m course_lib.exercises list | verify [NAME ...] | solution NAME

``list``: one line per exercise and think-question: lesson, name, kind, what the student writes.
``verify``: every reference solution passes its checker, every registered wrong answer fails it
with the message a student would see, and that message diagnoses it (it names the mistake, or
says what no other registered mistake's message says), every stub reads as "not done yet", every
question has a worked answer (and its number passes its own check). Exit status 0 only when
all of that holds.
``solution NAME``: the reference solution.
"""
import argparse
import contextlib
import io
import sys
import time

from course_lib.exercises import Question, catalogue, check_answer, solution


def _quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def verify_one(ex) -> list[str]:
    """The problems of one exercise or question (empty: it holds)."""
    if isinstance(ex, Question):
        problems = [] if ex.answer.strip() else [f"{ex.name}: no worked answer"]
        if ex.value is not None:
            if not _quiet(check_answer, ex.name, ex.value):
                problems.append(f"{ex.name}: its own number fails check_answer")
            if _quiet(check_answer, ex.name, ex.value * 1.5 + 1):
                problems.append(f"{ex.name}: a wrong number passes check_answer")
        return problems
    problems = []
    res = ex.check(ex.solution, show=False)
    if not res.passed:
        problems.append(f"{ex.name}: the reference solution fails: {res.message}")
    stub = ex.check(ex.stub, show=False)
    if stub.status != "todo":
        problems.append(f"{ex.name}: the stub does not read as 'not done yet': {stub.message}")
    for m in ex.mistakes:
        res = ex.check(m.answer, show=False)
        if res.passed:
            problems.append(f"{ex.name}: the wrong answer '{m.label}' passes")
        elif res.status != "wrong":
            problems.append(f"{ex.name}: the wrong answer '{m.label}' reads as {res.status}")
        elif m.expect and m.expect not in res.message:
            problems.append(f"{ex.name}: the wrong answer '{m.label}' fails, but its message "
                            f"lacks {m.expect!r}: {res.message}")
        elif m.label not in res.message and not _distinct(m, ex.mistakes):
            problems.append(f"{ex.name}: the wrong answer '{m.label}' is not diagnosed: its "
                            f"message neither names it nor says what only it says: "
                            f"{res.message}")
    return problems


def _distinct(m, mistakes) -> bool:
    """Whether ``m.expect`` is said by this mistake's message alone: no other mistake of the
    exercise expects a text that contains it or that it contains."""
    return bool(m.expect) and not any(o is not m and o.expect and
                                      (m.expect in o.expect or o.expect in m.expect)
                                      for o in mistakes)


def verify(names=None, verbose: bool = True) -> int:
    items = catalogue()
    if names:
        items = {n: items[n] for n in names}
    counts = {"solutions": 0, "wrong answers": 0, "stubs": 0, "questions": 0}
    problems = []
    t0 = time.perf_counter()
    for name, ex in items.items():
        t = time.perf_counter()
        found = verify_one(ex)
        problems += found
        if isinstance(ex, Question):
            counts["questions"] += 1
        else:
            counts["solutions"] += 1
            counts["stubs"] += 1
            counts["wrong answers"] += len(ex.mistakes)
        if verbose:
            mark = "ok " if not found else "BAD"
            extra = "" if isinstance(ex, Question) else f", {len(ex.mistakes)} wrong answers"
            print(f"{mark} {ex.lesson:<22} {name:<28} {ex.kind:<8} "
                  f"{time.perf_counter() - t:5.1f} s{extra}")
    for p in problems:
        print("PROBLEM:", p)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    print(f"{'OK' if not problems else 'FAILED'}: {summary} verified in "
          f"{time.perf_counter() - t0:.0f} s; {len(problems)} problems")
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="one line per exercise and question")
    v = sub.add_parser("verify", help="solutions pass, wrong answers fail, stubs are todo")
    v.add_argument("names", nargs="*")
    v.add_argument("--quiet", action="store_true", help="print only problems and the counts")
    s = sub.add_parser("solution", help="print a reference solution")
    s.add_argument("name")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for name, ex in catalogue().items():
            what = ex.asks if isinstance(ex, Question) else f"{ex.writes} (~{ex.lines} lines)"
            print(f"{ex.lesson:<22} {name:<28} {ex.kind:<8} {what}")
        return 0
    if args.cmd == "verify":
        return verify(args.names or None, verbose=not args.quiet)
    solution(args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
