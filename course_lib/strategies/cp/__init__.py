"""Context parallel (Lab 10): cut the *sequence* over ranks; attention, the one op that mixes positions, passes
the key/value blocks around a ring and merges the partial results with the online softmax ("Ring Attention with
Blockwise Transformers for Near-Infinite Context"; "The Ultra-Scale Playbook: Training LLMs on GPU Clusters").

:mod:`~course_lib.strategies.cp.torch` is ring attention with ``isend``/``recv`` on a process group (and a probe of
torch's own ``context_parallel``); :mod:`~course_lib.strategies.cp.jax` the same ring with ``ppermute`` in
``shard_map``. Vocabulary: a *block* is one rank's slice of the sequence; a block's attention result is ``(o, lse)``,
the output normalised over that block's keys and the log-sum-exp of its scores, row by row; *merge* combines two.
"""
