"""The parameter kinds optax's adamw takes.

Python and NumPy scalars and 0-d arrays as parameters, and an abstract
`init` on `jax.ShapeDtypeStruct`s (optax's needs only shapes and dtypes).
Judged against optax.adamw itself, and against an `init` on the concrete
parameters.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload

F32_EPS = float(np.finfo(np.float32).eps)


def _steps(tx, params, grads, n=3):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(n):
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _grads(params):
  return jax.tree.map(lambda x: jnp.full(np.shape(x), 0.5, jnp.float32), params)


@pytest.mark.parametrize(
  'params',
  [
    {'python_float': 1.0},
    {'numpy_scalar': np.float32(2.0), 'numpy_f64': np.float64(1.5)},
    {'zero_d': jnp.array(3.0), 'vector': jnp.arange(3.0)},
  ],
  ids=['python', 'numpy', 'zero_d'],
)
def test_scalar_parameters_step_as_optax(params):
  grads = _grads(params)
  ours, _ = _steps(superoffload.adamw(1e-1), params, grads)
  theirs, _ = _steps(optax.adamw(1e-1), params, grads)
  for a, b, p in zip(
    jax.tree.leaves(ours),
    jax.tree.leaves(theirs),
    jax.tree.leaves(params),
    strict=True,
  ):
    assert np.shape(a) == np.shape(b) == np.shape(p)
    # Three fp32 steps of size ~0.1 from values up to 3: a few ulps of 3.
    np.testing.assert_allclose(a, b, rtol=0, atol=16 * F32_EPS * 3)
    assert not np.allclose(a, p)  # It moved.


def test_abstract_init_on_shape_dtype_structs():
  params = {'w': jnp.arange(6.0).reshape(2, 3), 'b': jnp.ones(3, jnp.bfloat16)}
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  tx = superoffload.adamw(1e-2)
  fresh = tx.init(params)
  state = tx.init(abstract)
  assert jax.tree.structure(state) == jax.tree.structure(fresh)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(fresh), strict=True):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert a.sharding.memory_kind == b.sharding.memory_kind
  # The first update starts from the parameters it is given.
  grads = _grads(params)
  update = jax.jit(tx.update)

  def run(state):
    p = params
    for _ in range(3):
      updates, state = update(grads, state, p)
      p = optax.apply_updates(p, updates)
    return p

  want, got = run(fresh), run(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(want['w'], params['w'])
