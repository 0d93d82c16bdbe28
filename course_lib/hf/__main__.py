"""python -m course_lib.hf [--compiled] [--out DIR]: the capstone's GPU runs
(``course_lib.hf.capstone.main``)."""
from course_lib.hf.capstone import main

raise SystemExit(main())
