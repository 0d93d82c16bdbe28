"""Predict, then measure: the guesses a lesson records and how ``reveal`` scores them."""
import pytest

from course_lib.exercises import predict as p


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(p, "_GUESSES", {})
    monkeypatch.setattr(p, "_SCORES", {})


def test_a_guess_is_scored_by_its_ratio(capsys):
    p.predict("bytes", 1000)
    assert p.reveal("bytes", 1050) == "spot on"
    p.predict("bytes", 1800)
    assert p.reveal("bytes", 1000).startswith("the right size (high by 1.80")
    p.predict("bytes", 100)
    assert p.reveal("bytes", 1000) == "10.0× too low"
    assert "you predicted 100" in capsys.readouterr().out


def test_no_guess_never_fails(capsys):
    p.predict("time", None)  # the stub as the notebook ships it
    assert p.reveal("time", 3.2, unit="ms") == "no prediction"
    out = capsys.readouterr().out
    assert "no prediction yet" in out and "time = 3.2 ms" in out


def test_bad_guesses_name_the_prediction():
    with pytest.raises(TypeError, match="'ratio'"):
        p.predict("ratio", "fast")
    with pytest.raises(ValueError, match="finite"):
        p.predict("ratio", float("inf"))


def test_signs_and_zero():
    assert p.score(-2.0, 1.0) == "the wrong sign"
    assert p.score(0.0, 0.0) == "spot on"
    assert p.score(0.5, 0.0) == "off by 0.5"


def test_the_scoreboard_lists_what_was_revealed(capsys):
    p.predict("a", 2)
    p.reveal("a", 2)
    board = p.scoreboard()
    assert board == {"a": (2.0, 2.0, "spot on")}
