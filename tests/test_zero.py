"""ZeRO-style sharding of the host state (`mesh=`, `shard_axis=`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_superoffload as superoffload

STEPS = 50


def _params(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 3)
  return {
    # Each state leaf is split along its first dimension divisible by the
    # 8 shards (40 here); one with none (the scalar) stays replicated.
    'w1': jax.random.normal(k[0], (13, 40)) * 0.3,
    'b1': jnp.zeros(40),
    'w2': (jax.random.normal(k[1], (40, 5)) * 0.3).astype(dtype),
    'scale': jnp.ones(()),  # A scalar leaf: one element over 8 shards.
  }


def _batch():
  k = jax.random.split(jax.random.key(1), 2)
  return jax.random.normal(k[0], (64, 13)), jax.random.normal(k[1], (64, 5))


def _loss(p, x, y):
  h = jnp.tanh(x @ p['w1'] + p['b1'])
  out = h @ p['w2'].astype(jnp.float32) * p['scale']
  return jnp.mean((out - y) ** 2)


def _train(tx, params, x, y, steps):
  state = tx.init(params)

  @jax.jit
  def step(p, s, x, y):
    loss, g = jax.value_and_grad(_loss)(p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, x, y)
    losses.append(float(loss))
  return params, state, losses


def _mesh(shape=(8,), names=('data',), axis_type=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _single(tx_fn, steps=STEPS, dtype=jnp.float32):
  dev = jax.devices()[0]
  x, y = _batch()
  return _train(tx_fn(), jax.device_put(_params(dtype), dev), x, y, steps=steps)


def _sharded(tx_fn, mesh, steps=STEPS, dtype=jnp.float32, axis='data'):
  x, y = _batch()
  rep = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P(axis))
  return _train(
    tx_fn(mesh=mesh, shard_axis=axis),
    jax.device_put(_params(dtype), rep),
    jax.device_put(x, data),
    jax.device_put(y, data),
    steps=steps,
  )


def _max_diff(a, b):
  return max(
    float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def _adamw(**kw):
  return superoffload.adamw(1e-2, weight_decay=1e-3, bucket_bytes=1024, **kw)


@pytest.mark.parametrize('axis_type', [AxisType.Explicit, AxisType.Auto])
def test_zero_equals_single_device_after_50_steps(axis_type):
  p1, s1, l1 = _single(_adamw)
  pz, sz, lz = _sharded(_adamw, _mesh(axis_type=axis_type))
  np.testing.assert_allclose(lz, l1, rtol=1e-5)
  assert _max_diff(p1, pz) < 2e-6
  for a, b in zip(
    jax.tree.leaves(s1.master), jax.tree.leaves(sz.master), strict=True
  ):
    assert a.shape == b.shape  # Shaped like the parameter, not padded.
    np.testing.assert_allclose(np.asarray(b), a, atol=2e-6)
  assert int(sz.count) == STEPS
  assert lz[-1] < 0.5 * lz[0]


@pytest.mark.parametrize('steps', [0, 2])
@pytest.mark.parametrize('axis_type', [AxisType.Explicit, AxisType.Auto])
def test_each_device_holds_one_eighth_in_pinned_host(steps, axis_type):
  mesh = _mesh(axis_type=axis_type)
  _, state, _ = _sharded(_adamw, mesh, steps=steps)
  specs = {'w1': P(None, 'data'), 'b1': P('data'), 'w2': P('data')}
  for name, bucket in [
    (k, tree[k]) for tree in (state.master, state.mu, state.nu) for k in specs
  ]:
    assert bucket.sharding.memory_kind == 'pinned_host'
    spec = tuple(bucket.sharding.spec)
    assert spec + (None,) * (bucket.ndim - len(spec)) == tuple(specs[name]) + (
      None,
    ) * (bucket.ndim - len(specs[name]))
    shards = bucket.addressable_shards
    assert len(shards) == 8
    assert {s.device for s in shards} == set(mesh.devices.flat)
    for s in shards:
      assert s.data.nbytes * 8 == bucket.nbytes
      assert s.data.sharding.memory_kind == 'pinned_host'


def test_host_step_runs_per_shard_without_gathering_the_state():
  mesh = _mesh()
  tx = _adamw(mesh=mesh, shard_axis='data')
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  hlo = (
    jax.jit(lambda g, s, p: tx.update(g, s, p))
    .lower(grads, state, params)
    .compile()
    .as_text()
  )
  # Each per-device kernel call sees only its shard of every split leaf.
  calls = [
    line for line in hlo.splitlines() if 'custom_call_target="jax_super' in line
  ]
  results = ' '.join(re.search(r'= \(([^)]*)\)', c)[1] for c in calls)
  for local in ('f32[13,5]', 'f32[5]', 'f32[5,5]'):
    assert local in results, results
  for whole in ('f32[13,40]', 'f32[40]', 'f32[40,5]'):
    assert whole not in results, results
  # The state is never gathered: collectives move only device arrays.
  for line in hlo.splitlines():
    if re.search(r'(all-gather|all-reduce|all-to-all)\(', line):
      assert 'S(5)' not in line.split('=')[1].split('(')[0]


def test_bf16_params_and_stv_match_single_device():
  def tx_fn(**kw):
    return _adamw(clip_norm=0.5, skip_nonfinite=True, **kw)

  p1, s1, l1 = _single(tx_fn, steps=10, dtype=jnp.bfloat16)
  pz, sz, lz = _sharded(tx_fn, _mesh(), steps=10, dtype=jnp.bfloat16)
  assert int(sz.redone) == int(s1.redone) > 0
  assert pz['w2'].dtype == jnp.bfloat16
  np.testing.assert_allclose(lz, l1, rtol=1e-3)
  # Clipped Adam steps are sensitive to gradient rounding where |g| ~ eps;
  # the redone step still matches to within a small fraction of the lr.
  assert _max_diff(p1, pz) < 1e-3


def test_nonfinite_step_is_skipped_on_every_shard():
  mesh = _mesh()
  tx = _adamw(skip_nonfinite=True, mesh=mesh, shard_axis='data')
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = tx.init(params)
  grads = jax.tree.map(lambda p: np.ones(p.shape, np.float32), params)
  grads['w1'][3, 4] = np.nan
  grads = jax.device_put(grads, NamedSharding(mesh, P()))
  update = jax.jit(lambda g, s, p: tx.update(g, s, p))
  updates, new = update(grads, state, params)
  assert int(new.skipped) == 1 and int(new.count) == 0
  for u in jax.tree.leaves(updates):
    assert not np.asarray(u).any()
  # The state before the step is current again, bit for bit.
  before, after = state.current(), new.current()
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize('executor', ['xla_host', 'device', 'stream'])
def test_other_executors_shard_too(executor):
  def tx_fn(**kw):
    return _adamw(executor=executor, **kw)

  p1, _, _ = _single(tx_fn, steps=5)
  pz, sz, _ = _sharded(tx_fn, _mesh(), steps=5)
  assert _max_diff(p1, pz) < 1e-6
  assert all(
    b.sharding.memory_kind == 'pinned_host'
    for b in jax.tree.leaves(sz.mu)
    if b.ndim
  )


def test_device_buckets_are_sharded_on_the_device():
  def tx_fn(**kw):
    return _adamw(device_buckets=1, **kw)

  p1, _, _ = _single(tx_fn, steps=5)
  pz, sz, _ = _sharded(tx_fn, _mesh(), steps=5)
  assert _max_diff(p1, pz) < 1e-6
  kinds = [b.sharding.memory_kind for b in jax.tree.leaves(sz.master)]
  assert 'device' in kinds and 'pinned_host' in kinds


def test_mesh_with_a_sequence_axis():
  mesh = _mesh((4, 2), ('data', 'seq'))
  p1, _, _ = _single(_adamw, steps=10)
  pz, sz, _ = _sharded(_adamw, mesh, steps=10)
  assert _max_diff(p1, pz) < 1e-6
  for name in ('w1', 'b1', 'w2'):  # Split over 'data' (4), not 'seq'.
    b = sz.master[name]
    assert b.addressable_shards[0].data.size * 4 == b.size


def test_flax_nnx_optimizer():
  mesh = _mesh()

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(13, 16, rngs=rngs)
      self.b = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  def run(shard):
    model = Mlp(nnx.Rngs(0))
    kw = dict(mesh=mesh, shard_axis='data') if shard else {}
    where = NamedSharding(mesh, P()) if shard else jax.devices()[0]
    nnx.update(model, jax.device_put(nnx.state(model), where))
    opt = nnx.Optimizer(model, _adamw(**kw), wrt=nnx.Param)
    x, y = _batch()
    if shard:
      x, y = jax.device_put((x, y), NamedSharding(mesh, P('data')))

    @nnx.jit
    def step(model, opt, x, y):
      def loss(model):
        return jnp.mean((model(x) - y) ** 2)

      value, grads = nnx.value_and_grad(loss)(model)
      opt.update(model, grads)
      return value

    return [float(step(model, opt, x, y)) for _ in range(10)]

  np.testing.assert_allclose(run(True), run(False), rtol=1e-5)


def test_state_from_another_layout_is_rejected():
  mesh = _mesh()
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  state = _adamw().init(jax.device_put(_params(), jax.devices()[0]))
  with pytest.raises(ValueError, match='mesh'):
    _adamw(mesh=mesh, shard_axis='data').update(params, state, params)


@pytest.mark.parametrize(
  'kwargs, error, match',
  [
    (dict(shard_axis='data'), ValueError, 'go together'),
    (dict(mesh='mesh', shard_axis='data'), TypeError, 'jax.sharding.Mesh'),
    (dict(shard_axis='model'), ValueError, "'model' is not an axis"),
    (dict(shard_axis=3), TypeError, 'mesh axis name'),
  ],
)
def test_bad_mesh_arguments(kwargs, error, match):
  if 'mesh' not in kwargs and kwargs.get('shard_axis') != 'data':
    kwargs = dict(mesh=_mesh(), **kwargs)
  with pytest.raises(error, match=match):
    superoffload.adamw(1e-3, **kwargs)


@pytest.mark.parametrize('axis_type', [AxisType.Explicit, AxisType.Auto])
def test_params_sharded_over_a_model_axis(axis_type):
  mesh = _mesh((4, 2), ('data', 'model'), axis_type)
  x, y = _batch()
  params = _params()
  params['w1'], params['b1'] = params['w1'][:, :36], params['b1'][:36]
  params['w2'] = params['w2'][:36]
  specs = {'w1': P(None, 'model'), 'b1': P('model')}
  sharded = {
    k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P())))
    for k, v in params.items()
  }
  data = NamedSharding(mesh, P('data'))
  pz, _, _ = _train(
    _adamw(mesh=mesh, shard_axis='data'),
    sharded,
    jax.device_put(x, data),
    jax.device_put(y, data),
    steps=10,
  )
  dev = jax.devices()[0]
  p1, _, _ = _train(_adamw(), jax.device_put(params, dev), x, y, steps=10)
  assert _max_diff(p1, pz) < 1e-6
  assert pz['w1'].sharding.spec == P(None, 'model')


def test_replicated_state_bytes_are_what_each_device_holds_whole():
  mesh = _mesh()
  # w and v split over 8 devices; (3, 5) and the scalar have no dimension
  # divisible by 8 and stay whole on every device.
  params = {
    'w': jnp.ones((16, 6)),
    'odd': jnp.ones((3, 5)),
    's': jnp.ones(()),
    'v': jnp.ones(24),
  }
  whole = superoffload.replicated_state_bytes(params, mesh, 'data')
  assert whole == 12 * (15 + 1)
  state = superoffload.adamw(1e-3, mesh=mesh, shard_axis='data').init(params)
  device = mesh.devices.flat[0]
  held = sum(
    s.data.nbytes
    for tree in (state.master, state.mu, state.nu)
    for leaf in jax.tree.leaves(tree)
    for s in leaf.addressable_shards
    if s.device == device
  )
  total = 12 * sum(x.size for x in jax.tree.leaves(params))
  assert held == whole + (total - whole) // 8


@pytest.mark.parametrize('moments', ['bf16', '8bit'])
def test_replicated_state_bytes_with_low_precision_moments(moments):
  mesh = _mesh()
  # 8-bit: 'w' splits in whole blocks (256 elements a shard); 'v' splits
  # by 8 but not in whole blocks, so it stays whole, as 'odd' and 's' do.
  params = {
    'w': jnp.ones((16, 128)),
    'odd': jnp.ones((3, 5)),
    's': jnp.ones(()),
    'v': jnp.ones(24),
  }
  options = {
    'bf16': dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
    '8bit': dict(moments_8bit=True),
  }[moments]
  whole = superoffload.replicated_state_bytes(
    params, mesh, 'data', moments=moments
  )
  tx = superoffload.adamw(1e-3, mesh=mesh, shard_axis='data', **options)
  state = tx.init(params)
  fields = (state.master, state.mu, state.nu, state.mu_scales, state.nu_scales)
  device = mesh.devices.flat[0]
  held = sum(
    s.data.nbytes
    for leaf in jax.tree.leaves(fields)
    for s in leaf.addressable_shards
    if s.device == device
  )
  total = sum(x.nbytes for x in jax.tree.leaves(fields))
  assert whole > 0
  assert held == whole + (total - whole) // 8
