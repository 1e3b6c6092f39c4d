"""Ulysses sequence parallelism for attention.

`attention` runs multi-head attention on sequence-sharded `[B, S, H, D]`
arrays, switching to head sharding with an all-to-all around the local
attention; `seq_to_heads` and `heads_to_seq` are those all-to-alls, for use
inside a user's own `jax.shard_map`.
"""

from jax_superoffload._src.parallel.ulysses import attention
from jax_superoffload._src.parallel.ulysses import heads_to_seq
from jax_superoffload._src.parallel.ulysses import kv_repeat_factor
from jax_superoffload._src.parallel.ulysses import seq_to_heads

__all__ = [
  'attention',
  'heads_to_seq',
  'kv_repeat_factor',
  'seq_to_heads',
]
