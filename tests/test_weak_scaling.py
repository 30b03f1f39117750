"""Weak scaling's formulas and table (course_lib.bench.weak_scaling); the measured rows run in
tests/test_readme_commands.py::test_bench_weak_scaling_tiniest and in Lab 08."""
import pytest

from course_lib.bench import weak_scaling as ws


def test_paper_bytes_are_the_ring_formulas():
    assert ws.paper_bytes("ddp", 1000, 1) == 0 == ws.paper_bytes("fsdp2", 1000, 1)
    assert ws.paper_bytes("ddp", 1000, 4) == 2 * 3 / 4 * 1000 * 4
    assert ws.paper_bytes("fsdp2", 1000, 4) == 3 * 3 / 4 * 1000 * 4
    assert ws.paper_bytes("fsdp2", 1000, 4, elem=2) == 3 * 3 / 4 * 1000 * 2                 # bf16
    # weak scaling: bytes per rank are bounded as ranks are added (8Ψ and 12Ψ in fp32)
    assert ws.paper_bytes("ddp", 1000, 10**6) < 8000 and ws.paper_bytes("fsdp2", 1000, 10**6) < 12000
    assert ws.paper_bytes("fsdp2", 1000, 4) / ws.paper_bytes("fsdp2", 1000, 2) == pytest.approx(1.5)


@pytest.mark.parametrize("args, match", [(("zero3", 10, 2), r"strategy='zero3' must be one of \('ddp', 'fsdp2'\)"),
                                         (("ddp", 10, 0), r"n=0 must be an int >= 1"),
                                         (("ddp", -1, 2), r"psi=-1 >= 0")])
def test_bad_input_names_the_value(args, match):
    with pytest.raises(ValueError, match=match):
        ws.paper_bytes(*args)


def test_row_refuses_a_bad_batch_before_starting_ranks():
    with pytest.raises(ValueError, match=r"batch=0 and ranks=2 must be >= 1"):
        ws.row("ddp", None, 2, 0)


def test_table_shows_the_clock_only_when_asked():
    r1 = ws.Row("ddp", 1, 4, {"all_reduce": 2}, 0.0, 0.0, 0.0, 1600, 1600.0, 0.010, 100, 100)
    r2 = ws.Row("ddp", 2, 4, {"all_reduce": 2}, 400.0, 400.0, 400.0, 1600, 1600.0, 0.020, 100, 100)
    quiet, timed = ws.format_table([r1, r2]), ws.format_table([r1, r2], times=True)
    assert "step ms" not in quiet and "step ms" in timed
    assert timed.splitlines()[-1].split()[-3:] == ["20.0", "400", "50%"]      # 8 sequences / 20 ms; 10 / 20 ms
