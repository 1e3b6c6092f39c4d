"""Checkpoints of Flax models of the state's flat layout of before restore.

The trainer resumes its own; an `nnx.state` one restores through
`legacy_layout` / `from_legacy_layout`. The old code wrote the fixtures
under tests/data (tests/data/make_legacy_*_ckpt.py say how).
"""

import pathlib
import shutil

import jax
import numpy as np
import optax
import pytest
from test_state_layout import fixture_module

import jax_superoffload as superoffload

_DATA = pathlib.Path(__file__).resolve().parent / 'data'


def _assert_params(model, name):
  """The model's parameters are those of the fixture `name`, bit for bit."""
  from flax import nnx

  want = np.load(_DATA / name)
  got = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
  assert sorted(want.files) == sorted(jax.tree_util.keystr(p) for p, _ in got)
  for path, x in got:
    np.testing.assert_array_equal(
      np.asarray(x), want[jax.tree_util.keystr(path)]
    )


def test_a_trainer_checkpoint_of_the_old_layout_resumes(tmp_path):
  """A trainer checkpoint the old code wrote (tests/data) resumes exactly.

  `make_legacy_trainer_ckpt.py` saved a Flax model and its nnx.Optimizer
  with the trainer's `RunCheckpointer`, old layout, and the parameters the
  old code had one step later; the resumed run has the same, bit for bit.
  """
  pytest.importorskip('orbax.checkpoint')
  from flax import nnx

  from experiments.trainer import checkpointing

  fixture = fixture_module('make_legacy_trainer_ckpt')
  shutil.copytree(_DATA / 'legacy_trainer_ckpt', tmp_path / 'ckpt')
  model, optimizer = fixture.build()
  ckpt = checkpointing.RunCheckpointer(tmp_path / 'ckpt')
  try:
    restored = ckpt.restore(2, nnx.state((model, optimizer)))
  finally:
    ckpt.close()
  nnx.update((model, optimizer), restored.state)
  assert int(optimizer.opt_state[1].count[...]) == 2
  fixture.step(model, optimizer, 2)
  _assert_params(model, 'legacy_trainer_next_params.npz')


def test_a_flax_nnx_checkpoint_of_the_old_layout_restores():
  """An Orbax checkpoint of `nnx.state` the old code wrote (tests/data).

  Restored through `legacy_layout` / `from_legacy_layout` into a fresh
  model and optimizer, the next step gives the parameters the old code
  had, bit for bit.
  """
  ocp = pytest.importorskip('orbax.checkpoint')
  from flax import nnx

  fixture = fixture_module('make_legacy_trainer_ckpt')
  model, optimizer = fixture.build()
  target = nnx.state((model, optimizer))
  ckptr = ocp.StandardCheckpointer()
  with pytest.raises(ValueError, match='tree structures do not match'):
    ckptr.restore(_DATA / 'legacy_nnx_ckpt', target)
  old = ckptr.restore(
    _DATA / 'legacy_nnx_ckpt', superoffload.legacy_layout(target)
  )
  nnx.update((model, optimizer), superoffload.from_legacy_layout(old, target))
  assert isinstance(optimizer.opt_state[1][0], optax.ScaleByAdamState)
  assert int(optimizer.opt_state[1][0].count[...]) == 2
  fixture.step(model, optimizer, 2)
  _assert_params(model, 'legacy_nnx_next_params.npz')
