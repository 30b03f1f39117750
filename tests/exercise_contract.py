"""What every exercise's check promises, tested the same way for each lab: the reference answer passes with ✅, and a
stub that raises ``NotImplementedError`` gets ⏳ "not implemented yet" with its idea, what the check will test and
where the hints are (no ❌, no crash)."""
from __future__ import annotations


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise not done yet: the idea goes here")


def assert_right_passes_and_stub_waits(check, right, capsys) -> None:
    name = check.exercise.name
    assert check(right) is True
    assert f"✅ {name}:" in capsys.readouterr().out
    assert check(stub) is False
    out = capsys.readouterr().out
    assert f"⏳ {name}: not implemented yet — the idea goes here" in out
    assert "The check will test:" in out and f'checks.hint("{name}")' in out
