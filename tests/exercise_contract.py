"""What every exercise's check promises, tested the same way for each lab: the reference answer passes with ✅, and a
stub that raises ``NotImplementedError`` gets ⏳ "not implemented yet" with its idea, what the check will test and
where the hints are (no ❌, no crash). Also the right answers written another way that more than one test hands
a check."""
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


def storage_bytes_by_data_ptr(tensors):
    """Lab 02's ``storage_bytes`` written another way (storages told apart by their data pointer): a right answer."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total
