"""Layer 2, communication: the raw collectives and the ledger that records every one of them.

Modules: :mod:`~course_lib.comm.ledger` (the record types, pure Python),
:mod:`~course_lib.comm.shim` (the flat all-gather / reduce-scatter, one torch-version shim),
:mod:`~course_lib.comm.torch_ledger` (c10d-level capture), :mod:`~course_lib.comm.jax_ledger`
(collectives read from compiled HLO text).
"""
