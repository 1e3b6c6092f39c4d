"""Checkpoints of the state's layout before it held optax's ScaleByAdamState.

Until then `SuperOffloadState` was one flat NamedTuple, `(count, mu, nu,
master, redone, skipped, row, kept_grads, mu_scales, nu_scales,
placement)`, which Orbax stores as a dict keyed by those names (a Flax
`nnx.State` holds it as such a mapping, without the None fields). Its
arrays are those of today's state; only the grouping changed. Orbax
refuses to restore such a checkpoint into today's state (the tree
structures differ), so `legacy_layout` gives the target to restore it into
and `from_legacy_layout` today's state from what came back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from jax_superoffload._src.optim import state as state_lib


def _grouped(x: Any) -> bool:
  """A state of today's layout: ours, or a mapping of it (`nnx.State`)."""
  if isinstance(x, state_lib.SuperOffloadState):
    return True
  return (
    isinstance(x, Mapping)
    and set(x) == {'adam', 'offload'}
    and isinstance(x['adam'], Mapping)
    and set(x['adam']) == set(state_lib.ADAM_FIELDS)
  )


def legacy_layout(tree: Any) -> Any:
  """`tree`, each `SuperOffloadState` in it laid out as before (flat).

  Use it as the Orbax restore target of a checkpoint written before the
  state held optax's `ScaleByAdamState`: each state becomes a dict with
  the old field names (`placement` None, as Orbax stored it) and the
  leaves of `tree`, whose shardings and memory kinds the restored arrays
  then get. A state inside a Flax `nnx.State` (a mapping with the keys
  `adam` and `offload`) becomes one mapping of the same type.

  Args:
    tree: A pytree holding states (concrete, as from `tx.init(params)` or
      `nnx.state(optimizer)`, or abstract, as from `jax.eval_shape`).

  Returns:
    `tree` with every state replaced by the flat mapping of its fields.
  """

  def old(x):
    if isinstance(x, state_lib.SuperOffloadState):
      fields = {n: getattr(x, n) for n in state_lib.LEGACY_FIELDS}
      fields['placement'] = None  # Static: not in the checkpoint.
      return fields
    if _grouped(x):
      flat = {**x['adam'], **x['offload']}
      flat.pop('weights_digest', None)
      return type(x)(flat)
    return x

  return jax.tree.map(old, tree, is_leaf=_grouped)


def _nothing(digest: Any) -> Any:
  """A `weights_digest` that matches no parameters, like `digest`."""
  return jax.tree.map(jax.numpy.zeros_like, digest)


def from_legacy_layout(restored: Any, like: Any) -> Any:
  """`like`'s structure, with the states of `restored` (the old layout).

  Args:
    restored: What Orbax restored into `legacy_layout(like)`.
    like: The tree `legacy_layout` was given; each `SuperOffloadState` in
      it gives its placement to the state made from the dict in its place.

  Returns:
    `restored` with each flat state grouped as `like`'s is.

  Raises:
    ValueError: If what `restored` holds in a state's place does not have
      the state's fields, naming its path and keys.
  """

  def new(path, x, old):
    if not _grouped(x):
      return old
    if isinstance(x, state_lib.SuperOffloadState):
      want = set(state_lib.LEGACY_FIELDS)
    else:
      want = (set(x['adam']) | set(x['offload'])) - {'weights_digest'}
    if not isinstance(old, Mapping) or set(old) != want:
      keys = sorted(old) if isinstance(old, Mapping) else type(old).__name__
      raise ValueError(
        f'{jax.tree_util.keystr(path)} of the restored tree is not a state '
        f'of the old layout (the fields {sorted(want)}): got {keys}'
      )
    if isinstance(x, state_lib.SuperOffloadState):
      # A digest matching nothing: the next step compares on the host.
      digest = _nothing(x.weights_digest)
      return state_lib.SuperOffloadState.of(
        **{**old, 'placement': x.placement, 'weights_digest': digest}
      )

    def regroup(part):
      return type(part)(
        {n: old[n] if n in old else _nothing(part[n]) for n in part}
      )

    return type(x)(
      {'adam': regroup(x['adam']), 'offload': regroup(x['offload'])}
    )

  return jax.tree.map_with_path(new, like, restored, is_leaf=_grouped)
