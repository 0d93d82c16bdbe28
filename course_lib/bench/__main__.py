"""python -m course_lib.bench SUBJECT [options]: SUBJECT is one of ``SUBJECTS`` below.

Each subject lives in its own module (course_lib/bench/<subject>.py) with a ``main(argv)``.
"""
import importlib
import sys

SUBJECTS = ("attention", "backward_forms", "cascade", "decode", "dropin", "fp8", "host", "kvquant",
            "matmul", "hbm", "memory", "hopper", "registers", "variants")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBJECTS:
        print(__doc__)
        return 2
    module = importlib.import_module(f"course_lib.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
