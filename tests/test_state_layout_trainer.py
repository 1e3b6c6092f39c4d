"""The trainer resumes a checkpoint of the state's layout before issue 34.

The fixture under tests/data was written by the old code
(tests/data/make_legacy_trainer_ckpt.py says how).
"""

import pathlib
import shutil

import jax
import numpy as np
import pytest
from test_state_layout import fixture_module

_DATA = pathlib.Path(__file__).resolve().parent / 'data'


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
  want = np.load(_DATA / 'legacy_trainer_next_params.npz')
  got = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
  assert sorted(want.files) == sorted(jax.tree_util.keystr(p) for p, _ in got)
  for path, x in got:
    np.testing.assert_array_equal(
      np.asarray(x), want[jax.tree_util.keystr(path)]
    )
