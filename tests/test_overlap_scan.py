"""Host steps started inside a scanned stack's backward loop.

`superoffload.overlap_scan` around the gradient and the update, with
``weight_flow_scan(..., params_path=...)``, moves each layer's host step
into the backward loop (`adam_step_row` on its row). The numbers must be
those of the same step without the scope, bit for bit, and within fp32
rounding of optax.adamw's; the old state a caller did not donate must stay
as it was; and whatever the row step does not take exactly must keep its
start after the loop.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload
from tests import state_compare

L, D = 3, 64


def _params(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 4)
  return {
    'scale': 1.0 + 0.1 * jax.random.normal(k[0], (D,)),
    'blocks': {
      'w': (0.2 * jax.random.normal(k[1], (L, D, D))).astype(dtype),
      'b': 0.1 * jax.random.normal(k[2], (L, D)),
      'norm': 1.0 + 0.1 * jax.random.normal(k[3], (L, D)),
    },
  }


def _loss(params, x, policy='stationary', path='blocks'):
  def body(layer, c):
    h = c @ layer['w'].astype(jnp.float32) + layer['b']
    return jnp.tanh(h) * layer['norm'], None

  c, _ = superoffload.weight_flow_scan(
    body, x * params['scale'], params['blocks'], policy=policy, params_path=path
  )
  return jnp.mean(c**2)


def _no_decay_on_vectors(params):
  return jax.tree.map(lambda p: p.ndim >= 3, params)


def _tx(mu_dtype=None, **offload):
  return superoffload.adamw(
    1e-2,
    weight_decay=0.1,
    mask=_no_decay_on_vectors,
    mu_dtype=mu_dtype,
    offload=superoffload.Offload(**{'executor': 'stream', **offload}),
  )


def _update(tx, g, state, params):
  # Host-resident (weight-flow) weights are updated on device copies.
  return superoffload.update_offloaded(tx, g, state, params)


def _step(tx, scoped, donate, policy='stationary', path='blocks', **scope):
  def step(params, state, x):
    loss_fn = functools.partial(_loss, policy=policy, path=path)
    if not scoped:
      g = jax.grad(loss_fn)(params, x)
      return _update(tx, g, state, params)
    with superoffload.overlap_scan(tx, state, params, **scope):
      g = jax.grad(loss_fn)(params, x)
      return _update(tx, g, state, params)

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def _batch(i):
  return jax.random.normal(jax.random.key(10 + i), (8, D))


def _place(params, policy):
  if policy == 'flow':
    blocks = superoffload.offload_stacked(params['blocks'])
    return {**params, 'blocks': blocks}
  return params


def _run(
  tx,
  scoped,
  donate=True,
  policy='stationary',
  steps=3,
  edit=None,
  dtype=None,
  **scope,
):
  params = _params(dtype or jnp.float32)
  state = tx.init(params)
  params = _place(params, policy)
  step = _step(tx, scoped, donate, policy, **scope)
  for i in range(steps):
    if edit is not None and i == 1:
      params = edit(params)
    params, state = step(params, state, _batch(i))
  return jax.tree.map(np.asarray, (params, state))


def _rows_in_loop(
  tx, policy='stationary', dtype=jnp.float32, **scope
) -> list[str]:
  """The compiled row steps' lines that sit in a while loop's body."""
  params = _place(_params(dtype), policy)
  state = tx.init(_params(dtype))
  hlo = (
    _step(tx, True, True, policy, **scope)
    .lower(params, state, _batch(0))
    .compile()
    .as_text()
  )
  rows = [
    line
    for line in hlo.splitlines()
    if 'custom_call_target="jax_superoffload_adam_step_row"' in line
  ]
  assert all('while/body' in line for line in rows), rows
  return rows


def _assert_bitwise(a, b):
  a, b = state_compare.without_digest(a), state_compare.without_digest(b)
  flat_a, tree_a = jax.tree.flatten(a)
  flat_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(flat_a, flat_b, strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize('policy', ['stationary', 'flow'])
@pytest.mark.parametrize('donate', [True, False], ids=['donated', 'kept'])
def test_steps_in_the_loop_equal_the_step_without_the_scope(policy, donate):
  tx = _tx()
  # Two calls per layer: the decayed matrices and the undecayed vectors.
  assert len(_rows_in_loop(tx, policy)) == 2
  _assert_bitwise(
    _run(tx, True, donate, policy), _run(tx, False, donate, policy)
  )


# consume_gradients=True (or JAX_SUPEROFFLOAD_SCAN_ROWS=held for every
# scope): the stack's backward loop is the library's (row_backward), and
# the rows read the stacked gradient, which each call passes on (a result
# per leaf) with the row's new weights written over it. The numbers stay
# those of the step without the scope, bit for bit; weight flow keeps the
# layer hooks.
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('how', ['option', 'environment'])
def test_consuming_rows_read_the_stacked_gradient_and_keep_the_numbers(
  monkeypatch, dtype, how
):
  scope = {'consume_gradients': True}
  monkeypatch.delenv('JAX_SUPEROFFLOAD_SCAN_ROWS', raising=False)
  if how == 'environment':
    monkeypatch.setenv('JAX_SUPEROFFLOAD_SCAN_ROWS', 'held')
    scope = {}
  tx = _tx()
  rows = _rows_in_loop(tx, dtype=dtype, **scope)
  assert len(rows) == 2 and not any(' = () custom-call' in r for r in rows)
  assert all('weights_over_grads = true' in r for r in rows), rows
  flow = _rows_in_loop(tx, 'flow', **scope)
  assert len(flow) == 2
  assert not any('weights_over_grads = true' in r for r in flow)
  _assert_bitwise(
    _run(tx, True, dtype=dtype, **scope), _run(tx, False, dtype=dtype)
  )
  # Without the option, the rows are the layers' and write no weights.
  if how == 'option':
    rows = _rows_in_loop(tx, dtype=dtype)
    assert not any('weights_over_grads = true' in r for r in rows), rows


# Consuming rows write the new weights over the stacked gradient, so the
# gradient the caller gets has no value: anything that reads it (a norm
# to log, the step's output) is refused when the step is compiled, naming
# the leaf, instead of reading weights as gradients. Passing it to update
# alone is the step above.
@pytest.mark.parametrize(
  'read',
  [
    lambda g: sum(jnp.sum(x * x) for x in jax.tree.leaves(g)),
    lambda g: g['blocks']['w'],
  ],
  ids=['norm', 'returned'],
)
def test_a_consumed_gradient_may_only_go_to_update(read):
  tx = _tx()
  params = _params()

  @jax.jit
  def step(params, state, x):
    with superoffload.overlap_scan(tx, state, params, consume_gradients=True):
      g = jax.grad(_loss)(params, x)
      u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state, read(g)

  with pytest.raises(ValueError, match=r"gradient of \['blocks'\].* only"):
    step(params, tx.init(params), _batch(0))


# The rows start in the backward loop whatever follows; an update traced
# in a branch of lax.cond (a step skipped when not finite) would leave
# them unjoined, still writing, when the branch is not taken. Refused when
# traced, with or without consuming. Failed before: it compiled.
@pytest.mark.parametrize('consume', [False, True])
def test_an_update_inside_a_cond_branch_is_refused(consume):
  tx = _tx()
  params = _params()

  @jax.jit
  def step(params, state, x):
    with superoffload.overlap_scan(
      tx, state, params, consume_gradients=consume
    ):
      loss, g = jax.value_and_grad(_loss)(params, x)

      def apply():  # Closes over the gradients and the state.
        u, new = tx.update(g, state, params)
        return optax.apply_updates(params, u), new

      return jax.lax.cond(jnp.isfinite(loss), apply, lambda: (params, state))

  with pytest.raises(ValueError, match='inside control flow'):
    step(params, tx.init(params), _batch(0))


# A jit that keeps what nothing reads (keep_unused=True) compiles the
# consumed gradient too: refused the same way, with the reason.
def test_a_jit_that_keeps_unused_values_cannot_consume():
  tx = _tx()
  params = _params()

  def step(params, state, x):
    with superoffload.overlap_scan(tx, state, params, consume_gradients=True):
      g = jax.grad(_loss)(params, x)
      u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  with pytest.raises(ValueError, match='keep_unused=True'):
    jax.jit(step, keep_unused=True)(params, tx.init(params), _batch(0))


def test_a_bad_scan_rows_setting_names_the_variable(monkeypatch):
  monkeypatch.setenv('JAX_SUPEROFFLOAD_SCAN_ROWS', 'stacked')
  with pytest.raises(ValueError, match=r"JAX_SUPEROFFLOAD_SCAN_ROWS='stacked'"):
    _run(_tx(), True, steps=1)


def _rounded_b(b: float) -> float:
  """The relative error of 1 - b when b is rounded to fp32 first."""
  return abs(float(np.float32(b)) - b) / (1 - b)


def test_steps_in_the_loop_are_adamw_to_fp32_rounding():
  """Against optax.adamw (its own fp32 math), not the library's path.

  One step from the same weights and the same gradients. What
  may differ: the new weight's rounding, a few units in its last place;
  and the update's (|u| <= lr * (1 + wd * |w|) < 0.011), a few units in
  its last place, plus optax's own deviation from the formula: it takes
  the bias corrections 1 - b^t from b rounded to fp32, which moves
  1 - b2 by 1.3e-5 relative and the update by half that (the kernel
  rounds 1 - b, taken in double, once).
  """
  tx = _tx()
  params = _params()

  @jax.jit
  def step(params, state, x):
    with superoffload.overlap_scan(tx, state, params):
      g = jax.grad(_loss)(params, x)
      u, _ = tx.update(g, state, params)
    return optax.apply_updates(params, u)

  got = step(params, tx.init(params), _batch(0))
  # The same gradient, taken apart (held rows consume the step's own).
  g = jax.jit(jax.grad(_loss))(params, _batch(0))
  ref = optax.adamw(1e-2, weight_decay=0.1, mask=_no_decay_on_vectors)
  u, _ = ref.update(g, ref.init(params), params)
  want = optax.apply_updates(params, u)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    y = np.asarray(y)
    bound = 2 * np.spacing(np.abs(y)) + 0.011 * (
      _rounded_b(0.999) / 2 + _rounded_b(0.9) + 8 * 2.0**-24
    )
    assert np.all(np.abs(x - y) <= bound), np.max(np.abs(x - y) / bound)


def test_a_caller_that_does_not_donate_keeps_its_state():
  tx = _tx()
  params = _params()
  state = tx.init(params)
  before = jax.tree.map(lambda x: np.array(x, copy=True), state)
  _, new = _step(tx, True, False)(params, state, _batch(0))
  _assert_bitwise(jax.tree.map(np.asarray, state), before)
  assert not np.array_equal(
    new.master['blocks']['w'], before.master['blocks']['w']
  )


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_edited_weights_reseed_the_rows_as_the_buckets_do(dtype):
  def edit(params):
    w = params['blocks']['w'].at[1, ::3].add(0.25)
    return {**params, 'blocks': {**params['blocks'], 'w': w}}

  tx = _tx()
  run = functools.partial(_run, tx, edit=edit, dtype=dtype)
  _assert_bitwise(run(True), run(False))


@pytest.mark.parametrize(
  'make',
  [
    lambda: _tx(executor='ffi'),
    lambda: _tx(clip_norm=1.0),
    lambda: _tx(moments_8bit=True),
    lambda: _tx(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), _tx()),
    lambda: optax.adamw(1e-2),
  ],
  ids=['ffi', 'stv', '8bit', 'bf16', 'chain', 'optax'],
)
def test_what_the_row_step_does_not_take_keeps_its_start_after_the_loop(make):
  tx = make()
  assert not _rows_in_loop(tx)
  _assert_bitwise(_run(tx, True, steps=2), _run(tx, False, steps=2))


@pytest.mark.parametrize('cast', ['host', 'device'])
@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
def test_low_precision_leaves_of_a_stack_start_in_the_loop(dtype, cast):
  # The rows re-seed from the 16-bit weights and round the new master to
  # nearest even, as the buckets do on either side.
  tx = _tx(cast=cast)

  def run(scoped):
    params = _params(dtype)
    state = tx.init(params)
    step = _step(tx, scoped, True)
    for i in range(3):
      params, state = step(params, state, _batch(i))
    return jax.tree.map(np.asarray, (params, state))

  assert len(_rows_in_loop(tx, dtype=dtype)) == len(_rows_in_loop(tx))
  _assert_bitwise(run(True), run(False))


def _traced(tx, body):
  """Traces `body(params, state, grad_fn)` under jit with the scope's leaves."""
  params = _params()
  state = tx.init(params)
  grad_fn = jax.grad(_loss)
  return jax.jit(lambda p, s, x: body(p, s, lambda: grad_fn(p, x))).trace(
    params, state, _batch(0)
  )


def test_a_path_that_names_no_parameter_is_an_error():
  tx = _tx()

  def body(params, state, grads):
    with superoffload.overlap_scan(tx, state, params):
      return jax.grad(functools.partial(_loss, path='decoder'))(
        params, _batch(0)
      )

  with pytest.raises(ValueError, match=r"params_path \('decoder',\)"):
    _traced(tx, body)


def test_leaving_the_scope_without_the_update_is_an_error():
  tx = _tx()

  def body(params, state, grads):
    with superoffload.overlap_scan(tx, state, params):
      return grads()

  with pytest.raises(RuntimeError, match=r'tx\.update was not called'):
    _traced(tx, body)


@pytest.mark.parametrize('misuse', ['other_state', 'twice', 'no_params'])
def test_an_update_that_does_not_finish_the_rows_is_an_error(misuse):
  tx = _tx()

  def body(params, state, grads):
    with superoffload.overlap_scan(tx, state, params):
      g = grads()
      if misuse == 'other_state':
        return tx.update(g, tx.init(params), params)
      if misuse == 'no_params':
        return tx.update(g, state)
      tx.update(g, state, params)
      return tx.update(g, state, params)

  match = {
    'other_state': 'got another state',
    'twice': 'called twice',
    'no_params': 'call update with them',
  }[misuse]
  with pytest.raises(ValueError, match=match):
    _traced(tx, body)


def test_a_stack_used_twice_is_an_error():
  tx = _tx()

  def twice(params, x):
    return _loss(params, x) + _loss(params, 2 * x)

  def body(params, state, grads):
    with superoffload.overlap_scan(tx, state, params):
      g = jax.grad(twice)(params, _batch(0))
      return tx.update(g, state, params)

  with pytest.raises(ValueError, match=r"\['blocks'\]\[.*started twice"):
    _traced(tx, body)


def test_an_eager_step_equals_the_eager_step_without_the_scope():
  tx = _tx()

  def step(scoped):
    params = _params()
    state = tx.init(params)
    scope = superoffload.overlap_scan(tx, state, params)
    with scope if scoped else contextlib.nullcontext():
      g = jax.grad(_loss)(params, _batch(0))
      u, state = tx.update(g, state, params)
    return jax.tree.map(np.asarray, (optax.apply_updates(params, u), state))

  _assert_bitwise(step(True), step(False))


def _trainer_run(overlap: bool, **fields):
  """Three trainer steps: the state after them, and the compiled step."""
  from experiments.trainer import config as config_lib
  from experiments.trainer import steps as steps_lib

  cfg = config_lib.get_config(
    'demo',
    executor='stream',
    scan_layers=True,
    num_layers=3,
    d_model=64,
    num_heads=4,
    mlp_dim=128,
    seq_len=32,
    batch_size=4,
    overlap_scan=overlap,
    **fields,
  )
  rng = np.random.default_rng(0)
  trainable = steps_lib.build(cfg, steps_lib.make_mesh(cfg))
  state = trainable.state
  for _ in range(3):
    inputs, targets = rng.integers(0, cfg.vocab_size, (2, 4, 32))
    state, _ = trainable.train_step(state, inputs, targets)
  hlo = trainable.train_step.lower(state, inputs, targets).compile()
  return jax.tree.map(np.asarray, state), hlo.as_text()


@pytest.mark.parametrize('zero', [False, True], ids=['replicated', 'zero'])
def test_a_step_over_several_devices_starts_after_the_loop(zero):
  """XLA's SPMD partitioner refuses a side-effecting call without a
  sharding (a row step has no result to carry one): across devices the
  scope does nothing, and the trainer's numbers stay."""
  scoped, hlo = _trainer_run(True, mesh_data=2, zero=zero)
  assert 'jax_superoffload_adam_step_row' not in hlo
  _assert_bitwise(scoped, _trainer_run(False, mesh_data=2, zero=zero)[0])


@pytest.mark.parametrize(
  ('policy', 'dtype'),
  [('stationary', 'float32'), ('flow', 'float32'), ('stationary', 'bfloat16')],
)
def test_the_trainers_scanned_step_starts_rows_and_keeps_its_numbers(
  policy, dtype
):
  """The trainer opens the scope around nnx's gradient and nnx.Optimizer."""
  fields = {'weights_policy': policy, 'param_dtype': dtype}
  scoped, hlo = _trainer_run(True, **fields)
  assert 'custom_call_target="jax_superoffload_adam_step_row"' in hlo
  plain, hlo = _trainer_run(False, **fields)
  assert 'jax_superoffload_adam_step_row' not in hlo
  _assert_bitwise(scoped, plain)


def test_a_schedule_and_a_single_layer_keep_the_numbers():
  """A schedule's value reaches the rows as an operand (three layers: one
  row call); a one-layer stack starts nothing, and keeps its numbers."""
  schedule = optax.cosine_decay_schedule(1e-2, 10)
  tx = superoffload.adamw(
    schedule,
    weight_decay=0.1,
    offload=superoffload.Offload(executor='stream'),
  )

  def run(scoped):
    blocks = {'w': 0.3 * jnp.ones((1, D, D)), 'b': jnp.ones((1, D))}
    blocks['norm'] = jnp.ones((1, D))
    params = {'blocks': blocks, 'scale': jnp.ones((D,))}
    state = tx.init(params)
    step = _step(tx, scoped, True)
    for i in range(3):
      params, state = step(params, state, _batch(i))
    return jax.tree.map(np.asarray, (params, state))

  assert len(_rows_in_loop(tx)) == 1
  _assert_bitwise(run(True), run(False))


def _count_rows(tx, params, state) -> int:
  hlo = _step(tx, True, False).lower(params, state, _batch(0)).compile()
  return hlo.as_text().count(
    'custom_call_target="jax_superoffload_adam_step_row"'
  )


@pytest.mark.parametrize('target', ['concrete', 'abstract'])
def test_a_state_restored_by_orbax_keeps_its_rows_and_numbers(target, tmp_path):
  # A resumed run must still start its rows in the loop (the scope does
  # nothing for state typed as device memory) and take the same steps.
  ocp = pytest.importorskip('orbax.checkpoint')
  tx = _tx()
  step = _step(tx, True, False)
  params = _params()
  state = tx.init(params)
  params, state = step(params, state, _batch(0))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'state', state)
    checkpointer.wait_until_finished()
    like = tx.init(_params())
    if target == 'abstract':
      like = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = checkpointer.restore(tmp_path / 'state', like)
  assert _count_rows(tx, params, restored) == _count_rows(tx, params, state)
  assert _count_rows(tx, params, state) > 0
  resumed = step(params, restored, _batch(1))
  uninterrupted = step(params, state, _batch(1))
  _assert_bitwise(
    jax.tree.map(np.asarray, resumed), jax.tree.map(np.asarray, uninterrupted)
  )
