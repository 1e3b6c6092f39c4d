"""optax's contracts, as an optax or Flax user relies on them.

Each test fails on the flat-bucket state of before: updates came back in
fp32, `tree_get(state, 'mu')` found no param-shaped tree, external params
were overwritten by the master, a foreign state of equal bucket sizes was
accepted, and a state was tied to its bucket size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload

EXECUTORS = ('ffi', 'stream', 'xla_host', 'device')


def tree(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  return {
    'w': jnp.asarray(rng.standard_normal((4, 6)), dtype),
    'b': jnp.asarray(rng.standard_normal((6,)), dtype),
    'layers': [jnp.asarray(rng.standard_normal((3, 5)), dtype)],
  }


def grads(params, seed=1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.1, x.dtype), params
  )


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.float16])
def test_updates_come_in_the_params_dtype(dtype):
  params = tree(dtype)
  tx = superoffload.adamw(1e-3)
  state = tx.init(params)

  @jax.jit
  def step(params, state, g, skip):
    # Skip-step wrappers select between the update and zeros.
    return jax.lax.cond(
      skip,
      lambda: (jax.tree.map(jnp.zeros_like, params), state),
      lambda: tx.update(g, state, params),
    )

  updates, _ = step(params, state, grads(params), False)
  for u, p in zip(
    jax.tree.leaves(updates), jax.tree.leaves(params), strict=True
  ):
    assert u.dtype == p.dtype


@pytest.mark.parametrize('executor', EXECUTORS)
def test_tree_get_and_tree_map_params(executor):
  params = tree()
  tx = superoffload.adamw(1e-3, executor=executor)
  state = tx.init(params)
  mu = optax.tree_utils.tree_get(state, 'mu')
  assert jax.tree.structure(mu) == jax.tree.structure(params)
  shapes = optax.tree_map_params(
    tx, lambda p: p.shape, state, transform_non_params=lambda _: None
  )
  for name in ('mu', 'nu', 'master'):
    assert getattr(shapes, name) == jax.tree.map(lambda p: p.shape, params)


@pytest.mark.parametrize('executor', EXECUTORS)
@pytest.mark.parametrize('stv', [False, True])
def test_params_changed_outside_the_optimizer_are_honoured(executor, stv):
  params = tree()
  kwargs = dict(clip_norm=1e3) if stv else {}
  tx = superoffload.adamw(1e-3, executor=executor, **kwargs)
  ref = optax.adamw(1e-3)
  state, ref_state = tx.init(params), ref.init(params)
  step = jax.jit(tx.update)
  u, state = step(grads(params, 1), state, params)
  params = optax.apply_updates(params, u)
  ru, ref_state = ref.update(grads(params, 1), ref_state, tree())
  # Weights loaded (or surgery, or an EMA swap) between steps.
  params = dict(params, w=jnp.full((4, 6), 3.0))
  u, state = step(grads(params, 2), state, params)
  got = optax.apply_updates(params, u)
  ru, _ = ref.update(grads(params, 2), ref_state, params)
  want = optax.apply_updates(params, ru)
  np.testing.assert_allclose(got['w'], want['w'], rtol=1e-6)
  assert np.all(np.abs(np.asarray(got['w']) - 3.0) <= 1.5e-3)  # One step.


def test_a_state_of_another_tree_is_refused():
  # Same sizes (and so the same buckets), other structure and shapes.
  tx = superoffload.adamw(1e-3)
  state = tx.init({'a': jnp.ones((24,)), 'b': jnp.ones((6,))})
  params = {'a': jnp.ones((4, 6)), 'b': jnp.ones((6,))}
  with pytest.raises(ValueError, match=r"\['a'\]"):
    tx.update(grads(params), state, params)
  params = {'x': jnp.ones((24,)), 'y': jnp.ones((6,))}
  with pytest.raises(ValueError, match='another parameter tree'):
    tx.update(grads(params), state, params)


@pytest.mark.parametrize('optimizer', ['adam', 'adamw'])
def test_optax_state_interchange_is_exact(optimizer):
  params = tree()
  ref = getattr(optax, optimizer)(1e-3)
  ref_state = ref.init(params)
  for i in range(3):
    u, ref_state = ref.update(grads(params, i), ref_state, params)
    params = optax.apply_updates(params, u)
  tx = getattr(superoffload, optimizer)(1e-3)
  ours = superoffload.import_adam_state(tx, params, ref_state)
  assert int(ours.count) == 3
  back = superoffload.export_adam_state(ours)
  adam = ref_state[0]
  for name in ('mu', 'nu'):
    for a, b in zip(
      jax.tree.leaves(getattr(back, name)),
      jax.tree.leaves(getattr(adam, name)),
      strict=True,
    ):
      np.testing.assert_array_equal(a, b)
  # And the run goes on as optax's would.
  u, _ = tx.update(grads(params, 9), ours, params)
  ru, _ = ref.update(grads(params, 9), ref_state, params)
  got = optax.apply_updates(params, u)
  want = optax.apply_updates(params, ru)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=2.5e-7)  # 2 fp32 ulps at 1.


def test_resume_with_another_bucket_size():
  params = tree()
  small = superoffload.adamw(1e-3, bucket_bytes=64)
  large = superoffload.adamw(1e-3, bucket_bytes=1 << 20)
  state = small.init(params)
  for i in range(2):
    u, state = small.update(grads(params, i), state, params)
    params = optax.apply_updates(params, u)
  a, _ = small.update(grads(params, 5), state, params)
  b, _ = large.update(grads(params, 5), state, params)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize('axis_type', ['Explicit', 'Auto'])
def test_fsdp_sharded_params_need_no_mesh_arguments(axis_type):
  # FSDP-style: `w` split over 8 devices (conftest's fake CPU devices).
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (8,), ('data',), axis_types=(getattr(AxisType, axis_type),)
  )
  rng = np.random.default_rng(0)
  params = {
    'w': jnp.asarray(rng.standard_normal((64, 16)), jnp.float32),
    'b': jnp.asarray(rng.standard_normal((16,)), jnp.float32),
  }
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)

  def loss(p):
    return jnp.mean(jnp.tanh(x @ p['w'] + p['b']) ** 2)

  def run(tx, params):
    state = tx.init(params)

    @jax.jit
    def step(p, s):
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return optax.apply_updates(p, u), s

    for _ in range(5):
      params, state = step(params, state)
    hlo = step.lower(params, state).compile().as_text()
    return params, state, hlo.count('all-gather(')

  fsdp = {
    'w': NamedSharding(mesh, P('data', None)),
    'b': NamedSharding(mesh, P()),
  }
  ours, state, ours_gathers = run(
    superoffload.adamw(1e-2), jax.device_put(params, fsdp)
  )
  _, _, optax_gathers = run(optax.adamw(1e-2), jax.device_put(params, fsdp))
  single, _, _ = run(
    superoffload.adamw(1e-2), jax.device_put(params, jax.devices()[0])
  )
  assert ours_gathers <= optax_gathers
  for name in ('mu', 'nu', 'master'):
    leaf = getattr(state, name)['w']
    assert leaf.sharding.memory_kind == 'pinned_host'
    assert leaf.addressable_shards[0].data.shape == (8, 16)
  assert ours['w'].addressable_shards[0].data.shape == (8, 16)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(single), strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
