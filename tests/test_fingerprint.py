"""course_lib.measure.fingerprint: equal bits give equal fingerprints; a swap, one ulp or a size change do not."""
import torch

from course_lib.measure.fingerprint import fingerprint, fingerprints


def test_fingerprint_sees_what_a_sum_misses():
    # multiples of 1/8 below 2**10: every partial sum is exact, so the sum is the same in any order (a randn
    # vector's sum can change when two elements swap: the reduction's order differs -- seen once in a run)
    a = torch.randint(-8000, 8000, (257,), generator=torch.Generator().manual_seed(0)).float() / 8
    swapped, ulp = a.clone(), a.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    ulp[100] = torch.nextafter(ulp[100], torch.tensor(float("inf")))
    assert fingerprint(a) == fingerprint(a.clone()) == fingerprint(a.view(1, 257))
    assert swapped.sum() == a.sum() and fingerprint(swapped) != fingerprint(a)
    assert fingerprint(ulp) != fingerprint(a)
    assert fingerprint(torch.zeros(3)) != fingerprint(torch.zeros(4))
    assert fingerprint(a.to(torch.bfloat16)) == fingerprint(a.to(torch.bfloat16).clone())


def test_fingerprints_of_a_model_in_parameter_order():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    names, fps = fingerprints(m)
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert fps.dtype == torch.int64 and fps.shape == (4,)
    assert fps.tolist() == [fingerprint(p) for p in m.parameters()]
