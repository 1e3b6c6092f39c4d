"""Orbax checkpoints converted between optax.adamw and superoffload.adamw.

Each run saves `{'params', 'opt_state'}` after three steps, the command
converts the checkpoint, and the other optimizer resumes it for three
more. The judge is the unconverted run's own continuation: the two
optimizers compute the same fp32 AdamW, a few roundings apart per step.
The count and moments themselves cross exactly, both ways.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_superoffload as superoffload
from jax_superoffload import convert_checkpoint

F32_EPS = float(np.finfo(np.float32).eps)
_PARAMS = {
  'b': jnp.linspace(-1.0, 1.0, 6).reshape(2, 3),
  'w': jnp.linspace(0.5, 2.0, 12).reshape(3, 4),
}
_MASK = {'b': False, 'w': True}
_SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 6)


def _loss(params, step):
  scale = 1.0 + 0.25 * step
  return sum(jnp.sum(jnp.sin(scale * v) ** 2) for v in jax.tree.leaves(params))


def _run(tx, params, state, steps):
  @jax.jit
  def step(params, state, i):
    updates, state = tx.update(jax.grad(_loss)(params, i), state, params)
    return optax.apply_updates(params, updates), state

  for i in steps:
    params, state = step(params, state, i)
  return params, state


def _save(path, params, state):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, {'params': params, 'opt_state': state})
    checkpointer.wait_until_finished()


def _restore(path, target):
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, target)


def _optax_tx(schedule, masked):
  return optax.adamw(
    _SCHEDULE if schedule else 1e-2,
    weight_decay=0.1,
    mask=_MASK if masked else None,
  )


def _ours_tx(schedule):
  return superoffload.adamw(_SCHEDULE if schedule else 1e-2, weight_decay=0.1)


def _assert_near(got, want, steps):
  for name in want:
    w = np.asarray(want[name])
    tol = 2 * steps * F32_EPS * np.max(np.abs(w))
    np.testing.assert_allclose(got[name], w, rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize('schedule', [False, True])
def test_an_optax_run_resumes_with_superoffload(tmp_path, schedule):
  theirs = _optax_tx(schedule, masked=False)
  want, _ = _run(theirs, _PARAMS, theirs.init(_PARAMS), range(6))
  params, state = _run(theirs, _PARAMS, theirs.init(_PARAMS), range(3))
  _save(tmp_path / 'optax', params, state)
  convert_checkpoint.main(
    [str(tmp_path / 'optax'), str(tmp_path / 'ours'), '--to', 'superoffload']
  )
  ours = _ours_tx(schedule)
  restored = _restore(
    tmp_path / 'ours', {'params': _PARAMS, 'opt_state': ours.init(_PARAMS)}
  )
  adam = restored['opt_state'].adam
  assert int(adam.count) == 3
  for name in ('mu', 'nu'):  # Exactly the moments optax saved.
    for a, b in zip(
      jax.tree.leaves(getattr(adam, name)),
      jax.tree.leaves(getattr(state[0], name)),
      strict=True,
    ):
      np.testing.assert_array_equal(a, b)
  assert {
    x.sharding.memory_kind for x in jax.tree.leaves(restored['opt_state'].mu)
  } == {'pinned_host'}
  got, _ = _run(ours, restored['params'], restored['opt_state'], range(3, 6))
  _assert_near(got, want, 6)


@pytest.mark.parametrize(('schedule', 'masked'), [(False, False), (True, True)])
def test_a_superoffload_run_resumes_with_optax(tmp_path, schedule, masked):
  ours = _ours_tx(schedule)
  if masked:
    ours = superoffload.adamw(_SCHEDULE, weight_decay=0.1, mask=_MASK)
  want, _ = _run(ours, _PARAMS, ours.init(_PARAMS), range(6))
  params, state = _run(ours, _PARAMS, ours.init(_PARAMS), range(3))
  _save(tmp_path / 'ours', params, state)
  flags = ['--schedule'] * schedule + ['--masked'] * masked
  convert_checkpoint.main(
    [str(tmp_path / 'ours'), str(tmp_path / 'optax'), '--to', 'optax', *flags]
  )
  theirs = _optax_tx(schedule, masked)
  restored = _restore(
    tmp_path / 'optax',
    {'params': _PARAMS, 'opt_state': theirs.init(_PARAMS)},
  )
  assert int(restored['opt_state'][0].count) == 3
  got, _ = _run(theirs, restored['params'], restored['opt_state'], range(3, 6))
  _assert_near(got, want, 6)


def test_there_and_back_is_exact(tmp_path):
  theirs = _optax_tx(schedule=True, masked=False)
  params, state = _run(theirs, _PARAMS, theirs.init(_PARAMS), range(3))
  _save(tmp_path / 'a', params, state)
  convert_checkpoint.main(
    [str(tmp_path / 'a'), str(tmp_path / 'b'), '--to', 'superoffload']
  )
  convert_checkpoint.main(
    [str(tmp_path / 'b'), str(tmp_path / 'c'), '--to', 'optax', '--schedule']
  )
  with ocp.StandardCheckpointer() as checkpointer:
    a, c = (
      checkpointer.restore(tmp_path / 'a'),
      checkpointer.restore(tmp_path / 'c'),
    )
  assert jax.tree.structure(a) == jax.tree.structure(c)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c), strict=True):
    np.testing.assert_array_equal(x, y)


def test_the_command_refuses_what_it_cannot_convert(tmp_path):
  ours = _ours_tx(False)
  _save(tmp_path / 'ours', _PARAMS, ours.init(_PARAMS))
  command = [sys.executable, '-m', 'jax_superoffload.convert_checkpoint']
  done = subprocess.run(
    [
      *command,
      str(tmp_path / 'ours'),
      str(tmp_path / 'x'),
      '--to',
      'superoffload',
    ],
    capture_output=True,
    text=True,
    check=False,
  )
  assert done.returncode != 0
  assert 'already holds superoffload.adamw state' in done.stderr
  (tmp_path / 'taken').mkdir()
  with pytest.raises(SystemExit, match='exists'):
    convert_checkpoint.main(
      [str(tmp_path / 'ours'), str(tmp_path / 'taken'), '--to', 'optax']
    )
