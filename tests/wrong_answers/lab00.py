"""Lab 00's classic mistakes (all-reduce from its halves, in torch and JAX; the ring's cost)."""
from wrong_answers import Wrong

WRONG = [
    Wrong("00", "ring_bytes", "value", "broadcast as the root's bytes", """\
def ring_bytes(op, V, N):
    if N == 1:
        return 0.0
    if op == "broadcast":
        return float(V)                              # the root's bytes, not the per-rank average
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V
""", "lab00.check_ring_bytes(ring_bytes)", "a broadcast priced at the root's V"),
    Wrong("00", "ring_bytes", "crash", "crash", """\
def ring_bytes(op, V, N):
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V / (N - 1) * (N - 1) if N > 1 else V / (N - 1)
""", "lab00.check_ring_bytes(ring_bytes)", "divides by N - 1 when N = 1", ("ZeroDivisionError",)),
]
