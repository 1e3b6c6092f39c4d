"""`superoffload.adam`/`adamw` as a drop-in for optax's.

One test per contract of optax's that a drop-in must keep. Each is judged
against optax itself or against a float64 Adam written from the math below,
never against jax_superoffload's own results: where numbers are compared,
the tolerance is derived from optax's own fp32 deviation from the float64
reference (or from fp32 rounding), not from ours.

The whole module is skipped where the interchange API
(`jax_superoffload.export_adam_state`) does not exist.
"""

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

import jax_superoffload
import jax_superoffload as superoffload

pytestmark = pytest.mark.skipif(
  not hasattr(jax_superoffload, 'export_adam_state'),
  reason='no jax_superoffload.export_adam_state',
)

B1, B2, EPS = 0.9, 0.999, 1e-8
F32_EPS = float(np.finfo(np.float32).eps)
HOST = 'pinned_host'


# A float64 AdamW written from the math, as optax.adamw composes it:
# scale_by_adam, then add_decayed_weights, then scale by -learning_rate.
def _adamw64(params, grads_seq, lr, wd, mu=None, nu=None, count=0):
  """Returns (params, mu, nu) after the steps, all float64 numpy trees."""

  def f64(t):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), t)

  p = f64(params)
  mu = jax.tree.map(np.zeros_like, p) if mu is None else f64(mu)
  nu = jax.tree.map(np.zeros_like, p) if nu is None else f64(nu)
  for i, grads in enumerate(grads_seq):
    t = count + i + 1
    g = f64(grads)
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, mu, g)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, nu, g)

    def step(w, m, v, t=t):
      m_hat = m / (1 - B1**t)
      v_hat = v / (1 - B2**t)
      return w - lr * (m_hat / (np.sqrt(v_hat) + EPS) + wd * w)

    p = jax.tree.map(step, p, mu, nu)
  return p, mu, nu


def _params(dtypes=None, seed=0):
  """A small tree: a matrix, a vector and a 3-d leaf of odd sizes."""
  shapes = {'w': (5, 3), 'b': (3,), 'k': (2, 3, 7)}
  dtypes = dtypes or {}
  rng = np.random.default_rng(seed)
  return {
    name: jnp.asarray(
      rng.standard_normal(shape) * 0.5, dtypes.get(name, jnp.float32)
    )
    for name, shape in shapes.items()
  }


def _grads(params, n, seed=1):
  """n gradient trees in the params' dtypes, made with numpy."""
  rng = np.random.default_rng(seed)
  return [
    jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.1, x.dtype),
      params,
    )
    for _ in range(n)
  ]


def _stepper(tx):
  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step


def _run(tx, params, grads_seq, state=None):
  """Jitted steps of `tx` from `params`; returns (params, state)."""
  state = tx.init(params) if state is None else state
  step = _stepper(tx)
  for grads in grads_seq:
    params, state = step(params, state, grads)
  return params, state


def _adam_part(state):
  """The one ScaleByAdamState in an optax state."""
  found = [
    s
    for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
    )
    if isinstance(s, optax.ScaleByAdamState)
  ]
  assert len(found) == 1, found
  return found[0]


def _with_adam_part(state, adam_state):
  """`state` with its ScaleByAdamState replaced by `adam_state`."""

  def is_adam(s):
    return isinstance(s, optax.ScaleByAdamState)

  return jax.tree.map(
    lambda s: adam_state if is_adam(s) else s, state, is_leaf=is_adam
  )


def _assert_tracks(ours, theirs, ref64, factor=2.0, ulps=4):
  """Ours is as close to the float64 reference as optax's fp32 result is.

  Per leaf: max |ours - ref| <= factor * max |optax - ref| + ulps fp32 ulps
  of the leaf's magnitude. The bound comes from optax and fp32, not from us.
  """
  flat_ours = jax.tree_util.tree_flatten_with_path(ours)[0]
  flat_theirs = jax.tree.leaves(theirs)
  flat_ref = jax.tree.leaves(ref64)
  assert len(flat_ours) == len(flat_theirs) == len(flat_ref)
  for (path, o), t, r in zip(flat_ours, flat_theirs, flat_ref, strict=True):
    o = np.asarray(o, np.float64)
    t = np.asarray(t, np.float64)
    dev_optax = np.max(np.abs(t - r), initial=0.0)
    tol = factor * dev_optax + ulps * F32_EPS * np.max(np.abs(r), initial=0.0)
    dev_ours = np.max(np.abs(o - r), initial=0.0)
    assert dev_ours <= tol, (
      f'{jax.tree_util.keystr(path)}: ours is {dev_ours:.3g} from the '
      f'float64 reference, optax {dev_optax:.3g} (bound {tol:.3g})'
    )


def _assert_same_shapes(tree, params, dtype=None):
  assert jax.tree.structure(tree) == jax.tree.structure(params)
  for leaf, p in zip(
    jax.tree.leaves(tree), jax.tree.leaves(params), strict=True
  ):
    assert leaf.shape == p.shape
    if dtype is not None:
      assert leaf.dtype == dtype


# 1. Parameters changed outside the optimizer are honoured.


def _nnx_kernel_after_one_step(tx):
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  model.kernel[...] = jnp.full((4, 4), 3.0)
  x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  y = jnp.ones((2, 4))

  def loss_fn(m):
    return jnp.mean((m(x) - y) ** 2)

  @nnx.jit
  def step(model, optimizer):
    optimizer.update(model, nnx.grad(loss_fn)(model))

  step(model, optimizer)
  return np.asarray(model.kernel[...]), np.asarray(model.bias[...])


def test_nnx_params_set_outside_the_optimizer_are_honoured():
  kernel, bias = _nnx_kernel_after_one_step(superoffload.adamw(1e-3))
  want_kernel, want_bias = _nnx_kernel_after_one_step(optax.adamw(1e-3))
  # One Adam step moves each weight by about the learning rate.
  assert np.all(np.abs(kernel - 2.999) < 1e-4), f'kernel: {kernel}'
  np.testing.assert_allclose(kernel, want_kernel, rtol=0, atol=8 * F32_EPS * 3)
  np.testing.assert_allclose(bias, want_bias, rtol=0, atol=8 * F32_EPS)


def test_update_starts_from_the_params_passed_not_those_of_init():
  lr, wd = 1e-2, 1e-2
  p0 = _params()
  p1 = jax.tree.map(lambda x: 2.0 * x + 1.0, p0)  # e.g. weights loaded.
  grads = _grads(p0, 2)
  tx = superoffload.adamw(lr, weight_decay=wd)
  ours, _ = _run(tx, p1, grads, state=tx.init(p0))
  otx = optax.adamw(lr, weight_decay=wd)
  theirs, _ = _run(otx, p1, grads, state=otx.init(p0))
  ref, _, _ = _adamw64(p1, grads, lr, wd)
  _assert_tracks(ours, theirs, ref)


def test_params_swapped_between_steps_are_the_new_starting_point():
  lr, wd = 1e-2, 1e-2
  params = _params()
  before, after = _grads(params, 3, seed=2), _grads(params, 2, seed=3)
  tx, otx = (
    superoffload.adamw(lr, weight_decay=wd),
    optax.adamw(lr, weight_decay=wd),
  )
  _, state = _run(tx, params, before)
  _, ostate = _run(otx, params, before)
  _, mu, nu = _adamw64(params, before, lr, wd)
  # An EMA swap or surgery: params unlike those the last update produced.
  swapped = jax.tree.map(lambda x: 0.5 * x - 0.25, params)
  ours, _ = _run(tx, swapped, after, state=state)
  theirs, _ = _run(otx, swapped, after, state=ostate)
  ref, _, _ = _adamw64(swapped, after, lr, wd, mu, nu, count=len(before))
  _assert_tracks(ours, theirs, ref)


# 2. Updates come back in the params' dtypes.

LOW = {'w': jnp.bfloat16, 'b': jnp.float16}  # 'k' stays float32.


def test_update_dtypes_match_the_params_and_cond_compiles():
  params = _params(LOW)
  grads = _grads(params, 1)[0]
  tx = superoffload.adamw(1e-3)
  state = tx.init(params)
  otx = optax.adamw(1e-3)
  theirs, _ = otx.update(grads, otx.init(params), params)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  for name, p in params.items():
    assert updates[name].dtype == p.dtype == theirs[name].dtype, name

  @jax.jit
  def maybe_step(p, s, g, pred):  # As skip-step and accumulation wrappers do.
    u, s = tx.update(g, s, p)
    u = jax.lax.cond(pred, lambda: u, lambda: jax.tree.map(jnp.zeros_like, p))
    return optax.apply_updates(p, u), s

  skipped, _ = maybe_step(params, state, grads, False)
  for name, p in params.items():
    np.testing.assert_array_equal(
      np.asarray(skipped[name], np.float32), np.asarray(p, np.float32)
    )
  stepped, _ = maybe_step(params, state, grads, True)
  assert stepped['k'].dtype == jnp.float32
  assert not np.array_equal(stepped['k'], params['k'])


def _round_to(x64, dtype):
  """float64 values rounded to fp32, then to `dtype` (as float32 numpy)."""
  x32 = jnp.asarray(np.asarray(x64, np.float32))
  return np.asarray(x32.astype(dtype).astype(jnp.float32))


def test_low_precision_params_are_the_fp32_master_cast_down():
  # lr 1e-3 is below a bf16 ulp of the larger weights here, so only an
  # fp32 master carried across steps gives these numbers.
  lr, wd, steps = 1e-3, 1e-2, 8
  params = _params(LOW)
  grads = _grads(params, steps)
  ours = params
  tx = superoffload.adamw(lr, weight_decay=wd)
  state = tx.init(params)

  # The reference: optax on an fp32 copy, fed the same gradient values.
  def up(t):
    return jax.tree.map(lambda x: x.astype(jnp.float32), t)

  otx = optax.adamw(lr, weight_decay=wd)
  theirs = up(params)
  ostate = otx.init(theirs)

  @jax.jit
  def step(p, s, g):  # Returns the updates too: they are in p's dtypes.
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  ostep = _stepper(otx)
  for i, g in enumerate(grads):
    ours, state, updates = step(ours, state, g)
    theirs, ostate = ostep(theirs, ostate, up(g))
    ref, _, _ = _adamw64(params, grads[: i + 1], lr, wd)
    for name, p in params.items():
      assert updates[name].dtype == ours[name].dtype == p.dtype, name
      got = np.asarray(ours[name].astype(jnp.float32))
      r = ref[name]
      # The fp32 master lies within tol of the float64 one; rounding is
      # monotone, so its low-precision cast lies between these two.
      dev = np.max(np.abs(np.asarray(theirs[name], np.float64) - r))
      tol = 2 * dev + 4 * F32_EPS * np.max(np.abs(r))
      lo, hi = _round_to(r - tol, p.dtype), _round_to(r + tol, p.dtype)
      bad = (got < lo) | (got > hi)
      assert not bad.any(), (
        f'step {i + 1}, {name}: {got[bad][:4]} not in '
        f'[{lo[bad][:4]}, {hi[bad][:4]}] (the fp32 master cast down)'
      )
  # The weights did move.
  assert not np.array_equal(ours['w'], params['w'])


# 3. One compile for three jitted calls.


@pytest.mark.xfail(
  strict=True,
  reason='JAX commits every array placed in a memory other than the '
  'default, and a jit with a committed argument (the host state) or an '
  'in-jit placement returns committed outputs; the second call then sees '
  'committed params where the first saw uncommitted ones and compiles '
  'again (two XLA compilations in jax_log_compiles). Committing the '
  'params once before the loop compiles once '
  '(test_one_compile_for_three_calls_from_committed_params).',
)
def test_one_compile_for_three_calls_from_uncommitted_params():
  params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros(3)}  # Uncommitted.
  assert _compiles_for_three_calls(params) == 1


def test_one_compile_for_three_calls_from_committed_params():
  params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros(3)}
  params = jax.device_put(params, jax.devices()[0])
  assert _compiles_for_three_calls(params) == 1


def _compiles_for_three_calls(params) -> int:
  """Compilations of a jitted adamw step over three calls from `params`."""
  grads = {'w': jnp.full((4, 3), 0.1), 'b': jnp.full(3, -0.1)}
  tx = superoffload.adamw(1e-3)
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for _ in range(3):
    params, state = step(params, state, grads)
  jax.block_until_ready(params)
  return step._cache_size()


# 4. The state is shaped like the params, as optax's.


def test_tree_map_params_and_tree_get_work_as_for_optax():
  lr, wd = 1e-2, 1e-2
  params = _params()
  grads = _grads(params, 2)
  tx, otx = (
    superoffload.adamw(lr, weight_decay=wd),
    optax.adamw(lr, weight_decay=wd),
  )
  _, state = _run(tx, params, grads)
  _, ostate = _run(otx, params, grads)
  _, mu64, nu64 = _adamw64(params, grads, lr, wd)
  for key, ref in (('mu', mu64), ('nu', nu64)):
    got = optax.tree_utils.tree_get(state, key)
    _assert_same_shapes(got, params, jnp.float32)
    _assert_tracks(got, optax.tree_utils.tree_get(ostate, key), ref)

  mapped = optax.tree_map_params(
    tx, lambda p: jnp.zeros(p.shape, jnp.bfloat16), state
  )
  for key in ('mu', 'nu'):
    _assert_same_shapes(
      optax.tree_utils.tree_get(mapped, key), params, jnp.bfloat16
    )

  # Abstract shapes, as frameworks derive them for checkpoints.
  abstract = optax.tree_map_params(
    tx, lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), state
  )
  _assert_same_shapes(optax.tree_utils.tree_get(abstract, 'mu'), params)

  # A param-shaped tree of labels (e.g. shardings) mapped onto the state.
  labels = {name: f'label:{name}' for name in params}
  tagged = optax.tree_map_params(
    tx, lambda _, label: label, state, labels, transform_non_params=lambda _: 0
  )
  assert optax.tree_utils.tree_get(tagged, 'mu') == labels
  assert optax.tree_utils.tree_get(tagged, 'nu') == labels


def test_mu_dtype_as_for_optax():
  params = _params()
  grads = _grads(params, 1)
  _, state = _run(
    superoffload.adamw(1e-3, mu_dtype=jnp.bfloat16), params, grads
  )
  _, ostate = _run(optax.adamw(1e-3, mu_dtype=jnp.bfloat16), params, grads)
  want = optax.tree_utils.tree_get(ostate, 'mu')
  _assert_same_shapes(want, params, jnp.bfloat16)
  _assert_same_shapes(
    optax.tree_utils.tree_get(state, 'mu'), params, jnp.bfloat16
  )
  _assert_same_shapes(optax.tree_utils.tree_get(state, 'nu'), params)


# 5. A state built for another tree is refused.


@pytest.mark.parametrize(
  ('other', 'names'),
  [
    ({'gamma': (16,)}, ('alpha', 'gamma')),  # Another structure.
    ({'alpha': (4, 2), 'beta': (8,)}, ('alpha',)),  # Same names, shapes.
    ({'alpha': (8,), 'beta': (2, 4)}, ('beta',)),
  ],
  ids=['structure', 'first_shape', 'second_shape'],
)
def test_a_state_for_another_tree_is_refused(other, names):
  tx = superoffload.adamw(1e-3)
  state = tx.init({'alpha': jnp.ones(8), 'beta': jnp.ones(8)})
  params = {k: jnp.full(shape, 2.0) for k, shape in other.items()}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1), params)
  with pytest.raises(ValueError) as info:
    jax.jit(tx.update)(grads, state, params)
  # It names the first mismatching leaf (either tree's, for a structure).
  assert re.search('|'.join(names), str(info.value)), str(info.value)


# 6. Exact interchange with optax's Adam state, both ways.


def _pair(name, lr):
  """(ours, optax's, weight decay) for 'adam' or 'adamw'."""
  if name == 'adam':
    return superoffload.adam(lr), optax.adam(lr), 0.0
  wd = 1e-2
  return (
    superoffload.adamw(lr, weight_decay=wd),
    optax.adamw(lr, weight_decay=wd),
    wd,
  )


@pytest.mark.parametrize('name', ['adam', 'adamw'])
def test_import_an_optax_state_and_continue(name):
  lr, k, n = 1e-2, 3, 3
  tx, otx, wd = _pair(name, lr)
  params = _params()
  grads = _grads(params, k + n)
  mid, ostate = _run(otx, params, grads[:k])
  state = jax_superoffload.import_adam_state(tx, mid, ostate)
  ours, _ = _run(tx, mid, grads[k:], state=state)
  theirs, _ = _run(otx, params, grads)
  ref, _, _ = _adamw64(params, grads, lr, wd)
  _assert_tracks(ours, theirs, ref)


@pytest.mark.parametrize('name', ['adam', 'adamw'])
def test_export_to_optax_and_continue(name):
  lr, k, n = 1e-2, 3, 3
  tx, otx, wd = _pair(name, lr)
  params = _params()
  grads = _grads(params, k + n)
  mid, state = _run(tx, params, grads[:k])
  adam_state = jax_superoffload.export_adam_state(state)
  assert isinstance(adam_state, optax.ScaleByAdamState)
  assert int(adam_state.count) == k
  _assert_same_shapes(adam_state.mu, params, jnp.float32)
  _assert_same_shapes(adam_state.nu, params, jnp.float32)
  # Used as is: optax's own step runs on it.
  ostate = _with_adam_part(otx.init(mid), adam_state)
  ours_then_theirs, _ = _run(otx, mid, grads[k:], state=ostate)
  theirs, _ = _run(otx, params, grads)
  ref, _, _ = _adamw64(params, grads, lr, wd)
  _assert_tracks(ours_then_theirs, theirs, ref)


@pytest.mark.parametrize('chained', [False, True])
def test_interchange_round_trips_bit_exactly(chained):
  lr, wd = 1e-2, 1e-2
  params = _params()
  grads = _grads(params, 4)
  otx = optax.adamw(lr, weight_decay=wd)
  if chained:  # Any optax state holding one ScaleByAdamState.
    otx = optax.chain(optax.clip_by_global_norm(1.0), otx)
  mid, ostate = _run(otx, params, grads[:2])
  tx = superoffload.adamw(lr, weight_decay=wd)
  back = jax_superoffload.export_adam_state(
    jax_superoffload.import_adam_state(tx, mid, ostate)
  )
  want = _adam_part(ostate)
  assert int(back.count) == int(want.count) == 2
  jax.tree.map(np.testing.assert_array_equal, back.mu, want.mu)
  jax.tree.map(np.testing.assert_array_equal, back.nu, want.nu)

  # Ours -> optax's -> ours changes nothing: the continuations agree.
  mid, state = _run(tx, params, grads[:2])
  again = jax_superoffload.import_adam_state(
    tx,
    mid,
    _with_adam_part(
      optax.adamw(lr, weight_decay=wd).init(mid),
      jax_superoffload.export_adam_state(state),
    ),
  )
  want, _ = _run(tx, mid, grads[2:], state=state)
  got, _ = _run(tx, mid, grads[2:], state=again)
  jax.tree.map(np.testing.assert_array_equal, got, want)


# 7. A run resumes with another bucket size.


@pytest.mark.parametrize(('first', 'then'), [(64, 1 << 20), (1 << 20, 44)])
def test_resume_with_another_bucket_size(first, then):
  # Adam is elementwise and the kernel's vector and tail paths agree bit for
  # bit (xla_ffi/adam_kernel_test.cc, -ffp-contract=off), so which bucket an
  # element falls in cannot change its numbers: a resume that carries the
  # state over exactly gives bit-identical results.
  lr, wd = 1e-2, 1e-2
  params = _params()
  grads = _grads(params, 6)
  tx_first = superoffload.adamw(lr, weight_decay=wd, bucket_bytes=first)
  tx_then = superoffload.adamw(lr, weight_decay=wd, bucket_bytes=then)
  # A checkpoint restores into a template from the new optimizer's init.
  template, other = tx_then.init(params), tx_first.init(params)
  assert jax.tree.structure(template) == jax.tree.structure(other)
  assert [x.shape for x in jax.tree.leaves(template)] == [
    x.shape for x in jax.tree.leaves(other)
  ]
  mid, state = _run(tx_first, params, grads[:3])
  got, _ = _run(tx_then, mid, grads[3:], state=state)
  want, _ = _run(tx_first, mid, grads[3:], state=state)
  jax.tree.map(np.testing.assert_array_equal, got, want)


# 8. FSDP-sharded params need no mesh arguments.


def _fsdp_problem():
  rng = np.random.default_rng(4)
  params = {
    'w': jnp.asarray(rng.standard_normal((16, 8)) * 0.3, jnp.float32),
    'b': jnp.zeros(8),
  }
  x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
  return params, x, y


def _fsdp_step(tx, x, y, constrain):
  def loss_fn(p):
    return jnp.mean((jnp.tanh(x @ p['w'] + p['b']) - y) ** 2)

  @jax.jit
  def step(p, s):
    u, s = tx.update(jax.grad(loss_fn)(p), s, p)
    p = optax.apply_updates(p, u)
    if constrain is not None:  # Keep them as placed, as trainers do.
      p = jax.lax.with_sharding_constraint(p, constrain)
    return p, s

  return step


def _fsdp_run(tx, params, x, y, constrain=None, count_gathers=False, steps=3):
  """(params, state) after the steps, and the all-gathers of the step."""
  state = tx.init(params)
  step = _fsdp_step(tx, x, y, constrain)
  gathers = None
  if count_gathers:
    hlo = step.lower(params, state).compile().as_text()
    gathers = len(re.findall(r' all-gather(?:-start)?\(', hlo))
  for _ in range(steps):
    params, state = step(params, state)
  return params, state, gathers


def _same_layout(leaf, param):
  """Sharded as `param` is (memory kind aside)."""
  ndim = param.ndim
  return leaf.sharding.with_memory_kind(
    param.sharding.memory_kind
  ).is_equivalent_to(param.sharding, ndim)


@pytest.mark.parametrize('axis_type', [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize(
  'spec',
  [P('data', None), P(None, 'data')],
  ids=['fsdp', 'tensor_parallel'],
)
def test_sharded_params_need_no_mesh_arguments(spec, axis_type):
  # FSDP shards w's rows over the 'data' axis (MaxText's default); tensor
  # parallelism its columns. The bias stays replicated.
  params, x, y = _fsdp_problem()
  mesh = jax.make_mesh((8,), ('data',), axis_types=(axis_type,))
  shardings = {
    'w': NamedSharding(mesh, spec),
    'b': NamedSharding(mesh, P()),
  }
  sharded = jax.device_put(params, shardings)
  single = jax.device_put(params, jax.devices()[0])
  ours, theirs = superoffload.adamw(1e-2), optax.adamw(1e-2)
  # With Auto axes XLA may move the new params elsewhere; Explicit axes
  # keep them in their types.
  keep = shardings if axis_type == AxisType.Auto else None

  ours8, state8, gathers = _fsdp_run(ours, sharded, x, y, keep, True)
  theirs8, _, optax_gathers = _fsdp_run(theirs, sharded, x, y, keep, True)
  ours1, _, _ = _fsdp_run(ours, single, x, y)
  theirs1, _, _ = _fsdp_run(theirs, single, x, y)

  assert gathers <= optax_gathers, (gathers, optax_gathers)
  for name in params:
    # Sharding changes the gradients' fp32 summation order; ours may differ
    # from its 1-device run as much as optax's does from its own.
    dev = np.max(np.abs(np.asarray(theirs8[name]) - np.asarray(theirs1[name])))
    tol = 2 * dev + 8 * F32_EPS * np.max(np.abs(np.asarray(theirs1[name])))
    np.testing.assert_allclose(ours8[name], ours1[name], rtol=0, atol=tol)

  for key in ('mu', 'nu'):
    tree = optax.tree_utils.tree_get(state8, key)
    for name, param in sharded.items():
      assert tree[name].sharding.memory_kind == HOST, (key, name)
      assert _same_layout(tree[name], param), (key, name, tree[name].sharding)
  # Every other param-shaped state leaf (e.g. an fp32 master) likewise.
  per_param = optax.tree_map_params(
    superoffload.adamw(1e-2),
    lambda s, p: f'{s.sharding.memory_kind}, same layout: {_same_layout(s, p)}',
    state8,
    sharded,
    transform_non_params=lambda _: None,
  )
  found = jax.tree.leaves(per_param)
  assert len(found) >= 2 * len(params)
  assert set(found) == {f'{HOST}, same layout: True'}, found


def test_one_transformation_follows_the_params_of_its_latest_init():
  # One tx, as a trainer keeps it: sharded, then single-device, then sharded
  # again, with optax.tree_map_params (which inits with placeholders) between.
  params, x, y = _fsdp_problem()
  mesh = jax.make_mesh((8,), ('data',))
  sharded = jax.device_put(
    params,
    {'w': NamedSharding(mesh, P('data', None)), 'b': NamedSharding(mesh, P())},
  )
  single = jax.device_put(params, jax.devices()[0])
  tx = superoffload.adamw(1e-2)
  got = []
  for start in (sharded, single, sharded):
    state = tx.init(start)
    optax.tree_map_params(
      tx, lambda s: s, state, transform_non_params=lambda s: s
    )
    p, _, _ = _fsdp_run(tx, start, x, y, steps=2)
    got.append(p)
  for name in params:
    want, _, _ = _fsdp_run(superoffload.adamw(1e-2), single, x, y, steps=2)
    for p in got:
      np.testing.assert_allclose(p[name], want[name], rtol=0, atol=1e-6)
