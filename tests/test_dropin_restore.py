"""A state restored by Orbax steps as the fresh one did.

Each case runs one optax wrapper around `superoffload.adamw` six steps
uninterrupted, and three steps, an Orbax save, a restore into a new target
and three more steps. Every step function is jitted afresh (a new
function), as in a new process: a jit cache traced on the fresh state would
hide the restored state's types. The judge is the uninterrupted run, bit
for bit, and where the restored state lives.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_superoffload as superoffload

HOST = 'pinned_host'
_PARAMS = {'b': jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), 'w': jnp.arange(4.0)}


def _loss(params, x):
  return jnp.sum((params['w'] * x) ** 2) + jnp.sum(params['b'] ** 2 * x[0])


def _data(step: int) -> jax.Array:
  return jnp.linspace(0.5, 2.0, 4) * (1.0 + 0.25 * step)


def _adamw(lr=1e-2):
  return superoffload.adamw(lr, weight_decay=0.1)


_WRAPPERS = {
  'multi_steps': lambda: optax.MultiSteps(_adamw(), 2),
  'apply_if_finite': lambda: optax.apply_if_finite(_adamw(), 3),
  'inject_hyperparams': lambda: optax.inject_hyperparams(superoffload.adamw)(
    learning_rate=1e-2, weight_decay=0.1
  ),
  'chain_clip': lambda: optax.chain(optax.clip_by_global_norm(1.0), _adamw()),
  'masked': lambda: optax.masked(_adamw(), {'b': False, 'w': True}),
  'multi_transform': lambda: optax.multi_transform(
    {'so': _adamw(), 'sgd': optax.sgd(1e-2)}, {'b': 'sgd', 'w': 'so'}
  ),
  'schedule': lambda: optax.MultiSteps(
    _adamw(optax.linear_schedule(1e-2, 1e-3, 6)), 2
  ),
}


def _stepper(tx):
  """A newly jitted step (a new function: nothing traced before)."""

  def step(params, state, x):
    grads = jax.grad(_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def _run(tx, params, state, steps):
  step = _stepper(tx)
  for i in steps:
    params, state = step(params, state, _data(i))
  return params, state


def _target(kind: str, tx, trained):
  if kind == 'trained':  # A trained state's own shardings.
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, trained)
  if kind == 'concrete':
    return {'params': _PARAMS, 'state': tx.init(_PARAMS)}
  if kind == 'abstract':  # With the shardings of a fresh state.
    fresh = {'params': _PARAMS, 'state': tx.init(_PARAMS)}
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
  if kind == 'committed':  # Of parameters with a SingleDeviceSharding.
    params = jax.device_put(_PARAMS, jax.devices()[0])
    return {'params': params, 'state': tx.init(params)}
  # eval_shape: no shardings at all.
  return jax.eval_shape(lambda: {'params': _PARAMS, 'state': tx.init(_PARAMS)})


def _save_and_restore(tmp_path, tree, target):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'ckpt', tree)
    checkpointer.wait_until_finished()
    return checkpointer.restore(tmp_path / 'ckpt', target)


def _host_leaves(state) -> list:
  """The state's arrays of more than one element (the offloaded ones)."""
  return [x for x in jax.tree.leaves(state) if np.ndim(x) > 0]


@pytest.mark.parametrize(
  'kind', ['concrete', 'abstract', 'committed', 'trained']
)
@pytest.mark.parametrize('name', sorted(_WRAPPERS))
def test_restored_state_steps_as_the_uninterrupted_run(tmp_path, name, kind):
  tx = _WRAPPERS[name]()
  want, _ = _run(tx, _PARAMS, tx.init(_PARAMS), range(6))
  params, state = _run(tx, _PARAMS, tx.init(_PARAMS), range(3))
  trained = {'params': params, 'state': state}
  restored = _save_and_restore(tmp_path, trained, _target(kind, tx, trained))
  got, state = _run(tx, restored['params'], restored['state'], range(3, 6))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  # And the offloaded leaves are in host memory, typed so.
  for name_, restored_state in (
    ('restored', restored['state']),
    ('after', state),
  ):
    for x in _host_leaves(restored_state):
      if x.sharding.memory_kind == HOST:
        assert jax.typeof(x).memory_space == jax.memory.Space.Host, name_
  assert any(x.sharding.memory_kind == HOST for x in _host_leaves(state))


def _assert_placed_as_state_shardings(tx, params, state):
  shardings = superoffload.state_shardings(tx, params)
  kinds = [s.memory_kind for s in jax.tree.leaves(shardings)]
  assert HOST in kinds
  assert [x.sharding.memory_kind for x in jax.tree.leaves(state)] == kinds


@pytest.mark.parametrize('name', sorted(_WRAPPERS))
def test_state_restored_in_device_memory_is_refused_then_placed(tmp_path, name):
  # A target without shardings (jax.eval_shape, nnx.eval_shape) restores
  # in device memory. Stepped there, the state would silently cost the
  # device its memory: update refuses it, naming a leaf and the fix; the
  # fix (state_shardings) steps as the uninterrupted run, on the host.
  tx = _WRAPPERS[name]()
  want, _ = _run(tx, _PARAMS, tx.init(_PARAMS), range(6))
  params, state = _run(tx, _PARAMS, tx.init(_PARAMS), range(3))
  trained = {'params': params, 'state': state}
  restored = _save_and_restore(
    tmp_path, trained, _target('eval_shape', tx, trained)
  )
  with pytest.raises(ValueError, match=r'came in device memory.*state_shard'):
    _run(tx, restored['params'], restored['state'], range(3, 4))
  shardings = superoffload.state_shardings(tx, restored['params'])
  placed = jax.device_put(restored['state'], shardings)
  got, state = _run(tx, restored['params'], placed, range(3, 6))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  _assert_placed_as_state_shardings(tx, got, state)
