"""Checkpoints of the state's layout before it held optax's ScaleByAdamState.

Until then `SuperOffloadState` was one flat NamedTuple, `(count, mu, nu,
master, redone, skipped, row, kept_grads, mu_scales, nu_scales,
placement)`, which Orbax stores as a dict keyed by those names. Its
leaves, in order, are the leaves of today's state; only the grouping
changed. Orbax refuses to restore such a checkpoint into today's state
(the tree structures differ), so `legacy_layout` gives the target to
restore it into and `from_legacy_layout` today's state from what came back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from jax_superoffload._src.optim import state as state_lib

_IS_STATE = lambda x: isinstance(x, state_lib.SuperOffloadState)  # noqa: E731


def legacy_layout(tree: Any) -> Any:
  """`tree`, each `SuperOffloadState` in it laid out as before, as a dict.

  Use it as the Orbax restore target of a checkpoint written before the
  state held optax's `ScaleByAdamState`: the dict has the old field names
  (`placement` None, as Orbax stored it) and the leaves of `tree`, whose
  shardings and memory kinds the restored arrays then get.

  Args:
    tree: A pytree holding `SuperOffloadState`s (concrete, as from
      `tx.init(params)`, or abstract, as from `jax.eval_shape`).

  Returns:
    `tree` with every `SuperOffloadState` replaced by a dict of the fields
    of the old layout.
  """

  def old(x):
    if not _IS_STATE(x):
      return x
    fields = {n: getattr(x, n) for n in state_lib.LEGACY_FIELDS}
    fields['placement'] = None  # Static: not in the checkpoint.
    return fields

  return jax.tree.map(old, tree, is_leaf=_IS_STATE)


def from_legacy_layout(restored: Any, like: Any) -> Any:
  """`like`'s structure, with the states of `restored` (the old layout).

  Args:
    restored: What Orbax restored into `legacy_layout(like)`.
    like: The tree `legacy_layout` was given; each `SuperOffloadState` in
      it gives its placement to the state made from the dict in its place.

  Returns:
    `restored` with each old-layout dict made a `SuperOffloadState`.

  Raises:
    ValueError: If a dict in `restored` is not a state of the old layout,
      naming its path and keys.
  """

  def new(path, x, old):
    if not _IS_STATE(x):
      return old
    if not state_lib.is_legacy(old):
      keys = sorted(old) if isinstance(old, Mapping) else type(old).__name__
      raise ValueError(
        f'{jax.tree_util.keystr(path)} of the restored tree is not a state '
        f'of the old layout (the fields {sorted(state_lib.LEGACY_FIELDS)}):'
        f' got {keys}'
      )
    fields = {n: old[n] for n in state_lib.LEGACY_FIELDS}
    fields['placement'] = x.placement
    return state_lib.SuperOffloadState.of(**fields)

  return jax.tree.map_with_path(new, like, restored, is_leaf=_IS_STATE)
