"""Adversarial checks of `overlap_scan` with bf16 and f16 stacks.

A 16-bit stack's rows re-seed their fp32 masters from the weights and the
new masters are rounded on the device after the join; the buckets round
on the host (cast='host') or the device. The scoped step must equal the
same jitted step without the scope, bit for bit: every leaf is compared
by value and by its raw bits (so -0.0 against 0.0, or another NaN
payload, is a difference too), after five steps unless said otherwise.
All hold; `update` given other params or another count than the scope
was opened with (which stepped silently with the scope's) is refused.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload
from tests import state_compare
from tests import test_overlap_scan_attack as attack

D = attack.D
LOWP = [jnp.bfloat16, jnp.float16]
F16_MAX = 65504.0
ROW = 'custom_call_target="jax_superoffload_adam_step_row"'


def _tx(lr=1e-2, cast='host', **kw):
  offload = {'executor': 'stream', 'cast': cast, **kw.pop('offload', {})}
  kw.setdefault('weight_decay', 0.1)
  return superoffload.adamw(lr, offload=superoffload.Offload(**offload), **kw)


def _body(layer, c):
  # Every leaf but `w` enters through sin, so that huge, tiny and
  # non-finite weights all get gradients of their own.
  h = c @ layer['w'].astype(jnp.float32)
  for name in sorted(layer):
    if name not in ('w', 'z'):  # `z`'s gradient is zero.
      h = h + jnp.mean(jnp.sin(layer[name].astype(jnp.float32)))
  return jnp.tanh(h), None


def _loss(params, x, policy='stationary'):
  scan = functools.partial(
    superoffload.weight_flow_scan, policy=policy, params_path='blocks'
  )
  c, _ = scan(_body, x * params['scale'], params['blocks'])
  return jnp.mean(c**2)


LOSS = _loss
FLOW = functools.partial(_loss, policy='flow')


def _make(dtype, values=None, n=D, layers=3, flow=False, **extra):
  """A stack of `w` (D, D) and `s` (n,) per layer; `values` fill `s`."""

  def make():
    k = jax.random.split(jax.random.key(3), 2)
    s = 0.3 * jax.random.normal(k[1], (layers, n))
    if values is not None:
      s = jnp.resize(jnp.asarray(values, jnp.float32), (layers, n))
    blocks = {
      'w': (0.3 * jax.random.normal(k[0], (layers, D, D))).astype(dtype),
      's': s.astype(dtype),
      **{name: f(layers) for name, f in extra.items()},
    }
    if flow:
      blocks = superoffload.offload_stacked(blocks)
    return {'scale': jnp.ones((D,)), 'blocks': blocks}

  return make


def _run(
  tx, make, scoped, steps=5, donate=True, edit=None, loss=LOSS, build=None
):
  """The params and state after `steps`, and the compiled row calls."""
  params = make()
  state = tx.init(params)
  step = (build or attack._step)(tx, loss, scoped, donate=donate)
  step = step.lower(params, state, attack._batch(0)).compile()
  rows = step.as_text().count(ROW)
  for i in range(steps):
    if edit is not None:
      params = edit(i, params)
    params, state = step(params, state, attack._batch(i))
  return jax.tree.map(np.asarray, (params, state)), rows


def _bits(x: np.ndarray) -> np.ndarray:
  return x.view({2: np.uint16, 4: np.uint32}.get(x.itemsize, np.uint8))


def _same(tx, make, rows, steps=5, loss=LOSS, bits=True, **kw):
  """Scoped equals unscoped; `rows` row calls are compiled in the loop."""
  a, started = _run(tx, make, True, steps, loss=loss, **kw)
  b, _ = _run(tx, make, False, steps, loss=loss, **kw)
  assert started == rows
  a, b = state_compare.without_digest(a), state_compare.without_digest(b)
  flat_a, tree_a = jax.tree.flatten_with_path(a)
  flat_b, tree_b = jax.tree.flatten_with_path(b)
  assert tree_a == tree_b
  for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
    where = jax.tree_util.keystr(path)
    np.testing.assert_array_equal(x, y, err_msg=where)
    if bits:
      np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=where)
  return a


@pytest.mark.parametrize(
  'dtype, cast, flow, donate',
  [
    (jnp.bfloat16, 'host', False, True),
    (jnp.float16, 'device', False, False),
    (jnp.bfloat16, 'device', True, True),
    (jnp.float16, 'host', True, True),
  ],
  ids=['bf16-host', 'f16-device-kept', 'bf16-device-flow', 'f16-host-flow'],
)
def test_plain_stacks_keep_the_bits(dtype, cast, flow, donate):
  make = _make(dtype, flow=flow)
  _same(_tx(cast=cast), make, 1, donate=donate, loss=FLOW if flow else LOSS)


# Values of `s` per case: (dtype, values, learning rate).
EDGES = {
  'f16_max': (jnp.float16, [F16_MAX, -F16_MAX, 65000.0, 65440.0, 1.0], 1e-2),
  'f16_overflow': (jnp.float16, [F16_MAX, -65400.0, 65000.0, 2.0, -3.0], 64.0),
  'f16_subnormal': (jnp.float16, [6e-8, -3e-7, 1e-6, 6.1e-5, 0.0], 1e-6),
  'bf16_crossing': (jnp.bfloat16, [1e-4, -1e-4, 3e-3, -0.0, 0.0], 1e-2),
  'bf16_huge_lr': (jnp.bfloat16, [0.5, -0.25, 1e-3, 3.0, -7.0], 100.0),
  'f16_huge_lr': (jnp.float16, [0.5, -0.25, 1e-3, 3.0, -7.0], 30.0),
}


@pytest.mark.parametrize(
  'case, cast',
  [(case, 'host') for case in EDGES] + [('f16_overflow', 'device')],
)
def test_edge_weights_keep_the_bits(case, cast):
  # f16_overflow: a weight rounds to inf, sin(inf) makes every gradient
  # NaN from then on; the NaNs' payloads (rounded on the host by the
  # buckets, on the device after the rows) are compared bit for bit.
  dtype, values, lr = EDGES[case]
  # `s` has 5 elements a row, and a 1- and a 3-element leaf ride along.
  odd = {
    f'o{n}': lambda layers, n=n: jnp.full((layers, n), 0.7, dtype)
    for n in (1, 3)
  }
  make = _make(dtype, values, n=5, **odd)
  _same(_tx(lr, cast=cast), make, 1)


def test_f16_subnormal_weights_halved_by_decay_keep_the_bits():
  # `z` has no gradient: weight decay of lr * wd = 0.5 halves its master
  # each step, through the f16 subnormals and their rounding to zero.
  # (bf16's subnormals are fp32 subnormals, which XLA:CPU flushes to zero
  # on both sides.)
  tiny = jnp.asarray([6e-8, -1.8e-7, 3e-5, -1e-4], jnp.float16)
  make = _make(jnp.float16, z=lambda n: jnp.resize(tiny, (n, 4)))
  params, _ = _same(_tx(1.0, weight_decay=0.5), make, 1, steps=6)
  z = params['blocks']['z'].astype(np.float32)
  assert 0 < np.count_nonzero(z) < z.size, z  # Some reached zero.


def _edit(i, params):
  """Before step 2: the user re-seeds `s`, and sets NaN, infs and -0 in `z`."""
  if i != 2:
    return params
  b = params['blocks']
  s = b['s'].at[0].add(0.25).at[2].multiply(-1).at[1, 3].set(-0.0)
  bad = jnp.asarray([jnp.nan, jnp.inf, -jnp.inf, -0.0], b['z'].dtype)
  z = b['z'].at[1].set(bad)
  return {**params, 'blocks': {**b, 's': s, 'z': z}}


@pytest.mark.parametrize(
  'dtype, cast, lr, n, calls',
  [
    (jnp.bfloat16, 'host', 30.0, 100_003, 2),
    (jnp.float16, 'device', 1e-2, D, 1),
  ],
  ids=['bf16-host-huge', 'f16-device'],
)
def test_weights_edited_between_steps_keep_the_bits(dtype, cast, lr, n, calls):
  # bf16: rows of 100003 elements cross the host's re-seed blocks (16K)
  # and the buckets' chunks (256K) off their alignment; lr 30 makes the
  # re-seed tolerance (lr / 16) decide. Such a row (200 KB) is a row call
  # of its own (scan_scope.OWN_CALL_BYTES).
  make = _make(dtype, n=n, z=lambda layers: jnp.full((layers, 4), 0.5, dtype))
  params, _ = _same(_tx(lr, cast=cast), make, calls, edit=_edit)
  z = params['blocks']['z']
  z = z.astype(np.float32)
  assert np.isnan(z[1, :3]).all() and z[1, 3] == 0  # inf - lr * wd * inf.
  assert np.isfinite(z[[0, 2]]).all()


def _nan_some_steps(params, x):
  return LOSS(params, x) * jnp.where(x[0, 0] > 0.0, jnp.nan, 1.0)


@pytest.mark.parametrize(
  'dtype, skip',
  [(jnp.bfloat16, False), (jnp.float16, True)],
  ids=['bf16', 'f16-skip'],
)
def test_nonfinite_gradients_keep_the_bits(dtype, skip):
  assert [attack._batch(i)[0, 0] > 0 for i in range(5)].count(True) in (
    1,
    2,
    3,
    4,
  )
  tx = _tx(offload={'skip_nonfinite': skip})
  _same(tx, _make(dtype), 0 if skip else 1, loss=_nan_some_steps)


def _mixed(layers=3):
  k = jax.random.split(jax.random.key(5), 4)
  blocks = {
    'w': 0.3 * jax.random.normal(k[0], (layers, D, D)),
    's': (0.3 * jax.random.normal(k[1], (layers, 5))).astype(jnp.bfloat16),
    'h': (0.3 * jax.random.normal(k[2], (layers, 3))).astype(jnp.float16),
    'v': (0.3 * jax.random.normal(k[3], (layers, D, 1))).astype(jnp.bfloat16),
  }
  return {'scale': jnp.ones((D,)), 'blocks': blocks}


def _decay_mask(params):
  return jax.tree.map(lambda p: p.ndim >= 3, params)


@pytest.mark.parametrize(
  'make_tx, rows',
  [
    (lambda: _tx(mask=_decay_mask), 4),
    (lambda: _tx(cast='device', nesterov=True, mask=_decay_mask), 4),
    (
      lambda: _tx(
        optax.linear_schedule(1e-2, 10.0, 4),
        weight_decay=optax.linear_schedule(0.5, 0.0, 4),
        b1=0.5,
        eps_root=1e-8,
      ),
      3,
    ),
    (
      lambda: superoffload.adam(
        0.05, offload=superoffload.Offload(executor='stream', cast='host')
      ),
      3,
    ),
  ],
  ids=['mask', 'nesterov_device', 'schedules', 'adam'],
)
def test_a_stack_mixing_fp32_bf16_and_f16_keeps_the_bits(make_tx, rows):
  _same(make_tx(), _mixed, rows)


def _project(params, state):
  b = params['blocks']
  return state, {**params, 'blocks': {**b, 's': b['s'].at[0].add(0.25)}}


def _count(params, state):
  return state.replace(count=state.count + 3), params


def _changed_before_update(change):
  # `update` gets other params (a constraint applied after the gradient)
  # or another state than the scope was opened with.
  def build(tx, loss, scoped, donate=True):
    def step(params, state, x):
      if not scoped:
        g = jax.grad(loss)(params, x)
        return superoffload.update_offloaded(tx, g, *change(params, state))
      with superoffload.overlap_scan(tx, state, params):
        g = jax.grad(loss)(params, x)
        return superoffload.update_offloaded(tx, g, *change(params, state))

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())

  return build


@pytest.mark.parametrize(
  'dtype, change, lr',
  [
    (jnp.float32, _project, 1e-2),
    (jnp.bfloat16, _project, 1e-2),
    (jnp.bfloat16, _count, optax.linear_schedule(1e-2, 1.0, 10)),
  ],
  ids=['f32-params', 'bf16-params', 'bf16-count'],
)
def test_update_given_other_params_or_state_is_refused(dtype, change, lr):
  # The rows stepped the scope's count from the scope's params: an update
  # given others (a projection after the gradient, a moved count) stepped
  # other numbers silently before; now it is refused at trace time.
  build = _changed_before_update(change)
  with pytest.raises(ValueError, match=r'other than the one|count is not'):
    _same(_tx(lr), _make(dtype), 1, build=build)
