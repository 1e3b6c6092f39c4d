"""Every mesh kind that optax's adamw runs on.

Explicit-axes meshes (an eager step, a jitted init's types), a user's own
`shard_map` (init and update inside it), and Flax NNX's `nnx.Optimizer` on
an Auto mesh (built eagerly, inside `nnx.jit` and under `nnx.eval_shape`
on the abstract mesh, with its own optimizer sharding, on one device).
Each is judged against optax's adamw run the same way: the same math in
fp32, so the weights may differ by a few roundings per step, and the
losses of a model by at most 1e-5 relative.
"""

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

F32_EPS = float(np.finfo(np.float32).eps)
HOST = 'pinned_host'
LR, WD = 1e-2, 1e-4
STEPS = 3


def _mesh(axis_type, shape=(8,), names=('x',)):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _tree(mesh, seed=0):
  """Params (or gradients) split over the mesh's axis 'x', f32."""
  rng = np.random.default_rng(seed)
  specs = {'w': P(None, 'x'), 'b': P('x'), 'k': P()}
  shapes = {'w': (3, 8), 'b': (16,), 'k': (5,)}
  return {
    k: jax.device_put(
      jnp.asarray(rng.standard_normal(shapes[k]), jnp.float32),
      NamedSharding(mesh, specs[k]),
    )
    for k in specs
  }


def _assert_near_optax(ours, theirs, steps):
  # Each step may round the new weight differently (by up to an ulp of the
  # weight, plus one of the update): 2 ulps of the largest weight per step.
  for name in theirs:
    want = np.asarray(theirs[name])
    tol = 2 * steps * F32_EPS * np.max(np.abs(want))
    np.testing.assert_allclose(ours[name], want, rtol=0, atol=tol, err_msg=name)


def _memory_kinds(state):
  return {
    x.sharding.memory_kind for x in jax.tree.leaves(state) if np.ndim(x) > 0
  }


# 1. Explicit axes.


def _steps(tx, params, grads, jit):
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  for g in grads:
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def test_an_eager_step_on_explicit_axes_is_the_jitted_one():
  # Its shard_map ran eagerly and refused the move to host memory.
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = _tree(mesh)
    grads = [_tree(mesh, seed) for seed in range(1, STEPS + 1)]
    tx = superoffload.adamw(LR, weight_decay=WD)
    eager, state = _steps(tx, params, grads, jit=False)
    jitted, _ = _steps(tx, params, grads, jit=True)
    theirs, _ = _steps(optax.adamw(LR, weight_decay=WD), params, grads, False)
  for name in params:  # One kernel, one program: the same bits.
    np.testing.assert_array_equal(eager[name], jitted[name], err_msg=name)
  _assert_near_optax(eager, theirs, STEPS)
  assert _memory_kinds(optax.tree_utils.tree_get(state, 'mu')) == {HOST}


@pytest.mark.parametrize('how', ['follow', 'zero'])
def test_a_jitted_init_types_its_state_as_an_eager_init(how):
  # out_shardings placed the jitted init's zero moments but left their
  # split out of their types (float32<host>[3,8] for [3,8@x]).
  mesh = _mesh(AxisType.Explicit)
  kw = {'mesh': mesh, 'shard_axis': 'x'} if how == 'zero' else {}
  tx = superoffload.adamw(LR, **kw)
  with jax.set_mesh(mesh):
    params = _tree(mesh)
    eager = jax.tree.map(jax.typeof, tx.init(params))
    jitted = jax.tree.map(jax.typeof, jax.jit(tx.init)(params))
  assert str(jitted) == str(eager)
  assert jitted == eager
  moments = optax.tree_utils.tree_get(jitted, 'mu')
  assert {str(t.memory_space) for t in jax.tree.leaves(moments)} == {
    'MemorySpace.Host'
  }


# 2. A user's own shard_map.


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize('axis_type', [AxisType.Explicit, AxisType.Auto])
def test_init_and_update_inside_a_users_shard_map(axis_type, jit):
  # init there asked for a sharding on one device ("incompatible devices").
  mesh = _mesh(axis_type)
  rng = np.random.default_rng(0)
  split = NamedSharding(mesh, P('x'))
  params, *grads = [
    jax.device_put(jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), split)
    for _ in range(STEPS + 1)
  ]
  results = {}
  for name, tx in [
    ('ours', superoffload.adamw(LR, weight_decay=WD)),
    ('optax', optax.adamw(LR, weight_decay=WD)),
  ]:

    def train(p, *gs, tx=tx):
      s = tx.init(p)
      for g in gs:
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
      return p, s

    block = jax.ShapeDtypeStruct((1, 4), jnp.float32)
    with jax.set_mesh(mesh):
      specs = jax.tree.map(
        lambda a: P() if a.ndim == 0 else P('x'),
        jax.eval_shape(train, *[block] * (STEPS + 1)),
      )
      f = jax.shard_map(train, mesh=mesh, in_specs=P('x'), out_specs=specs)
      results[name] = (jax.jit(f) if jit else f)(params, *grads)
  (ours, state), (theirs, _) = results['ours'], results['optax']
  _assert_near_optax({'p': ours}, {'p': theirs}, STEPS)
  if jit:  # Eager shard_map assembles its outputs in device memory.
    assert _memory_kinds(optax.tree_utils.tree_get(state, 'mu')) == {HOST}


# 3. Flax NNX's Optimizer on an Auto mesh.


class _Model(nnx.Module):
  """Flax's SPMD guide's DotReluDot, with biases, one unannotated."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(
      8,
      16,
      kernel_init=nnx.with_partitioning(init, (None, 'model')),
      bias_init=nnx.with_partitioning(
        nnx.initializers.zeros_init(), ('model',)
      ),
      rngs=rngs,
    )
    self.w2 = nnx.Param(
      init(rngs.params(), (16, 4)), out_sharding=('model', None)
    )
    self.b2 = nnx.Param(jnp.zeros((4,)))

  def __call__(self, x):
    return nnx.relu(self.dot1(x)) @ self.w2[...] + self.b2[...]


def _mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _nnx_run(tx_fn, built, mesh, x, y, steps=10):
  def create():
    model = _Model(nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx_fn(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_mse)(model, x, y)
    optimizer.update(model, grads)
    return loss

  with jax.set_mesh(mesh):
    model, optimizer = nnx.jit(create)() if built == 'jit' else create()
    losses = [float(step(model, optimizer, x, y)) for _ in range(steps)]
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    abstract = nnx.eval_shape(create)[1]
  params = {
    '/'.join(map(str, k)): np.asarray(v)
    for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }
  return np.array(losses), params, optimizer, abstract


def _shapes(optimizer):
  state = nnx.state(optimizer.opt_state)
  return jax.tree.map(lambda v: (v.shape, v.dtype), state)


def test_nnx_optimizer_built_eagerly_on_an_auto_mesh_is_refused_with_a_fix():
  # Built eagerly, nnx.Optimizer's own sharding constraint (it names no
  # memory kind) moves the state of annotated parameters to device
  # memory: the step says so and how to place it, rather than keep it
  # there unannounced. Built in nnx.jit (the fix it names), it steps as
  # optax's with the state in host memory (the test below).
  mesh = _mesh(AxisType.Auto, (2, 4), ('data', 'model'))
  x = jnp.ones((8, 8), jnp.float32)
  with pytest.raises(ValueError, match=r'device memory.*nnx\.jit'):
    _nnx_run(lambda: superoffload.adamw(LR), 'eager', mesh, x, x[:, :4], 1)


@pytest.mark.parametrize('built', ['jit'])
def test_nnx_optimizer_on_an_auto_mesh_steps_as_optax(built):
  # Under set_mesh with auto axes, a jitted init asked for one device, and
  # every step's shard_map over the state's explicit mesh was refused.
  mesh = _mesh(AxisType.Auto, (2, 4), ('data', 'model'))
  rng = np.random.default_rng(0)
  data = NamedSharding(mesh, P('data'))
  x = jax.device_put(
    jnp.asarray(rng.standard_normal((8, 8)), jnp.float32), data
  )
  y = jax.device_put(
    jnp.asarray(rng.standard_normal((8, 4)), jnp.float32), data
  )
  ours = _nnx_run(lambda: superoffload.adamw(LR), built, mesh, x, y)
  theirs = _nnx_run(lambda: optax.adamw(LR), built, mesh, x, y)
  np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=0)
  assert theirs[0][-1] < 0.75 * theirs[0][0]  # It trains.
  for name, want in theirs[1].items():
    tol = 1e-5 * np.max(np.abs(want))
    np.testing.assert_allclose(ours[1][name], want, rtol=0, atol=tol)
  # The abstract optimizer (a restore target) is the concrete one's shape.
  assert _shapes(ours[3]) == _shapes(ours[2])
  assert _memory_kinds(nnx.state(ours[2].opt_state)) == {HOST}


def _assert_split(x, mesh, spec):
  """`x` split as Flax's metadata says: in its memory (host for ours)."""
  kind = x.sharding.memory_kind
  assert x.sharding.is_equivalent_to(
    NamedSharding(mesh, P(*spec), memory_kind=kind), ndim=2
  )


def _optimizer(model, tx, eager):
  """`nnx.Optimizer(model, tx)`, built eagerly or inside `nnx.jit`."""
  if eager:
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx.jit(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(model)


def test_nnx_optimizer_with_its_own_optimizer_sharding():
  # Flax's test_separate_opt_sharding (tests/nnx/spmd_test.py), swapped.
  mesh = _mesh(AxisType.Auto, (2, 2, 2), ('row', 'col', 'rest'))
  kernels = []
  # Ours built in nnx.jit: eagerly, Flax's constraint moves the state to
  # device memory, which the step refuses (checked first).
  runs = [
    (superoffload.adam(1e-3), True),
    (superoffload.adam(1e-3), False),
    (optax.adam(1e-3), True),
  ]
  for tx, eager in runs:
    with jax.set_mesh(mesh):
      model = nnx.Linear(
        4,
        2,
        rngs=nnx.Rngs(0),
        kernel_metadata={'optimizer_sharding': ('row', 'col')},
      )
      optimizer = _optimizer(model, tx, eager)
      assert model.kernel.sharding.is_equivalent_to(
        NamedSharding(mesh, P()), ndim=2
      )
      _assert_split(optimizer.opt_state[0].mu['kernel'], mesh, ('row', 'col'))

      def loss(model, x):
        return jnp.sum(model(x))

      def train_step(model, x, optimizer=optimizer):
        grads = jax.grad(loss)(model, x)
        optimizer.update(model, grads)

      if eager and tx is runs[0][0]:
        with pytest.raises(ValueError, match='came in device memory'):
          train_step(model, jnp.ones(4))
        continue
      train_step(model, jnp.ones(4))
      train_step(model, jnp.ones(4))
    kernels.append(np.asarray(model.kernel[...]))
  _assert_near_optax({'kernel': kernels[0]}, {'kernel': kernels[1]}, 2)


def test_nnx_optimizer_on_a_one_device_mesh():
  # Flax's test_logical_rules on a (1, 1, 1) mesh: the state was on our own
  # one-device mesh, whose shape Flax's sharding constraint refused.
  mesh = jax.make_mesh(
    (1, 1, 1),
    ('layers', 'row', 'col'),
    axis_types=(AxisType.Auto,) * 3,
    devices=jax.devices()[:1],
  )

  class Foo(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(
        nnx.with_partitioning(
          lambda: jnp.linspace(-1.0, 1.0, 16).reshape(8, 2),
          sharding=('row-alias', 'col-alias'),
          sharding_rules=(('row-alias', 'row'),),
        )()
      )
      self.b = nnx.Param(
        nnx.with_partitioning(
          lambda: jnp.zeros((2,)), sharding=('col-alias',)
        )()
      )

    def __call__(self, x):
      return x @ self.w + self.b

  x = jnp.linspace(0.0, 1.0, 24).reshape(3, 8)
  got = []
  runs = [(superoffload.adam(1e-2), False), (optax.adam(1e-2), True)]
  for tx, eager in runs:  # Ours in nnx.jit, as the test above says.
    with jax.set_mesh(mesh), nnx.logical_axis_rules((('col-alias', 'col'),)):
      model = Foo()
      optimizer = _optimizer(model, tx, eager)
      _assert_split(optimizer.opt_state[0].mu['w'], mesh, ('row', 'col'))
      for _ in range(STEPS):
        grads = nnx.grad(_mse)(model, x, 0.0)
        optimizer.update(model, grads)
    got.append({'w': np.asarray(model.w[...]), 'b': np.asarray(model.b[...])})
  _assert_near_optax(got[0], got[1], STEPS)
