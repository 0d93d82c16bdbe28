"""``./course gpu-check`` on a CPU: its lists of test files, its log, its table."""
import json
from pathlib import Path

from course_lib import gpu_check

TESTS = Path(__file__).parent


def test_every_test_file_is_on_one_list():
    """A new test file must say whether it runs the course's code on the GPU."""
    files = {p.name for p in TESTS.glob("test_*.py")}
    gpu, cpu = set(gpu_check.GPU_TESTS), set(gpu_check.CPU_TESTS)
    assert not gpu & cpu, f"on both lists: {sorted(gpu & cpu)}"
    assert files == gpu | cpu, (f"on no list: {sorted(files - gpu - cpu)}; "
                                f"listed but missing: {sorted(gpu | cpu - files)}")


def test_the_log_gives_one_outcome_per_test(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [("a", "call", "passed", ""), ("b", "setup", "skipped", "no GPU"),
             ("c", "call", "failed", "E assert 1 == 2"), ("d", "call", "passed", ""),
             ("d", "teardown", "failed", "E leak")]
    log.write_text("".join(json.dumps({"nodeid": n, "when": w, "outcome": o, "duration": 1.0,
                                       "message": m}) + "\n" for n, w, o, m in lines))
    found = gpu_check.outcomes(log)
    assert {n: o for n, (o, _, _) in found.items()} == {
        "a": "passed", "b": "skipped", "c": "failed", "d": "failed"}
    assert found["d"][1] == 2.0  # the phases' seconds add up


def test_the_stored_record_reads_as_a_table():
    """The record of the last GPU check (written on a GPU) holds what the table prints."""
    record = json.loads(gpu_check.RECORD.read_text())
    text = gpu_check.table(record)
    assert record["environment"]["gpu"] in text and "wall time" in text
    for name in ("tests", "notebooks", "exercises"):
        assert name in record["parts"]
