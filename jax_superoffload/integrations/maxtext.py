"""MaxText's pre-train loop with `superoffload.adamw` as its optimizer.

    python -m jax_superoffload.integrations.maxtext <MaxText config> key=value

runs MaxText's own `maxtext.trainers.pre_train.train` main, as
`python -m maxtext.trainers.pre_train.train` would, with three changes
made by `apply()` (for a launcher of your own, call it before MaxText
builds its optimizer):

- `opt_type=adamw` builds `superoffload.adamw` with MaxText's own
  arguments (schedule, betas, eps, weight decay, its mask), wrapped as
  MaxText wraps it (spike skipping, frozen parameters);
- the state's shardings, which MaxText derives from its logical axis rules
  in device memory, put the state of `superoffload.adamw` in
  `pinned_host`, split as each parameter is (`superoffload.state_shardings`),
  so that MaxText's init makes it there, its checkpoints restore it there
  and its compiled train step steps it there, on every mesh;
- with `optimizer_memory_host_offload=true`, the step's move of the state
  to device memory leaves ours where it is (the flag keeps applying to the
  rest of the optimizer's state).

Tested with MaxText 0.2.5 (`TESTED_MAXTEXT`); `pip install
jax_superoffload[maxtext]` installs it and what its train path imports.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import types
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import optax

import jax_superoffload as superoffload

TESTED_MAXTEXT = ('0.2.5',)
# Marks what apply() replaced, so that a second apply() changes nothing.
_APPLIED = '_jax_superoffload_applied'


def apply(offload: superoffload.Offload | None = None) -> None:
  """Makes MaxText train with `superoffload.adamw`, its state on the host.

  Idempotent. Imports MaxText (only here).

  Args:
    offload: The `Offload` options of the optimizer MaxText builds
      (default `Offload()`).

  Raises:
    ImportError: MaxText is not installed.
  """
  from maxtext.optimizers import optimizers
  from maxtext.utils import maxtext_utils
  from maxtext.utils import maxtext_utils_nnx

  _check_version()
  if getattr(optimizers, _APPLIED, False):
    return
  ours: set[tuple] = set()  # Paths of our state's leaves, once placed.
  optimizers.optax = _optax_with_our_adamw(offload or superoffload.Offload())
  maxtext_utils.get_abstract_state = _placing_our_state(
    maxtext_utils.get_abstract_state, maxtext_utils_nnx, ours
  )
  maxtext_utils_nnx.move_memory_to_device = _keeping_ours_on_host(
    maxtext_utils_nnx.move_memory_to_device, ours
  )
  setattr(optimizers, _APPLIED, True)


def _check_version() -> None:
  version = importlib.metadata.version('maxtext')
  if version not in TESTED_MAXTEXT:
    warnings.warn(
      f'jax_superoffload.integrations.maxtext is tested with MaxText '
      f'{", ".join(TESTED_MAXTEXT)}, not {version}',
      stacklevel=3,
    )


def _optax_with_our_adamw(offload: superoffload.Offload) -> types.ModuleType:
  """Optax as MaxText's optimizer module sees it: `adamw` is ours."""
  module = types.ModuleType('optax', optax.__doc__)
  module.__dict__.update(vars(optax))
  module.adamw = functools.partial(superoffload.adamw, offload=offload)
  return module


def _placing_our_state(
  get_abstract_state: Callable[..., tuple], nnx_utils: Any, ours: set
) -> Callable[..., tuple]:
  """MaxText's `get_abstract_state`, our state's shardings in host memory."""

  @functools.wraps(get_abstract_state)
  def placed(config, mesh, init_state_fn, is_training=True):
    abstract, annotations, shardings = get_abstract_state(
      config, mesh, init_state_fn, is_training
    )
    if not is_training:
      return abstract, annotations, shardings
    from flax import nnx

    optimizer = nnx.eval_shape(init_state_fn).optimizer
    params = abstract.model.filter(nnx.Param)
    ours_by_path = {
      _plain(path): s
      for path, s in jax.tree_util.tree_leaves_with_path(
        superoffload.state_shardings(optimizer.tx, params)
      )
    }
    shardings.optimizer.opt_state = _with_ours(
      shardings.optimizer.opt_state, ours_by_path, ours
    )
    abstract = nnx_utils.set_named_sharding_nnx(abstract, shardings)
    return abstract, annotations, shardings

  return placed


def _with_ours(opt_state: Any, ours_by_path: dict, ours: set) -> Any:
  """MaxText's shardings of the optimizer state, ours where it is ours.

  Ours are `superoffload.state_shardings`' own: the parameter's split, in
  `pinned_host` where the state lives on the host, typed with the mesh's
  axes explicit so that the compiled step reads the split and steps each
  shard where it lives (on MaxText's auto axes it would gather the state
  around the host step); the other leaves keep MaxText's.
  """
  paths = {
    _plain(path) for path, _ in jax.tree_util.tree_leaves_with_path(opt_state)
  }
  missing = set(ours_by_path) - paths
  if missing:
    raise ValueError(
      'MaxText lays out the optimizer state otherwise than '
      f'superoffload.state_shardings: {sorted(missing)[:3]} not found'
    )

  def pick(path, sharding):
    found = ours_by_path.get(_plain(path))
    if found is None:
      return sharding
    if found.memory_kind == 'pinned_host':
      ours.add(_plain(path))
    return found

  return jax.tree_util.tree_map_with_path(pick, opt_state)


def _keeping_ours_on_host(
  move_memory_to_device: Callable[[tuple, Any], Any], ours: set
) -> Callable[[tuple, Any], Any]:
  """MaxText's move of the optimizer state to the device, ours left alone."""

  @functools.wraps(move_memory_to_device)
  def moved(path, sharding):
    if _ours(path, ours):
      return sharding
    return move_memory_to_device(path, sharding)

  return moved


def _ours(path: tuple, ours: set) -> bool:
  """Whether `path` (from the optimizer's root) ends in one of ours."""
  plain = _plain(path)
  return any(plain[-len(p) :] == p for p in ours if len(p) <= len(plain))


def _plain(path: Sequence[Any]) -> tuple:
  """A tree path as names and indices, whatever node types made it.

  nnx's `State` keys the fields of a NamedTuple and the items of a tuple
  by name and index, where the optax tree has attributes and positions;
  the attribute by which a Variable holds its leaf (`.value`) is dropped,
  as a leaf outside a Variable has none.
  """
  out = []
  for key in path:
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name == 'value':
      continue
    for attr in ('name', 'key', 'idx'):
      if hasattr(key, attr):
        out.append(getattr(key, attr))
        break
  return tuple(out)


def main(argv: Sequence[str] | None = None) -> None:
  """Runs MaxText's pre-train main, as its own module, after `apply()`."""
  from absl import app
  from maxtext.trainers.pre_train import train

  apply()
  argv = list(sys.argv if argv is None else argv)
  app.run(train.main, argv=[train.__file__, *argv[1:]])


if __name__ == '__main__':
  main()
