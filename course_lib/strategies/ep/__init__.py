"""Expert parallel (Lab 10): a mixture-of-experts layer whose experts live on different ranks; each token goes to
the ranks of its chosen experts and comes back, two all-to-alls ("GShard: Scaling Giant Models with Conditional
Computation and Automatic Sharding"; "Switch Transformers: Scaling to Trillion Parameter Models with Simple and
Efficient Sparsity"; "The Ultra-Scale Playbook: Training LLMs on GPU Clusters").

:mod:`~course_lib.strategies.ep.routing` is the pure part (top-k routing, capacity, who sends how many tokens to
whom); :mod:`~course_lib.strategies.ep.torch` the layer, unsharded and expert-parallel with ``all_to_all_single``;
:mod:`~course_lib.strategies.ep.jax` the same layer with ``jax.lax.all_to_all`` on GShard's fixed-size buffers.

Vocabulary: a *group* is the tokens one rank routes together (its local batch); each expert accepts at most
*capacity* ``C`` token copies per group; a copy past it is *dropped* (the layer adds nothing for it: in a
transformer the residual connection carries the token on). *Dispatch* sends each kept copy to its expert's rank,
*combine* brings the result back, weighted by the copy's gate.
"""
