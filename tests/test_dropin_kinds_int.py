"""Integer and bool parameters, as optax.adamw steps them.

optax's adamw steps such leaves with its own math: updates in float32, `mu`
made like the parameter then floating after the first step, `nu` cast back
to the parameter's dtype (optax's tree.cast_like). Ours sends them through
its optax path (they never reach the kernel), so on those leaves the
updates, the new parameters and the state must equal optax's exactly, in
value and dtype, eagerly and under `jax.jit`; float32 leaves beside them
take the kernel (a few ulps from optax, as in test_dropin_kinds.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload

F32_EPS = float(np.finfo(np.float32).eps)

KINDS = {
  'python': {'i': 9, 'j': -13, 'flag': True},
  'numpy': {'i': np.int32(9), 'j': np.int64(-13), 'flag': np.bool_(True)},
  'jnp': {
    'i': jnp.array([3, 0, -7], jnp.int32),
    'j': jnp.array(-2, jnp.int32),
    'flag': jnp.array([True, False]),
  },
}


def _grads(params, scale=0.37):
  """Gradients that differ per element, in float32."""
  return jax.tree.map(
    lambda x: (
      scale
      * (1.0 + jnp.arange(np.size(x), dtype=jnp.float32)).reshape(np.shape(x))
    ),
    params,
  )


def _run(tx, params, grads, n=3, jit=True, with_params=True):
  """n steps: the updates and parameters of each, and the last state."""
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  steps = []
  for _ in range(n):
    updates, state = update(grads, state, params if with_params else None)
    params = optax.apply_updates(params, updates)
    steps.append((updates, params))
  return steps, state


def _assert_exact(ours, theirs, what):
  for (path, a), b in zip(
    jax.tree.flatten_with_path(ours)[0], jax.tree.leaves(theirs), strict=True
  ):
    where = f'{what}{jax.tree_util.keystr(path)}'
    assert jnp.result_type(a) == jnp.result_type(b), (where, a, b)
    np.testing.assert_array_equal(a, b, err_msg=where)


def _assert_steps_and_state(ours, theirs, keys):
  """Exact on the leaves `keys` (updates, parameters, mu, nu and count)."""
  pick = lambda tree: {k: tree[k] for k in keys}  # noqa: E731
  (steps_o, state_o), (steps_t, state_t) = ours, theirs
  for k, ((uo, po), (ut, pt)) in enumerate(zip(steps_o, steps_t, strict=True)):
    _assert_exact(pick(uo), pick(ut), f'step {k} updates')
    _assert_exact(pick(po), pick(pt), f'step {k} params')
  adam = state_t[0]
  assert int(state_o.count) == int(adam.count)
  _assert_exact(pick(state_o.mu), pick(adam.mu), 'mu')
  _assert_exact(pick(state_o.nu), pick(adam.nu), 'nu')


@pytest.mark.parametrize('jit', [True, False], ids=['jit', 'eager'])
@pytest.mark.parametrize('kind', list(KINDS))
def test_integer_and_bool_leaves_step_as_optax(kind, jit):
  params = dict(KINDS[kind], w=jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32))
  grads = _grads(params)
  make = lambda m: m.adamw(0.1, weight_decay=0.05)  # noqa: E731
  ours = _run(make(superoffload), params, grads, jit=jit)
  theirs = _run(make(optax), params, grads, jit=jit)
  _assert_steps_and_state(ours, theirs, ['i', 'j', 'flag'])
  # They moved as optax moves them: float32 updates, integer parameters.
  updates, last = ours[0][-1]
  assert updates['i'].dtype == jnp.float32
  assert jnp.result_type(last['i']) == jnp.int32
  assert ours[1].mu['i'].dtype == jnp.float32  # optax's, after a step.
  assert ours[1].nu['i'].dtype == jnp.int32
  assert not np.array_equal(last['i'], params['i'])
  # The float32 leaf beside them: the kernel, a few ulps from optax.
  np.testing.assert_allclose(
    last['w'], theirs[0][-1][1]['w'], rtol=0, atol=16 * F32_EPS
  )


@pytest.mark.parametrize(
  'mask',
  [
    {'i': True, 'j': False, 'flag': False, 'w': True},
    lambda p: jax.tree.map(lambda x: np.ndim(x) > 0, p),
  ],
  ids=['tree', 'callable'],
)
def test_integer_leaves_with_weight_decay_masks(mask):
  params = dict(KINDS['jnp'], w=jnp.ones(3, jnp.float32))
  grads = _grads(params, scale=0.01)
  make = lambda m: m.adamw(0.3, weight_decay=0.5, mask=mask)  # noqa: E731
  ours = _run(make(superoffload), params, grads, n=4)
  theirs = _run(make(optax), params, grads, n=4)
  _assert_steps_and_state(ours, theirs, ['i', 'j', 'flag'])


@pytest.mark.parametrize('jit', [True, False], ids=['jit', 'eager'])
def test_updates_without_params_as_optax_adam(jit):
  # optax's combining test_extra_args: Python ints as params and gradients
  # (and ints that Python's double math rounds otherwise than float32's).
  params = {'a': 1, 'b': 2, 'c': 3, 'd': 13}
  ours = _run(superoffload.adam(1e-3), params, params, jit=jit, with_params=0)
  theirs = _run(optax.adam(1e-3), params, params, jit=jit, with_params=0)
  _assert_steps_and_state(ours, theirs, list(params))


def test_a_lone_integer_leaf_beside_floats():
  # One leaf on optax's path in a larger tree. Eagerly exact; under jit
  # within an ulp: optax's own update of that leaf differs by one between
  # this tree and the leaf alone, and between eager and jit (XLA fuses
  # optax's `1 - b1 ** count` into its one consumer or not; optax_path.py).
  params = {'i': jnp.array([3, 0, -7], jnp.int32), 'w': jnp.linspace(-1, 1, 5)}
  grads = {'i': jnp.array([0.5, -2.0, 3.0]), 'w': jnp.full(5, 0.3)}
  make = lambda m: m.adamw(0.1)  # noqa: E731
  ours = _run(make(superoffload), params, grads, jit=False)
  theirs = _run(make(optax), params, grads, jit=False)
  _assert_steps_and_state(ours, theirs, ['i'])
  ours = _run(make(superoffload), params, grads)
  theirs = _run(make(optax), params, grads)
  for (u, p), (v, q) in zip(ours[0], theirs[0], strict=True):
    np.testing.assert_allclose(u['i'], v['i'], rtol=2 * F32_EPS)
    np.testing.assert_array_equal(p['i'], q['i'])


@pytest.mark.parametrize(
  'kwargs',
  [
    {'learning_rate': optax.linear_schedule(0.1, 0.01, 5)},
    {'nesterov': True},
    {'mu_dtype': jnp.bfloat16},
    {'offload': superoffload.Offload(moments_8bit=True)},
    {'offload': superoffload.Offload(clip_norm=1.0)},
  ],
  ids=['schedule', 'nesterov', 'mu_bf16', 'moments_8bit', 'stv_clip'],
)
def test_integer_leaves_under_the_options(kwargs):
  params = dict(KINDS['jnp'], w=jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32))
  grads = _grads(params, scale=2.0)  # Over the clipping norm.
  theirs_kwargs = {'learning_rate': 0.1, **kwargs}
  clip = theirs_kwargs.pop('offload', superoffload.Offload()).clip_norm
  tx = optax.adamw(**theirs_kwargs)
  if clip is not None:  # STV clips as clip_by_global_norm does.
    tx = optax.chain(optax.clip_by_global_norm(clip), tx)
  ours = _run(
    superoffload.adamw(**{'learning_rate': 0.1, **kwargs}),
    params,
    grads,
    jit=False,
  )
  theirs = _run(tx, params, grads, jit=False)
  if clip is not None:  # The state sits inside optax.chain's tuple.
    theirs = (theirs[0], theirs[1][1])
  _assert_steps_and_state(ours, theirs, ['i', 'j', 'flag'])


def test_mixed_with_float64_leaves():
  x64 = jax.config.jax_enable_x64
  jax.config.update('jax_enable_x64', True)
  try:
    params = {
      'i': jnp.array([4, -1], jnp.int32),
      'n': np.int64(7),
      'd': jnp.linspace(0.0, 1.0, 3, dtype=jnp.float64),
      'w': jnp.linspace(0.0, 1.0, 3, dtype=jnp.float32),
    }
    grads = _grads(params)
    grads['d'] = grads['d'].astype(jnp.float64)
    make = lambda m: m.adamw(0.1, weight_decay=0.05)  # noqa: E731
    ours = _run(make(superoffload), params, grads)
    theirs = _run(make(optax), params, grads)
    # float64 leaves took optax's path already: exact as well.
    _assert_steps_and_state(ours, theirs, ['i', 'n', 'd'])
    assert jnp.result_type(ours[0][-1][1]['n']) == jnp.int64
  finally:
    jax.config.update('jax_enable_x64', x64)


def test_interchange_with_optax_on_integer_leaves():
  params = dict(KINDS['jnp'], w=jnp.ones(3, jnp.float32))
  grads = _grads(params)
  keys = ['i', 'j', 'flag']
  tx = superoffload.adamw(0.1)
  (steps, optax_state) = _run(optax.adamw(0.1), params, grads, n=2)
  p = steps[-1][1]
  # Imported: the next step is optax's, exactly (mu floating as optax's).
  ours = superoffload.import_adam_state(tx, p, optax_state)
  u_o, ours = jax.jit(tx.update)(grads, ours, p)
  u_t, optax_state = jax.jit(optax.adamw(0.1).update)(grads, optax_state, p)
  _assert_exact({k: u_o[k] for k in keys}, {k: u_t[k] for k in keys}, 'u')
  # Exported: optax's state, leaf for leaf.
  exported = superoffload.export_adam_state(ours)
  for name in ('mu', 'nu'):
    _assert_exact(
      {k: getattr(exported, name)[k] for k in keys},
      {k: getattr(optax_state[0], name)[k] for k in keys},
      name,
    )


def test_non_numeric_leaves_are_refused_by_path():
  params = {'w': jnp.ones(3), 'key': jax.random.key(0)}
  with pytest.raises(TypeError, match=r"parameter \['key'\] has dtype key<"):
    superoffload.adamw(0.1).init(params)
