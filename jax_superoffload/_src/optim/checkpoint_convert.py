"""Checkpoints of an `optax.adamw` run in `superoffload.adamw` layout and back.

A checkpoint, read by Orbax without a target, is a tree of dicts, lists and
arrays. Two layouts are known:

- "plain": `{'params': P, 'opt_state': S, ...}`, as a loop saves its
  parameters and `tx.init(params)`'s state (the NamedTuples of either
  optimizer become dicts of their fields, a tuple a list, an empty state
  None);
- "maxtext": MaxText's saved train state, `{'params': {'params': P},
  'opt_state': S, 'step', ...}`, where optax's adam moments are keyed as
  the parameters (`{'params': P}`) and ours as `P`, and our state's empty
  fields are absent (optax's chain keeps its empty states as None).

The count and moments carry over exactly (fp32); the master weights of a
converted optax run are its parameters in fp32 (exact for fp32 weights;
16-bit weights start the master from their rounding, as `init` does).
Everything else in the checkpoint is kept as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src.optim import alias
from jax_superoffload._src.optim import interchange
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.optim.offload import Offload

LAYOUTS = ('plain', 'maxtext')


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where a layout keeps the parameters and how it keys adam's moments."""

  params_key: tuple[str, ...]  # The parameters within the checkpoint.
  optax_moment_key: tuple[str, ...]  # optax's mu within its own key.
  drops_empty: bool  # Our state's empty fields are absent (else None).


_LAYOUTS = {
  'plain': _Layout(('params',), (), drops_empty=False),
  'maxtext': _Layout(('params', 'params'), ('params',), drops_empty=True),
}


def _get(tree: Any, keys: tuple) -> Any:
  for key in keys:
    tree = tree[key]
  return tree


def _wrapped(tree: Any, keys: tuple) -> Any:
  for key in reversed(keys):
    tree = {key: tree}
  return tree


def is_ours(opt_state: Any) -> bool:
  """Whether a raw optimizer state is `superoffload.adamw`'s."""
  return isinstance(opt_state, dict) and {'adam', 'offload'} <= set(opt_state)


def _optax_adam(opt_state: Any) -> dict:
  """The raw `ScaleByAdamState` (`count`, `mu`, `nu`) of optax's adamw."""
  items = opt_state.values() if isinstance(opt_state, dict) else opt_state
  found = [
    s for s in items if isinstance(s, dict) and {'count', 'mu', 'nu'} <= set(s)
  ]
  if len(found) != 1:
    raise ValueError(
      'expected the state of optax.adamw (one part with count, mu and nu), '
      f'found {len(found)} such parts in an opt_state of '
      f'{type(opt_state).__name__}'
    )
  return found[0]


def to_superoffload(
  checkpoint: dict, layout: str = 'plain', offload: Offload | None = None
) -> dict:
  """`checkpoint` of an `optax.adamw` run, in `superoffload.adamw`'s layout.

  Args:
    checkpoint: The raw tree (Orbax without a target).
    layout: "plain" or "maxtext" (see the module).
    offload: The `Offload` options of the run that resumes it (its state's
      layout depends on them: the executor's digest, STV, 8-bit moments).

  Returns:
    The checkpoint with its `opt_state` replaced.
  """
  where = _layout(layout)
  source = checkpoint['opt_state']
  if is_ours(source):
    raise ValueError('the checkpoint already holds superoffload.adamw state')
  adam = _optax_adam(source)
  params = _get(checkpoint, where.params_key)
  mu, nu = (_get(adam[n], where.optax_moment_key) for n in ('mu', 'nu'))
  tx = alias.adamw(0.0, offload=offload)
  params = jax.tree.map(jnp.asarray, params)
  state = interchange.import_adam_state(
    tx, params, optax.ScaleByAdamState(jnp.asarray(adam['count']), mu, nu)
  )
  state = jax.tree.map(np.asarray, state)  # Saved from host arrays.
  return {**checkpoint, 'opt_state': _saved(state, where)}


def to_optax(
  checkpoint: dict,
  layout: str = 'plain',
  schedule: bool = False,
  masked: bool = False,
) -> dict:
  """`checkpoint` of a `superoffload.adamw` run, in `optax.adamw`'s layout.

  Args:
    checkpoint: The raw tree (Orbax without a target).
    layout: "plain" or "maxtext" (see the module).
    schedule: The resuming `optax.adamw` has a learning-rate schedule (its
      state then counts steps too); MaxText's always has.
    masked: The resuming `optax.adamw` has a weight-decay `mask`.

  Returns:
    The checkpoint with its `opt_state` replaced: count and moments as
    `superoffload.export_adam_state` gives them (current rows, 8-bit and
    bf16 moments decoded); the master weights are dropped.
  """
  where = _layout(layout)
  source = checkpoint['opt_state']
  if not is_ours(source):
    raise ValueError('the checkpoint holds no superoffload.adamw state')
  adam = interchange.export_adam_state(_ours_from_raw(source))
  count = np.asarray(adam.count)
  moments = {
    n: jax.tree.map(
      np.asarray, _wrapped(getattr(adam, n), where.optax_moment_key)
    )
    for n in ('mu', 'nu')
  }
  if layout == 'maxtext':
    schedule = True
  parts = [
    {'count': count, **moments},
    {'inner_state': None} if masked else None,
    {'count': count} if schedule else None,
  ]
  return {**checkpoint, 'opt_state': parts}


def _layout(name: str) -> _Layout:
  if name not in _LAYOUTS:
    raise ValueError(f'layout must be one of {LAYOUTS}, got {name!r}')
  return _LAYOUTS[name]


def _ours_from_raw(raw: dict) -> state_lib.SuperOffloadState:
  """A `SuperOffloadState` from its raw checkpoint dict."""
  offload = raw['offload']
  fields = {
    name: offload.get(name)
    for name in state_lib.OFFLOAD_FIELDS
    if name != 'placement'
  }
  return state_lib.SuperOffloadState.of(
    count=raw['adam']['count'],
    mu=raw['adam']['mu'],
    nu=raw['adam']['nu'],
    placement=None,
    **fields,
  )


def _saved(state: state_lib.SuperOffloadState, where: _Layout) -> Any:
  """Our state as the layout saves it."""
  if not where.drops_empty:
    return state
  return {
    'adam': {n: getattr(state.adam, n) for n in ('count', 'mu', 'nu')},
    'offload': {
      n: v
      for n in state_lib.OFFLOAD_FIELDS
      if n != 'placement' and (v := getattr(state.offload, n)) is not None
    },
  }
