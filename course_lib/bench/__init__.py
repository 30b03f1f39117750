"""The bench layer, benchmarks and measurements: ``python -m course_lib bench WHAT`` runs ``bench/WHAT.py``'s ``main``.

:mod:`~course_lib.bench.wire` measures what crosses the wire (loopback counters, the α-β sweep);
:mod:`~course_lib.bench.launch` the launcher; :mod:`~course_lib.bench.fsdp` ours vs FSDP2 vs DDP.
"""
