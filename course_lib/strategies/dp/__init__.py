"""Data parallel (Lab 01): every rank holds the whole model, computes on its slice of the batch, and the
gradients are averaged. :mod:`~course_lib.strategies.dp.torch` has the naive version and the bucketed one;
Lab 01 writes the JAX version in the notebook itself (a ``pmean`` inside ``shard_map``), so there is no
``jax`` module here.
"""
