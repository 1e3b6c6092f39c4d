"""Flax's mutable (hijax and ref) Variables, as optax's.

With `nnx.var_defaults(hijax=True)` an `nnx.Optimizer` hands `tx.init`
Flax's hijax Variables; with `ref=True` their arrays live in `jax.Ref`s,
and Flax keeps the optimizer's state in Refs as well. The tests run what a
Flax user writes (Flax's own mutable_array_test and integration_test train
steps, flax/tests/nnx) with superoffload's adam/adamw and with optax's:
where optax's runs, ours runs and gives its numbers (a few float32 ulps
on the kernel's leaves, exactly on an integer leaf, which takes optax's
path); where this Flax/JAX refuses the code with optax too, ours is
refused the same way and the case is skipped with that reason. JAX's Refs
do not keep pinned host memory (0.10 refuses it, 0.12 reads it back in
device memory): the state of parameters kept in Refs lives in device memory.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload

nnx = pytest.importorskip('flax.nnx')
if not hasattr(nnx, 'var_defaults') or not hasattr(nnx, 'with_vars'):
  pytest.skip(
    'this Flax has no nnx.var_defaults / nnx.with_vars (hijax Variables)',
    allow_module_level=True,
  )

F32_EPS = float(np.finfo(np.float32).eps)
MODES = {
  'hijax': {'hijax': True},
  'ref': {'ref': True},
  'hijax_ref': {'hijax': True, 'ref': True},
}


# What the installed Flax/JAX raise with optax's adam on some of these
# cases (seen with flax 0.12.8 on JAX 0.10.2 and flax 0.12.12 on JAX 0.12):
# a non-ref hijax Variable updated inside `jax.jit` (flax 0.12.12), and
# hijax Variables holding Refs under `jax.jit` (both), and the floating
# `mu` optax's first step leaves on an integer parameter, written back into
# the integer Ref Flax made for it (both).
REFUSED_WITH_OPTAX = (
  'Cannot update a non-ref HijaxVariable inside JAX transformations',
  'does not have a corresponding jaxpr input',
  "'Fake' object has no attribute 'arg_names'",
  'Invalid dtype for `swap`. Ref dtype: int32. Value dtype: float32',
)


def _as_optax_runs_it(run, ours, theirs):
  """`run(theirs)` and `run(ours)`; skipped where optax's is refused."""
  try:
    want = run(theirs)
  except Exception as e:
    if not any(known in str(e) for known in REFUSED_WITH_OPTAX):
      raise
    with pytest.raises(type(e)) as ours_error:
      run(ours)
    assert any(known in str(ours_error.value) for known in REFUSED_WITH_OPTAX)
    pytest.skip(f'this Flax/JAX refuses it with optax too: {str(e)[:160]}')
  return run(ours), want


class _Model(nnx.Module):
  """mutable_array_test's model, with an integer parameter beside.

  Without its call counter: flax 0.12.12 refuses to update a hijax
  Variable inside `jax.value_and_grad` (with optax too).
  """

  def __init__(self, rngs, ints):
    self.w = nnx.Param(jax.random.uniform(rngs(), (2, 4)))
    if ints:
      self.steps = nnx.Param(jnp.array([7, -3], jnp.int32))

  def __call__(self, x):
    return x @ self.w


def _train(adamw, mode, jit, ints=True, n=3):
  """Flax's hijax train step (mutable_array_test), n times."""
  with nnx.var_defaults(**MODES[mode]):
    model = _Model(nnx.Rngs(1), ints)
    optimizer = nnx.Optimizer(
      model, adamw(1e-1, weight_decay=0.05), wrt=nnx.Param
    )
  x = jax.random.normal(jax.random.key(0), (5, 2))
  y = jnp.ones((5, 4))
  int_grads = {'steps': jnp.array([1.0, -0.5])}

  def train_step(model, optimizer, x, y):
    graphdef, params, nondiff = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
      model = nnx.merge(graphdef, params, nondiff)
      return jnp.mean((model(x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn, allow_int=True)(
      nnx.with_vars(params, hijax=False, ref=False)
    )
    if 'steps' in grads:  # Not differentiable: a gradient by hand.
      grads['steps'] = nnx.Param(int_grads['steps'])
    optimizer.update(model, grads)
    return loss

  step = jax.jit(train_step) if jit else train_step
  losses = [float(step(model, optimizer, x, y)) for _ in range(n)]
  adam = nnx.as_pure(optimizer.opt_state)[0]
  return losses, nnx.as_pure(nnx.state(model, nnx.Param)), adam


# Refs that do not keep host memory: the state is made on the device, and
# no step finds it there unexpectedly (state_memory.kept_in_place's warning).
@pytest.mark.filterwarnings('error:.*came in device memory')
@pytest.mark.parametrize('ints', [False, True], ids=['float', 'int'])
@pytest.mark.parametrize('jit', [True, False], ids=['jit', 'eager'])
@pytest.mark.parametrize('mode', list(MODES))
def test_mutable_variables_step_as_optax(mode, jit, ints):
  ours, theirs = _as_optax_runs_it(
    lambda m: _train(m.adamw, mode, jit, ints), superoffload, optax
  )
  (losses, params, adam), (want_losses, want_params, want_adam) = ours, theirs
  np.testing.assert_allclose(losses, want_losses, rtol=4 * F32_EPS)
  np.testing.assert_allclose(params['w'], want_params['w'], atol=8 * F32_EPS)
  assert not np.array_equal(
    params['w'], _train(optax.adamw, mode, jit, ints, 0)[1]['w']
  )
  if not ints:
    return
  # The integer leaf took optax's path: exactly optax's, dtypes included.
  for got, want in (
    (params['steps'], want_params['steps']),
    (adam.mu['steps'], want_adam.mu['steps']),
    (adam.nu['steps'], want_adam.nu['steps']),
  ):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  assert not np.array_equal(params['steps'], [7, -3])


def test_hijax_state_lives_in_host_memory():
  _, _, adam = _train(superoffload.adamw, 'hijax', jit=False)
  assert adam.mu['w'].sharding.memory_kind == 'pinned_host'
  assert adam.nu['w'].sharding.memory_kind == 'pinned_host'


@nnx.var_defaults(hijax=True)
def _example_mutable_arrays(adam):
  """Flax's integration_test test_example_mutable_arrays, its losses."""

  class Model(nnx.Module):
    def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
      self.linear = nnx.Linear(din, dmid, rngs=rngs)
      self.bn = nnx.BatchNorm(dmid, use_running_average=False, rngs=rngs)
      self.dropout = nnx.Dropout(0.2, deterministic=False, rngs=rngs)
      self.linear_out = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
      x = nnx.relu(self.dropout(self.bn(self.linear(x))))
      return self.linear_out(x)

  model = Model(2, 64, 3, rngs=nnx.Rngs(0))  # eager initialization
  optimizer = nnx.Optimizer(model, adam(1e-3), wrt=nnx.Param)

  @jax.jit  # automatic state management for JAX transforms
  def train_step(x, y):
    graphdef, params, nondiff = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
      model = nnx.merge(graphdef, params, nondiff)
      return ((model(x) - y) ** 2).mean()  # call methods directly

    loss, grads = jax.value_and_grad(loss_fn)(
      nnx.with_vars(params, hijax=False)
    )
    optimizer.update(model, grads)  # in-place updates
    return loss

  x = jax.random.normal(jax.random.key(0), (8, 2))
  y = jax.random.normal(jax.random.key(1), (8, 3))
  return [float(train_step(x, y)) for _ in range(3)]


def test_flax_example_mutable_arrays():
  ours, theirs = _as_optax_runs_it(
    _example_mutable_arrays, superoffload.adam, optax.adam
  )
  np.testing.assert_allclose(ours, theirs, rtol=16 * F32_EPS)
  assert ours[-1] < ours[0]
