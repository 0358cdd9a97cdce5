"""Paged attention over the KV pool, one part per module (vLLM v1 keeps the same parts apart: the
metadata builder, the attention backend, cascade attention):

- :mod:`.metadata`: the step's :class:`~.metadata.AttentionMetadata`, built once per step by
  :func:`~.metadata.build_attention_metadata`, and the padding rules of batch-invariant calls;
- :mod:`.torch_attention`: the :class:`~.torch_attention.Attention` layer, on top of
  `torch.nn.functional.scaled_dot_product_attention` and torch's CPU flash kernel (or our paged kernel);
- :mod:`.cascade`: shared-prefix (cascade) decode attention, its groups and the log-sum-exp merge;
- :mod:`.numerics`: the cache key's name for the rules that decide the bits of the pool's K/V.

A step's batch lays the new tokens of its sequences one sequence after another. For each sequence:

    | computed (cached in the pool) | new (this step) |
    0                     num_computed_tokens        context_len = num_computed_tokens + num_new_tokens

Each new token attends causally to every token of its own sequence up to and including itself; in
a model's local (sliding-window) layers, to the last ``sliding_window`` of them only, itself included
(``AttentionMetadata.sliding``: the same calls with the window in their masks).

Invariants:
- Every layer first writes the K/V of ALL new tokens of the batch into the pool at `slot_mapping`, then
  reads each sequence's whole context back from the pool. A sequence may therefore read blocks another
  sequence of the same batch writes in this very step.
- Everything that depends only on the batch (slots, masks, groups) is built once per step by
  `build_attention_metadata`; the per-layer work is tensor ops only.
- Sequences with one new token (decode) are grouped into one padded SDPA call with a key-padding mask;
  each sequence with more new tokens (a prefill chunk) gets its own SDPA call with a causal mask offset by
  its cached length.
"""
