"""Every published number is generated from course_lib/data/, and every comparison names its
harness (course_lib.results).

- README.md's "Measured" table is exactly what ``readme_measured()``
  makes of the stored JSON, and a changed measurement makes it stale (the test fails, not the
  reader);
- every fact is quoted where it says: README, both languages of its decks, its lessons;
- every row of the README's table names the harness both of its sides were timed with.
"""
import copy

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
        if name == "decode":
            data = copy.deepcopy(data)
            row = next(r for r in data["rows"] if (r["B"], r["N"]) == (1, 4096))
            rec = row["results"]["flash_decode"]
            rec["us"], rec["ms"] = rec["us"] * 1.5, rec["ms"] * 1.5
        return data
    monkeypatch.setattr(common, "load_result", changed)
    assert results.readme_problems(), "a 1.5x slower decode left the README unchanged"


def test_every_readme_row_names_its_harness():
    table = results.readme_measured()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 10
    header, body = rows[0], rows[1:]
    assert "harness" in header
    for line in body:
        what, harness, result = (cell.strip() for cell in line.strip("|").split(" | "))
        assert harness, f"no harness: {line}"
        assert result, f"no result: {line}"


@pytest.mark.parametrize("key", ["decode_4k_graph_us", "decode_4k_cudnn_graph_us",
                                 "decode_4k_eager_us", "decode_4k_cudnn_eager_us"])
def test_decode_latencies_are_quoted_with_both_harnesses(key):
    fact = results.facts()[key]
    assert "README" in fact.where and "07_decoding" in fact.where
    assert ("graph" in fact.source) or ("eager" in fact.source)
