"""course_lib.bench.progress: the long cells' bars (on stderr, never stdout, which nbval compares)."""
from __future__ import annotations

import time

from course_lib.bench import progress


def test_bar_goes_to_stderr_and_counts_stages(capsys):
    with progress.bar(desc="calibrating", total=3, unit="stage") as b:
        for k in range(3):
            b.set_postfix_str(f"stage {k}")
            b.update(1)
    assert list(progress.bar([1, 2, 3], "measuring")) == [1, 2, 3]
    out, err = capsys.readouterr()
    assert out == "" and "calibrating" in err and "3/3" in err and "measuring" in err


def test_clock_shows_seconds_while_a_job_runs_and_returns_them(capsys):
    end = time.monotonic() + 0.6
    waited = progress.clock(lambda: time.monotonic() > end, "the two-node job", expect_s=2, poll_s=0.1)
    assert 0.6 <= waited < 2
    err = capsys.readouterr().err
    assert "the two-node job: 0 s elapsed (usually ~2 s)" in err
    try:
        progress.clock(lambda: False, "a hung job", expect_s=1, poll_s=0.05, timeout_s=0.2)
    except TimeoutError as e:
        assert "a hung job: not finished within 0.2 s" in str(e)
    else:
        raise AssertionError("no TimeoutError")
