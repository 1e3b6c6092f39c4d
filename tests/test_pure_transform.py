"""`init` and `update` are pure functions of their arguments.

A run restored as Orbax users restore it (a fresh transformation, an
abstract target from `jax.eval_shape(tx.init, params)`, the state filled by
restore, no concrete `init`) must step as a fresh init does: no more
all-gathers than optax.adamw on the same setup, and the same numbers. One
transformation serves any number of parameter trees. Judged against
optax.adamw, never against our own results.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_superoffload as superoffload

F32_EPS = float(np.finfo(np.float32).eps)
HOST = 'pinned_host'
LR, WD = 1e-2, 1e-2


def _problem(seed=4, rows=16, cols=8):
  rng = np.random.default_rng(seed)
  params = {
    'w': jnp.asarray(rng.standard_normal((rows, cols)) * 0.3, jnp.float32),
    'b': jnp.zeros(cols),
  }
  x = jnp.asarray(rng.standard_normal((4, rows)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((4, cols)), jnp.float32)
  return params, x, y


def _stepper(tx, x, y):
  def loss_fn(p):
    return jnp.mean((jnp.tanh(x @ p['w'] + p['b']) - y) ** 2)

  @jax.jit
  def step(p, s):
    u, s = tx.update(jax.grad(loss_fn)(p), s, p)
    return optax.apply_updates(p, u), s

  return step


def _gathers(step, params, state) -> int:
  hlo = step.lower(params, state).compile().as_text()
  return len(re.findall(r' all-gather(?:-start)?\(', hlo))


def _steps(step, params, state, n):
  for _ in range(n):
    params, state = step(params, state)
  return params, state


def _place(params, mesh, spec_w):
  return jax.device_put(
    params,
    {'w': NamedSharding(mesh, spec_w), 'b': NamedSharding(mesh, P())},
  )


def _assert_close_to(got, want):
  """Equal up to fp32 rounding of a few steps (optax's own precision)."""
  for name in want:
    w, g = np.asarray(want[name]), np.asarray(got[name])
    tol = 16 * F32_EPS * max(1.0, np.max(np.abs(w)))
    np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=name)


def _restore_target(tx, params, saved, mesh, as_saved):
  """The restore target an Orbax user builds from `eval_shape`.

  The structure, shapes and dtypes come from `jax.eval_shape(tx.init,
  params)` of the fresh transformation. Orbax needs concrete shardings:
  either the ones each leaf was saved with, or (as a trainer with sharding
  rules does) the parameters' own for the parameter-shaped leaves, in pinned
  host memory, and replicated for the counters.
  """
  abstract = jax.eval_shape(tx.init, params)

  def like(t, sharding):
    return jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sharding)

  if as_saved:
    return jax.tree.map(lambda t, s: like(t, s.sharding), abstract, saved)
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(
    tx,
    lambda t, p: like(t, p.sharding.with_memory_kind(HOST)),
    abstract,
    params,
    transform_non_params=lambda t: like(t, replicated),
  )


@pytest.mark.parametrize(
  ('axis_type', 'as_saved'),
  [
    (AxisType.Explicit, False),
    (AxisType.Explicit, True),
    (AxisType.Auto, True),
  ],
  ids=['explicit-rules', 'explicit-as_saved', 'auto-as_saved'],
)
def test_an_orbax_restore_steps_as_optax(tmp_path, axis_type, as_saved):
  params, x, y = _problem()
  mesh = jax.make_mesh((8,), ('data',), axis_types=(axis_type,))
  sharded = _place(params, mesh, P('data', None))

  # The first run: two steps, then a checkpoint.
  first = superoffload.adamw(LR, weight_decay=WD)
  mid, saved = _steps(_stepper(first, x, y), sharded, first.init(sharded), n=2)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'ckpt', saved)
  checkpointer.wait_until_finished()

  # The restarted run: a fresh transformation, never a concrete init.
  tx = superoffload.adamw(LR, weight_decay=WD)
  target = _restore_target(tx, mid, saved, mesh, as_saved)
  restored = checkpointer.restore(tmp_path / 'ckpt', target)
  assert isinstance(restored, superoffload.SuperOffloadState)
  step = _stepper(tx, x, y)
  gathers = _gathers(step, mid, restored)
  got, _ = _steps(step, mid, restored, n=2)

  theirs = optax.adamw(LR, weight_decay=WD)
  theirs_step = _stepper(theirs, x, y)
  omid, ostate = _steps(theirs_step, sharded, theirs.init(sharded), n=2)
  optax_gathers = _gathers(theirs_step, omid, ostate)
  want, _ = _steps(theirs_step, omid, ostate, n=2)

  assert gathers <= optax_gathers, (gathers, optax_gathers)
  _assert_close_to(got, want)


def test_one_transformation_serves_two_trees():
  # One tx for two trees of the same structure and shapes, sharded two ways
  # (FSDP rows, tensor-parallel columns), and a third tree of another
  # structure on one device; each is initialised before any is stepped.
  params, x, y = _problem()
  mesh = jax.make_mesh((8,), ('data',))
  trees = {
    'fsdp': (_place(params, mesh, P('data', None)), x, y),
    'tensor_parallel': (_place(params, mesh, P(None, 'data')), x, y),
  }
  other, ox, oy = _problem(seed=5, rows=6, cols=3)
  other['extra'] = jnp.ones((3,))
  other = jax.device_put(other, jax.devices()[0])
  trees['other'] = (other, ox, oy)

  def loss_fn(p, x, y):
    out = jnp.tanh(x @ p['w'] + p['b'])
    if 'extra' in p:
      out = out * p['extra']
    return jnp.mean((out - y) ** 2)

  def stepper(tx, x, y):
    @jax.jit
    def step(p, s):
      u, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
      return optax.apply_updates(p, u), s

    return step

  tx = superoffload.adamw(LR, weight_decay=WD)
  states = {name: tx.init(p) for name, (p, _, _) in trees.items()}
  theirs = optax.adamw(LR, weight_decay=WD)
  for name, (p, x, y) in trees.items():
    step, theirs_step = stepper(tx, x, y), stepper(theirs, x, y)
    ostate = theirs.init(p)
    gathers = _gathers(step, p, states[name])
    assert gathers <= _gathers(theirs_step, p, ostate), (name, gathers)
    got, state = _steps(step, p, states[name], n=3)
    want, _ = _steps(theirs_step, p, ostate, n=3)
    _assert_close_to(got, want)
    for leaf_name, leaf in p.items():
      assert state.mu[leaf_name].sharding.is_equivalent_to(
        leaf.sharding.with_memory_kind(
          state.mu[leaf_name].sharding.memory_kind
        ),
        leaf.ndim,
      ), (name, leaf_name, state.mu[leaf_name].sharding)


@pytest.mark.parametrize(
  'params_dtype', [jnp.bfloat16, jnp.float32, jnp.complex64]
)
def test_complex_mu_dtype_is_accepted_as_by_optax(params_dtype):
  # optax.adam's own test_explicit_dtype: mu in mu_dtype whatever the params.
  params = jnp.array([0.0, 0.3], params_dtype)
  for make in (superoffload.adam, superoffload.adamw):
    state = make(0.1, mu_dtype=jnp.complex64).init(params)
    assert optax.tree_utils.tree_get(state, 'mu').dtype == jnp.complex64
    assert optax.tree_utils.tree_get(state, 'nu').dtype == params_dtype


def test_complex_mu_dtype_steps_as_optax():
  # Complex parameters with complex moments: optax's path, optax's numbers.
  rng = np.random.default_rng(0)

  def cplx(shape, scale=1.0):
    re_im = rng.standard_normal((2, *shape)) * scale
    return jnp.asarray(re_im[0] + 1j * re_im[1], jnp.complex64)

  params = {'w': cplx((3, 4)), 'b': cplx((4,))}
  grads = [jax.tree.map(lambda p: cplx(p.shape, 0.1), params) for _ in range(3)]
  results = []
  for make in (superoffload.adamw, optax.adamw):
    tx = make(LR, weight_decay=WD, mu_dtype=jnp.complex64)
    p, state = params, tx.init(params)
    step = jax.jit(tx.update)
    for g in grads:
      u, state = step(g, state, p)
      p = optax.apply_updates(p, u)
    results.append(p)
  _assert_close_to(*results)


def test_inject_hyperparams_keeps_the_state_split():
  # optax.inject_hyperparams builds the transformation anew inside each
  # update: only a pure update can know how the state is split there.
  params, x, y = _problem()
  mesh = jax.make_mesh((8,), ('data',))
  sharded = _place(params, mesh, P('data', None))
  gathers, results = [], []
  for make in (superoffload.adamw, optax.adamw):
    tx = optax.inject_hyperparams(make)(learning_rate=LR, weight_decay=WD)
    step, state = _stepper(tx, x, y), tx.init(sharded)
    gathers.append(_gathers(step, sharded, state))
    p, state = _steps(step, sharded, state, n=3)
    results.append(p)
    mu = optax.tree_utils.tree_get(state, 'mu')['w']
    assert tuple(mu.sharding.spec) == ('data', None), mu.sharding
  assert gathers[0] <= gathers[1], gathers
  _assert_close_to(*results)
