"""Every published number is generated from course_lib/data/, and every comparison names its
harness (course_lib.results).

- README.md's "Measured" table is exactly what ``readme_measured()``
  makes of the stored JSON, and a changed measurement makes it stale (the test fails, not the
  reader);
- every fact is quoted where it says: README, both languages of its decks, its lessons;
- every row of the README's table names the harness both of its sides were timed with, and the
  GPU, file and date of the stored run its numbers come from;
- no published fact comes from a stored run that a newer one measured again
  (``results.SUPERSEDED``), unless the text quotes it as a past run.
"""
import copy
import re

import pytest

from course_lib import results
from course_lib.bench import common


def test_readme_measured_table_is_what_the_data_gives():
    problems = results.readme_problems()
    assert not problems, "\n".join(problems)


def test_every_fact_is_quoted_where_it_says():
    problems = results.check()
    assert not problems, "\n".join(problems)


def test_a_changed_measurement_makes_the_readme_stale(monkeypatch):
    real = common.load_result

    def changed(name):
        data = real(name)
        if name == "dropin":
            data = copy.deepcopy(data)
            row = next(r for r in data["decode"] if (r["B"], r["N"]) == (1, 4096))
            row["ours_graph_us"] *= 1.5
        return data
    monkeypatch.setattr(common, "load_result", changed)
    assert results.readme_problems(), "a 1.5x slower decode left the README unchanged"


def _readme_rows():
    table = results.readme_measured()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 10
    header, body = rows[0], rows[1:]
    assert header == "| what | measured on | harness (both sides) | result |"
    return [tuple(cell.strip() for cell in line.strip("|").split(" | ")) for line in body]


def test_every_readme_row_names_its_harness():
    for what, run, harness, result in _readme_rows():
        assert harness, f"no harness: {what}"
        assert result, f"no result: {what}"


def test_every_readme_row_names_the_gpu_and_run_of_its_numbers():
    names = {path.name for path in results.DATA.glob("*.json")}
    for what, run, harness, result in _readme_rows():
        files = re.findall(r"`([\w.-]+\.json)`", run)
        assert files, f"no stored run named: {what}"
        for name in files:
            assert name in names, f"{what}: {name} is not in course_lib/data/"
            env = common.load_result(name.removesuffix(".json"))["environment"]
            assert env["gpu"].replace("NVIDIA ", "") in run, f"{what}: the GPU of {name}"
            assert env["date"][:10] in run, f"{what}: the date of {name}"


def test_the_readme_decode_rows_come_from_the_current_run():
    decode, in_group = [], False
    for row in _readme_rows():  # a decode row and the rows after it that say "the same"
        in_group = row[0].startswith("decode") or (in_group and row[0].startswith("the same"))
        if in_group:
            decode.append(row)
    assert len(decode) >= 6
    for what, run, harness, result in decode:
        if "paged_decode" in what:  # a same-run ratio that only the decode sweep measured
            assert "`decode.json`" in run
        else:
            assert "`dropin.json`" in run and "`decode.json`" not in run, what


def test_no_published_fact_comes_from_a_superseded_run():
    problems = results.superseded_problems()
    assert not problems, "\n".join(problems)


def test_the_superseded_check_catches_an_old_number():
    Fact = results.Fact
    old, new = ("decode.json:flash_decode",), ("dropin.json",)
    cases = {
        "old": (Fact("90%", ("README",), "data/decode.json", old), True),
        "old, quoted as past": (Fact("90%", ("README",), "data/decode.json", old,
                                     historical="'the earlier sweep measured'"), False),
        "undeclared part": (Fact("1.02", ("README",), "data/decode.json", ("decode.json",)),
                            True),
        "a part not measured again": (Fact("16%", ("README",), "data/decode.json",
                                           ("decode.json:flash_attn_v2",)), False),
        "whole file": (Fact("4.46 ms", ("README",), "data/compiled_prefill.json",
                            ("compiled_prefill.json",)), True),
        "current": (Fact("94%", ("README",), "data/dropin.json", new), False),
        "current, marked past": (Fact("94%", ("README",), "data/dropin.json", new,
                                      historical="'earlier'"), True),
    }
    for name, (fact, fails) in cases.items():
        problems = results.superseded_problems({"x": fact})
        assert bool(problems) == fails, (name, problems)


@pytest.mark.parametrize("key", ["drop_1_4k_graph", "drop_1_4k_cudnn_graph",
                                 "drop_1_4k_default", "drop_1_4k_cudnn"])
def test_decode_latencies_are_quoted_with_both_harnesses(key):
    fact = results.facts()[key]
    assert "README" in fact.where and "07_decoding" in fact.where
    assert ("graph" in fact.source) or ("eager" in fact.source)
