"""python -m course_lib.serving: continuous against static batching on a GPU (throughput.py)."""
import sys

from course_lib.serving.throughput import main

if __name__ == "__main__":
    sys.exit(main())
