"""The row step of stacked state (`grace_adam.adam_step_row`), on the CPU.

A scanned layer's backward starts its host step inside
the loop, on row i of the stacked fp32 state, written in place. Called for
every row inside a jitted `lax.scan` (the state a loop-invariant operand,
a join after the loop as the stream executor has), the state must be the
bits of stepping each row as its own bucket (`adam_step_segments`), and
within fp32 rounding of Adam's math in float64.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_superoffload._src.core.hyperparams import PACKED_NAMES
from jax_superoffload._src.core.hyperparams import Hyperparams
from jax_superoffload._src.host import grace_adam

HYPER = Hyperparams(
  count=3,
  learning_rate=1e-2,
  b1=0.9,
  b2=0.999,
  eps=1e-8,
  weight_decay=0.01,
)
U = 2.0**-24  # fp32's unit roundoff.


def _state(rng, shape):
  master = rng.uniform(-1, 1, shape).astype(np.float32)
  mu = (0.1 * rng.uniform(-1, 1, shape)).astype(np.float32)
  nu = (0.01 * rng.uniform(0, 1, shape)).astype(np.float32)
  return master, mu, nu


def _params(master, dtype):
  """Row parameters: the master (as the last step wrote it) but every third
  element changed (weights loaded), so re-seeding replaces those."""
  params = np.array(master, np.float32)
  params.reshape(params.shape[0], -1)[:, ::3] += 0.25
  return jnp.asarray(params).astype(dtype)


def _join(xs, barrier):
  """The stream executor's join (an aliasing identity on the CPU)."""
  call = jax.ffi.ffi_call(
    grace_adam.STREAM_JOIN_TARGET,
    [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs],
    input_output_aliases={i: i for i in range(len(xs))},
    has_side_effect=True,
  )
  return call(*xs, barrier)


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _scanned(master, mu, nu, grads, params, rows=None):
  """adam_step_row for each of `rows` (default: every row, in order) from
  a scan's loop; the join after it."""

  def body(total, xs):
    i, g, p = xs
    grace_adam.adam_step_row(master, mu, nu, g, i, HYPER, params=p)
    # A value the loop computes (the real design's join takes the stacked
    # gradients): XLA:CPU folds a join on the loop's constant trip count
    # and copies the state for it before the loop, which the writes miss.
    return total + g[0].ravel()[0].astype(jnp.float32), None

  if rows is None:
    rows = jnp.arange(master[0].shape[0])
  done, _ = jax.lax.scan(body, 0.0, (rows, grads, params))
  return _join([*master, *mu, *nu], done.astype(jnp.int32))


@jax.jit
def _bucket(master, mu, nu, grads, params):
  """Each row stepped as its own bucket, stacked again."""
  rows = []
  for i in range(master[0].shape[0]):
    out = grace_adam.adam_step_segments(
      [m[i] for m in master],
      [u[i] for u in mu],
      [v[i] for v in nu],
      [g[i] for g in grads],
      None,
      HYPER,
      params=None if params is None else [p[i] for p in params],
    )
    rows.append(out[:3])
  return [
    jnp.stack([r[run][j] for r in rows])
    for run in range(3)
    for j in range(len(master))
  ]


def _float64_step(master, mu, nu, grad):
  """Adam with decoupled weight decay, in float64 from the formula, on the
  scalars as the kernel receives them (rounded to fp32: 1 - b2^t is
  sensitive to b2's rounding, 1e-5 relative at t = 4)."""
  s = dict(
    zip(PACKED_NAMES, np.asarray(HYPER.packed(), np.float64), strict=True)
  )
  t = HYPER.count + 1
  g = np.asarray(grad, np.float64) * s['grad_scale']
  mu_terms = np.abs(s['b1'] * mu) + np.abs(s['one_minus_b1'] * g)
  mu = s['b1'] * np.float64(mu) + s['one_minus_b1'] * g
  nu = s['b2'] * np.float64(nu) + s['one_minus_b2'] * g * g
  c1 = 1 / (1 - s['b1'] ** t)
  denominator = np.sqrt(nu / (1 - s['b2'] ** t) + s['eps_root']) + s['eps']
  decay = s['weight_decay'] * np.float64(master)
  new = np.float64(master) - s['learning_rate'] * (
    mu * c1 / denominator + decay
  )
  # The update's terms, before mu's cancellation: what its rounding scales.
  return new, mu, nu, mu_terms * c1 / denominator + np.abs(decay)


def _seed(master, params):
  """The master a re-seeded step starts from (the test's own params)."""
  if params is None:
    return master
  p = np.asarray(jnp.asarray(params).astype(jnp.float32))
  if params.dtype == jnp.float32:
    return p
  changed = np.zeros(master.shape, bool)
  changed.reshape(master.shape[0], -1)[:, ::3] = True
  return np.where(changed, p, master)


def _check_float64(got, master, mu, nu, grads, params):
  g = np.asarray(jnp.asarray(grads).astype(jnp.float32))
  seed = _seed(master, params)
  want_m, want_mu, want_nu, terms = _float64_step(seed, mu, nu, g)
  # A few roundings of each term's magnitude (the scalars and bias
  # corrections reach the kernel rounded to fp32).
  lr, b1, b2 = HYPER.learning_rate, HYPER.b1, HYPER.b2
  bound_mu = 8 * U * (b1 * np.abs(mu) + (1 - b1) * np.abs(g))
  bound_nu = 8 * U * (b2 * nu + (1 - b2) * g * g)
  bound_m = 4 * U * np.abs(seed) + 32 * U * lr * terms + 1e-30
  for name, x, want, bound in (
    ('master', got[0], want_m, bound_m),
    ('mu', got[1], want_mu, bound_mu),
    ('nu', got[2], want_nu, bound_nu),
  ):
    err = np.abs(np.asarray(x, np.float64) - want)
    assert np.all(err <= bound), (name, float(np.max(err / bound)))


def _case(rows, n, grad_dtype, reseed, seed=0):
  rng = np.random.default_rng(seed)
  master, mu, nu = _state(rng, (rows, n))
  grads = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32).astype(
    grad_dtype
  )
  params = _params(master, grad_dtype) if reseed else None
  return master, mu, nu, grads, params


@pytest.mark.parametrize('reseed', [False, True])
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('n', [1, 7, 1000])
@pytest.mark.parametrize('rows', [1, 3])
def test_rows_in_a_scan_are_the_buckets_bits(rows, n, grad_dtype, reseed):
  master, mu, nu, grads, params = _case(rows, n, grad_dtype, reseed)
  want = _bucket(
    [master], [mu], [nu], [grads], None if params is None else [params]
  )
  got = _scanned(
    [jnp.asarray(master)],
    [jnp.asarray(mu)],
    [jnp.asarray(nu)],
    [grads],
    None if params is None else [params],
  )
  for name, x, y in zip(('master', 'mu', 'nu'), got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
  assert not np.array_equal(np.asarray(got[0]), master)  # It stepped.
  _check_float64(got, master, mu, nu, grads, params)


def test_several_leaves_and_rows_across_work_chunks():
  # Two leaves of other shapes in one call; rows longer than the kernel's
  # 2**18-element work chunk and its 16K-element re-seed block.
  rng = np.random.default_rng(5)
  shapes = [(3, 2**18 + 5), (3, 2, 5)]
  state = [_state(rng, s) for s in shapes]
  grads = [jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in shapes]
  params = [_params(m, jnp.bfloat16) for m, _, _ in state]
  runs = [[x[r] for x in state] for r in range(3)]
  want = _bucket(*runs, grads, params)
  got = _scanned(
    *[[jnp.asarray(x) for x in run] for run in runs], grads, params
  )
  for x, y in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for j in range(2):
    _check_float64(got[j::2], *state[j], grads[j], params[j])


@functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
def _scanned_weights(master, mu, nu, weights, grads):
  """`_scanned` with stacked 16-bit weights, which the rows write too."""

  def body(total, xs):
    i, g = xs
    grace_adam.adam_step_row(master, mu, nu, g, i, HYPER, weights=weights)
    return total + g[0].ravel()[0].astype(jnp.float32), None

  rows = jnp.arange(master[0].shape[0])
  done, _ = jax.lax.scan(body, 0.0, (rows, grads))
  return _join([*master, *mu, *nu, *weights], done.astype(jnp.int32))


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
def test_rows_write_their_weights_rounded_from_the_new_master(dtype):
  # Two leaves, one longer than a work chunk; each row's 16-bit weights
  # are its new master rounded to nearest even, as XLA's conversion
  # rounds it, and the state the same bits as without them.
  rng = np.random.default_rng(9)
  shapes = [(3, 2**18 + 5), (3, 2, 5)]
  state = [_state(rng, s) for s in shapes]
  grads = [jnp.asarray(rng.normal(size=s), dtype) for s in shapes]
  runs = [[x[r] for x in state] for r in range(3)]
  want = _bucket(*runs, grads, None)
  weights = [jnp.full(s, 7.0, dtype) for s in shapes]
  got = _scanned_weights(
    *[[jnp.asarray(x) for x in run] for run in runs], weights, grads
  )
  for x, y in zip(got[:6], want, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for w, m in zip(got[6:], got[:2], strict=True):
    assert w.dtype == dtype
    np.testing.assert_array_equal(
      np.asarray(w).view(np.uint16), np.asarray(m.astype(dtype)).view(np.uint16)
    )


def test_weights_that_do_not_fit_are_refused():
  master, mu, nu, grads, _ = _case(3, 7, jnp.float32, False)
  message = r'leaf 0: weights must be bf16 or f16'
  for weights in (np.zeros((3, 7), np.float32), np.zeros((3, 8), jnp.bfloat16)):
    with pytest.raises(ValueError, match=message):
      grace_adam.adam_step_row(
        [master], [mu], [nu], [grads[0]], 0, HYPER, weights=[weights]
      )


def _one_row(master, mu, nu, grad, row):
  rows = jnp.asarray([row], jnp.int32)
  return _scanned([master], [mu], [nu], [grad[None]], None, rows)


@pytest.mark.parametrize('row', [3, -1, 1 << 20])
def test_a_row_outside_the_stack_is_an_error(row):
  master, mu, nu, grads, _ = _case(3, 7, jnp.float32, False)
  with pytest.raises(Exception, match=rf'row {row} is outside \[0, 3\).*L = 3'):
    jax.block_until_ready(_one_row(master, mu, nu, grads[0], row))


def test_one_row_steps_and_the_others_stay():
  master, mu, nu, grads, _ = _case(3, 7, jnp.float32, False)
  got = np.asarray(_one_row(master, mu, nu, grads[2], 2)[0])
  np.testing.assert_array_equal(got[:2], master[:2])
  want = _bucket([master], [mu], [nu], [grads], None)[0]
  np.testing.assert_array_equal(got[2], np.asarray(want)[2])


@pytest.mark.parametrize(
  ('change', 'message'),
  [
    (dict(master=np.zeros((3, 7), np.float16)), r'leaf 0: master must be f32'),
    (dict(mu=np.zeros((3, 8), np.float32)), r'leaf 0: mu must be f32\[L'),
    (dict(grad=np.zeros((8,), np.float32)), r'not 3 rows of the row shape'),
  ],
)
def test_leaves_that_do_not_fit_are_refused(change, message):
  master, mu, nu, grads, _ = _case(3, 7, jnp.float32, False)
  args = dict(master=master, mu=mu, nu=nu, grad=grads[0]) | change
  with pytest.raises(ValueError, match=message):
    grace_adam.adam_step_row(
      [args['master']], [args['mu']], [args['nu']], [args['grad']], 0, HYPER
    )


def _raw_row_call(master, grad, row=0, *weights):
  """The target called directly, past the Python checks."""
  call = jax.ffi.ffi_call(
    grace_adam.ADAM_STEP_ROW_TARGET, (), has_side_effect=True
  )
  call(
    jnp.asarray(HYPER.count, jnp.int32),
    HYPER.packed(),
    jnp.asarray([row], jnp.int32),
    master,
    master,
    master,
    grad,
    *weights,
    **grace_adam._bucket_attrs(HYPER, 1),
  )


@pytest.mark.parametrize(
  ('master', 'grad', 'message'),
  [
    (np.zeros(10, np.float32), np.zeros(3, np.float32), 'not a whole number'),
    (np.zeros(9, np.float16), np.zeros(3, np.float32), 'state must be f32'),
    (np.zeros(9, np.float32), np.zeros(3, np.int32), 'gradient dtype must'),
  ],
)
def test_the_handler_checks_its_operands(master, grad, message):
  with pytest.raises(Exception, match=message):
    jax.block_until_ready(jax.jit(_raw_row_call)(master, grad))


@pytest.mark.parametrize(
  ('weights', 'message'),
  [
    (np.zeros(9, np.float32), 'stacked weights must be bf16 or f16'),
    (np.zeros(8, jnp.bfloat16), 'has 8 elements, expected 9'),
  ],
)
def test_the_handler_checks_its_weights(weights, message):
  master, grad = np.zeros(9, np.float32), np.zeros(3, np.float32)
  with pytest.raises(Exception, match=message):
    jax.block_until_ready(jax.jit(_raw_row_call)(master, grad, 0, weights))


def _custom_calls(fn, *args) -> list[str]:
  """The row step's custom call in `fn`'s StableHLO, SSA names dropped."""
  text = jax.jit(fn).lower(*args).as_text()
  calls = [x for x in text.splitlines() if grace_adam.ADAM_STEP_ROW_TARGET in x]
  return [re.sub(r'%[\w#.:]+', '%', x.split(' loc(')[0]) for x in calls]


def test_the_probe_calls_the_row_step_as_the_binding_does(monkeypatch):
  # experiments/device/probe_scan_start.py may not import the binding: it
  # spells out the call the stream executor's placement makes.
  from experiments.device import probe_scan_start as probe

  for name in ('JAX_SUPEROFFLOAD_PREFETCH', 'JAX_SUPEROFFLOAD_HOST_THREADS'):
    monkeypatch.delenv(name, raising=False)
  hyper = Hyperparams(count=3, learning_rate=1e-3)
  stack = jax.ShapeDtypeStruct((probe.LAYERS, probe.WIDTH), jnp.float32)
  args = (
    stack,
    stack,
    stack,
    jax.ShapeDtypeStruct((probe.WIDTH,), jnp.float32),
    jax.ShapeDtypeStruct((), jnp.int32),
  )
  place = grace_adam.StreamPlace(
    staging_bytes=int(probe.ROW_ATTRS['staging_bytes'])
  )

  def binding(m, u, v, g, i):
    grace_adam.adam_step_row([m], [u], [v], [g], i, hyper, place=place)

  def spelled_out(m, u, v, g, i):
    probe._row_start((m, u, v), g, i, hyper)

  want = _custom_calls(binding, *args)
  assert len(want) == 1 and 'staging_bytes = 262912' in want[0]
  assert _custom_calls(spelled_out, *args) == want


@jax.jit
def _stacked_rows(master, mu, nu, grads):
  """adam_step_row of the stacked gradient from a scan's loop, last row
  first, its row a cursor; the join after it, on the passed gradient."""
  cursor = grace_adam.row_cursor(master[0].shape[0])

  def body(grads, _):
    return grace_adam.adam_step_row(master, mu, nu, grads, cursor, HYPER), None

  grads, _ = jax.lax.scan(body, grads, None, length=master[0].shape[0])
  barrier = grads[0].ravel()[0].astype(jnp.float32).view(jnp.int32)
  return _join([*master, *mu, *nu], barrier)


# A stacked gradient (shaped like the master) is read at the cursor's next
# row, counting down from L: three steps take rows 2, 1, 0, each the
# bucket's bits for its row with its own gradient.
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_a_stacked_gradient_is_stepped_a_row_at_a_time_from_its_cursor(
  grad_dtype,
):
  master, mu, nu, grads, _ = _case(3, 1000, grad_dtype, False)
  want = _bucket([master], [mu], [nu], [grads], None)
  got = _stacked_rows(
    [jnp.asarray(master)], [jnp.asarray(mu)], [jnp.asarray(nu)], [grads]
  )
  for x, y in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@jax.jit
def _rows_over_grads(master, mu, nu, grads):
  """`_stacked_rows` with the new weights written over the gradient."""
  cursor = grace_adam.row_cursor(master[0].shape[0])

  def body(grads, _):
    out = grace_adam.adam_step_row(
      master, mu, nu, grads, cursor, HYPER, weights_over_grads=True
    )
    return out, None

  grads, _ = jax.lax.scan(body, grads, None, length=master[0].shape[0])
  barrier = grads[0].ravel()[0].astype(jnp.float32).view(jnp.int32)
  joined = _join([*master, *mu, *nu], barrier)
  return [*joined, *grace_adam.written_rows(grads, joined[0])]


# With the weights over the gradient, each row of the stacked gradient is
# left holding that row's new master in the gradient's dtype (rounded to
# nearest even, as the buckets round), and the state is the bucket's as
# without them: every row was read before it was written.
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_row_steps_write_their_new_weights_over_the_stacked_gradient(
  grad_dtype,
):
  master, mu, nu, grads, _ = _case(3, 1000, grad_dtype, False, seed=3)
  want = _bucket([master], [mu], [nu], [grads], None)
  got = _rows_over_grads(
    [jnp.asarray(master)], [jnp.asarray(mu)], [jnp.asarray(nu)], [grads]
  )
  for x, y in zip(got[:3], want, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_array_equal(
    np.asarray(got[3]), np.asarray(jnp.asarray(want[0]).astype(grad_dtype))
  )


def test_weights_over_grads_needs_stacked_gradients():
  master, mu, nu, grads, _ = _case(3, 7, jnp.float32, False)
  with pytest.raises(
    ValueError, match='weights_over_grads writes over stacked'
  ):
    grace_adam.adam_step_row(
      [master], [mu], [nu], [grads[0]], 0, HYPER, weights_over_grads=True
    )


def test_a_stacked_gradients_row_must_be_a_cursor():
  master, mu, nu, grads, _ = _case(3, 7, jnp.float32, False)
  with pytest.raises(ValueError, match=r'row is a cursor, an int32\[1\]'):
    grace_adam.adam_step_row([master], [mu], [nu], [grads], 0, HYPER)
