"""States compared across executors and scopes, the digest left out.

The `stream` executor's state keeps `weights_digest` (weights_digest.py),
which the other executors' lack, and which covers other leaves when
`overlap_scan` starts some of them in the loop: not a number of the step.
"""

from __future__ import annotations

from typing import Any

import jax

import jax_superoffload as superoffload
from jax_superoffload._src.optim import state as state_lib


def without_digest(tree: Any) -> Any:
  """`tree` with the digest of every state in it dropped.

  Of a `SuperOffloadState`, and of one held as a mapping (a Flax
  `nnx.State`), where its leaf becomes 0.
  """

  def drop(x):
    if isinstance(x, superoffload.SuperOffloadState):
      return state_lib.with_fields(x, weights_digest=None)
    return x

  is_state = lambda x: isinstance(x, superoffload.SuperOffloadState)  # noqa: E731
  tree = jax.tree.map(drop, tree, is_leaf=is_state)

  def named(path) -> bool:
    return any(
      getattr(k, 'key', getattr(k, 'name', None)) == 'weights_digest'
      for k in path
    )

  return jax.tree_util.tree_map_with_path(
    lambda path, x: 0 if named(path) else x, tree
  )
