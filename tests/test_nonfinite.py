"""course_lib.measure.nonfinite.NonFiniteWatch: one record per module call, in the order modules ran, per step."""
import pytest
import torch

from course_lib.measure.nonfinite import NonFiniteWatch


class Square(torch.nn.Module):
    def forward(self, x):
        return x * x


def test_records_name_the_module_where_inf_and_then_nan_appear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Square(), torch.nn.Linear(4, 2))
    with NonFiniteWatch(model, rank=3) as watch:
        model(torch.ones(1, 4))
        watch.next_step()
        model(torch.full((1, 4), 1e25))
    assert len(model[0]._forward_hooks) == 0                      # removed on exit
    step1 = [(r["call"], r["module"], r["inf"], r["nan"]) for r in watch.records if r["step"] == 1]
    assert [m for _, m, _, _ in step1] == ["0", "1", "2", "<root>"]    # children before their parent
    assert step1[1][2] and not step1[1][3]                          # Square overflowed to inf ...
    assert step1[2][3]                                              # ... and the next Linear made NaN
    assert all(r["rank"] == 3 and not (r["nan"] or r["inf"]) for r in watch.records if r["step"] == 0)


def test_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        NonFiniteWatch(lambda x: x)
