"""The `stream` executor reads the parameters only when they changed.

The state keeps a digest of the weights its master
rounds to (weights_digest.py), `update` compares it on the device with the
parameters it is given, and the host step skips the re-seed, and the copy,
where they are equal. Checked here against what the code does not define:

- the digest against a NumPy transcription of its definition (MurmurHash3's
  fmix32 over each element's bits), and against every one-element change;
- the stream executor against the "ffi" executor, which re-seeds from the
  parameters every step, bit for bit, through steady steps, loaded weights,
  an EMA swap, STV's redo and drop, bf16 and fp32 parameters and moments;
- a forged digest that claims changed parameters are unchanged: the step
  must then not read them, which is what saves the copy on a GPU (the copy
  itself is counted on the fake CUDA driver, stream_launch_test.cc).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload
from jax_superoffload._src.optim import options as options_lib
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.optim import weights_digest


def _fmix32(h: np.ndarray) -> np.ndarray:
  h = h.astype(np.uint64)
  mask = np.uint64(0xFFFFFFFF)
  h ^= h >> np.uint64(16)
  h = (h * np.uint64(0x85EBCA6B)) & mask
  h ^= h >> np.uint64(13)
  h = (h * np.uint64(0xC2B2AE35)) & mask
  h ^= h >> np.uint64(16)
  return h


def _reference(x: np.ndarray) -> np.ndarray:
  """The digest row from its definition, in NumPy (64-bit arithmetic)."""
  flat = np.ascontiguousarray(x).reshape(-1)
  words = flat.view(np.uint32 if flat.itemsize == 4 else np.uint16)
  words = words.astype(np.uint64)
  i = np.arange(words.size, dtype=np.uint64)
  mask = np.uint64(0xFFFFFFFF)
  out = []
  for mul, add in ((0x9E3779B9, 0x7F4A7C15), (0x85EBCA77, 0x165667B1)):
    key = (i * np.uint64(mul) + np.uint64(add)) & mask
    out.append(int(_fmix32(words ^ key).sum() & mask))
  return np.array(out, np.uint32)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16', 'float16'])
def test_digest_matches_its_definition(dtype):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((37, 11)), dtype)
  got = np.asarray(jax.jit(lambda x: weights_digest.of_group([x]))(x))
  np.testing.assert_array_equal(got, _reference(np.asarray(x)))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_any_one_element_change_changes_the_digest(dtype):
  x = jnp.asarray(np.linspace(-2, 2, 257), dtype)
  base = np.asarray(weights_digest.of_group([x]))
  changed = jax.jit(
    jax.vmap(
      lambda i: weights_digest.of_group([x.at[i].set(jnp.nextafter(x[i], 9.0))])
    )
  )(jnp.arange(x.size))
  assert not np.any(np.any(np.asarray(changed) == base, axis=1))


def test_a_bucket_digest_is_of_its_leaves_end_to_end():
  a = jnp.arange(5.0, dtype=jnp.float32)
  b = jnp.arange(5.0, 8.0, dtype=jnp.bfloat16)
  words = [
    np.asarray(a).view(np.uint32),
    np.asarray(b).view(np.uint16).astype(np.uint32),
  ]
  got = np.asarray(weights_digest.of_group([a, b]))
  np.testing.assert_array_equal(got, _reference(np.concatenate(words)))
  other = weights_digest.of_group([b, a])
  assert not np.any(np.asarray(other) == got), 'the order is part of it'


def test_groups_are_whole_consecutive_buckets():
  buckets = [[0], [1, 2], list(range(3, 40)), [40], [41, 42]]
  assert weights_digest.groups(buckets) == [
    [0, 1, 2],
    list(range(3, 40)),
    [40, 41, 42],
  ]


def test_sign_of_zero_nan_payload_and_order_count():
  def f(v):
    return np.asarray(weights_digest.of_group([jnp.asarray(v, jnp.float32)]))

  assert not np.array_equal(f([0.0, 1.0]), f([-0.0, 1.0]))
  assert not np.array_equal(f([1.0, 2.0]), f([2.0, 1.0]))
  nan = np.array([np.nan, 1.0], np.float32)
  other = nan.copy()
  other.view(np.uint32)[0] ^= 1  # Another NaN payload.
  assert not np.array_equal(f(nan), f(other))


def _buckets(params):
  """The leaf ids of each bucket of `_tx`'s layout of `params`."""
  offload = superoffload.Offload(executor='stream', bucket_bytes=8192)
  opts = options_lib.build(
    1e-2, 0.9, 0.999, 1e-8, 0.0, None, 0.01, None, False, offload
  )
  return state_lib.buckets_of(opts.layout(params))


def _same(state, params) -> bool:
  """Whether every group's parameters have the state's digest."""
  leaves = jax.tree.leaves(params)
  return all(
    bool(
      weights_digest.unchanged(
        state.weights_digest, [leaves[i] for i in ids], ids
      )
    )
    for ids in weights_digest.groups(_buckets(params))
  )


def _params(dtype):
  rng = np.random.default_rng(0)
  return {
    'w': jnp.asarray(rng.standard_normal((64, 48)), dtype),
    'b': jnp.asarray(rng.standard_normal((48,)), dtype),
    'k': jnp.asarray(rng.standard_normal((3, 5, 7)), dtype),
  }


def _grads(params, step, scale=1.0):
  keys = jax.random.split(jax.random.PRNGKey(step), len(params))
  return {
    n: (scale * jax.random.normal(k, p.shape)).astype(p.dtype)
    for k, (n, p) in zip(keys, sorted(params.items()), strict=True)
  }


def _tx(executor, mu_dtype=None, lr=1e-2, inject=False, **kw):
  offload = superoffload.Offload(executor=executor, bucket_bytes=8192, **kw)
  if inject:  # The learning rate a traced value, as the wrapper passes it.
    # fp32 hyperparameters: in bf16 (optax's default for bf16 params) b2
    # would round to 1, which adamw refuses.
    wrapper = optax.inject_hyperparams(
      superoffload.adamw, hyperparam_dtype=jnp.float32
    )
    return wrapper(learning_rate=lr, weight_decay=0.01, offload=offload)
  return superoffload.adamw(
    lr, weight_decay=0.01, mu_dtype=mu_dtype, offload=offload
  )


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _without_digest(state):
  """The state, its digest (the stream executor's alone) left out."""
  if hasattr(state, 'inner_state'):  # optax.inject_hyperparams's.
    return state._replace(inner_state=_without_digest(state.inner_state))
  return state_lib.with_fields(state, weights_digest=None)


def _run(executor, dtype, events, **kw):
  """Steps with `events[step]` done to the params first; every update."""
  tx = _tx(executor, **kw)
  params = _params(dtype)
  state = tx.init(params)
  step = jax.jit(tx.update)
  seen = []
  for t, event in enumerate(events):
    if event == 'load':  # Weights loaded from elsewhere.
      params = jax.tree.map(lambda p: (p * 0.5).astype(p.dtype), params)
    elif event == 'same':  # The same values, a new array.
      params = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
    scale = np.inf if event == 'nan' else (100.0 if event == 'big' else 1.0)
    grads = _grads(params, t, scale)
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
    seen.append((updates, params, _without_digest(state)))
  return seen, state, params


EVENTS = ['plain', 'plain', 'load', 'plain', 'same', 'plain', 'load', 'plain']


@pytest.mark.parametrize(
  ('dtype', 'kw'),
  [
    ('bfloat16', {}),
    ('float32', {}),
    ('bfloat16', {'mu_dtype': jnp.bfloat16}),
    ('bfloat16', {'clip_norm': 1.0, 'skip_nonfinite': True}),
    ('float32', {'clip_norm': 1.0}),
    ('bfloat16', {'mu_dtype': jnp.bfloat16, 'clip_norm': 1.0}),
    ('bfloat16', {'lr': optax.linear_schedule(0.0, 3e-2, 5)}),
    ('float16', {'lr': optax.cosine_decay_schedule(1e-2, 6)}),
    ('bfloat16', {'inject': True}),
  ],
)
def test_stream_equals_ffi_bit_for_bit(dtype, kw):
  events = list(EVENTS)
  if 'clip_norm' in kw:
    events[3] = 'big'  # Clipped: STV redoes the step.
  if kw.get('skip_nonfinite'):
    events[5] = 'nan'  # Dropped.
  want, _, _ = _run('ffi', dtype, events, **kw)
  got, state, _ = _run('stream', dtype, events, **kw)
  inner = state.inner_state if kw.get('inject') else state
  assert inner.weights_digest is not None
  for t, (w, g) in enumerate(zip(want, got, strict=True)):
    assert _bits(w) == _bits(g), f'step {t} ({events[t]}) differs'


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32', 'float16'])
def test_every_plain_step_leaves_the_parameters_unchanged(dtype):
  """The saving holds in a training loop: no copy after any plain step."""
  tx = _tx('stream', clip_norm=1.0)
  params = _params(dtype)
  state = tx.init(params)
  assert len(_buckets(params)) > 1  # Several buckets in one group.
  step = jax.jit(tx.update)
  for t in range(6):
    grads = _grads(params, t, 10.0 if t == 3 else 1.0)
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert _same(state, params), f'step {t}'


def test_digest_says_unchanged_only_after_a_plain_step():
  tx = _tx('stream')
  params = _params('bfloat16')
  state = tx.init(params)
  same = _same
  assert same(state, params), 'a fresh state digests its parameters'
  updates, state = jax.jit(tx.update)(_grads(params, 0), state, params)
  assert not same(state, params), 'the old parameters changed'
  params = optax.apply_updates(params, updates)
  assert same(state, params), 'params + updates are the weights produced'
  moved = state.replace(master=state.master)
  assert not same(moved, params), 'a replaced master clears the digest'
  _, state = jax.jit(tx.update)(_grads(params, 1), state)  # No params.
  assert not same(state, params), 'a step without params clears it'


def test_forged_digest_means_the_parameters_are_not_read():
  """Changed parameters under a digest that says unchanged: not read.

  Fails where the step reads the parameters anyway (the copy on a GPU).
  """
  tx = _tx('stream')
  params = _params('bfloat16')
  state = tx.init(params)
  loaded = jax.tree.map(lambda p: (p * 0.5).astype(p.dtype), params)
  leaves = jax.tree.leaves(loaded)
  groups = [
    (ids, [leaves[i] for i in ids], [leaves[i] for i in ids])
    for ids in weights_digest.groups(_buckets(loaded))
  ]
  forged = state.replace(
    weights_digest=weights_digest.after_step(len(leaves), groups)
  )
  grads = _grads(params, 0)
  step = jax.jit(tx.update)
  honest = step(grads, state, loaded)[1].master
  skipped = step(grads, forged, loaded)[1].master
  from_master = step(grads, state, params)[1].master
  # Honest: re-seeded from the loaded weights. Forged: stepped from the
  # master, as if given the parameters it was made from.
  assert _bits(honest) != _bits(skipped)
  assert _bits(skipped) == _bits(from_master)


def test_a_state_without_a_digest_reads_the_parameters():
  tx = _tx('stream')
  params = _params('bfloat16')
  state = tx.init(params).replace(weights_digest=None)
  updates, new = jax.jit(tx.update)(_grads(params, 0), state, params)
  assert new.weights_digest is None
  want, _ = jax.jit(_tx('ffi').update)(
    _grads(params, 0), _tx('ffi').init(params), params
  )
  assert _bits(updates) == _bits(want)


def test_a_wrong_digest_is_refused_by_name():
  tx = _tx('stream')
  params = _params('float32')
  state = tx.init(params).replace(weights_digest=jnp.zeros((2, 2), jnp.uint32))
  with pytest.raises(ValueError, match='weights_digest is uint32\\[2, 2\\]'):
    tx.update(_grads(params, 0), state, params)


def test_other_executors_keep_no_digest():
  for executor in ('ffi', 'xla_host', 'device'):
    assert _tx(executor).init(_params('float32')).weights_digest is None


def test_a_restored_run_keeps_its_digest(tmp_path):
  """Saved and restored with Orbax, the digest still spares the copy."""
  ocp = pytest.importorskip('orbax.checkpoint')
  tx = _tx('stream')
  params = _params('bfloat16')
  state = tx.init(params)
  step = jax.jit(tx.update)
  updates, state = step(_grads(params, 0), state, params)
  params = optax.apply_updates(params, updates)
  tree = {'params': params, 'opt_state': state}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'ckpt', tree)
    checkpointer.wait_until_finished()
    like = {'params': params, 'opt_state': tx.init(params)}
    restored = checkpointer.restore(tmp_path / 'ckpt', like)
  assert _bits(restored['opt_state'].weights_digest) == _bits(
    state.weights_digest
  )
  assert _same(restored['opt_state'], restored['params'])
  want = step(_grads(params, 1), state, params)
  got = step(_grads(params, 1), restored['opt_state'], restored['params'])
  assert _bits(want) == _bits(got)


@pytest.mark.parametrize('target', ['concrete', 'eval_shape'])
def test_a_run_restored_under_multisteps_continues_exactly(tmp_path, target):
  """A user's restart: MultiSteps, an Orbax restore into a fresh or an
  abstract target, then the same steps as the uninterrupted run."""
  ocp = pytest.importorskip('orbax.checkpoint')

  def make():
    return optax.MultiSteps(_tx('stream'), 2)

  def run(tx, params, state, steps):
    @jax.jit
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    for t in steps:
      params, state = step(params, state, _grads(params, t))
    return params, state

  tx = make()
  params0 = _params('bfloat16')
  params, state = run(tx, params0, tx.init(params0), range(3))
  want = run(tx, params, state, range(3, 7))
  fresh = make()
  like = {'params': params0, 'opt_state': fresh.init(params0)}
  if target == 'eval_shape':
    like['opt_state'] = jax.eval_shape(fresh.init, params0)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'ckpt', {'params': params, 'opt_state': state})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / 'ckpt', like)
  if target == 'eval_shape':  # Restored in device memory: placed, as the
    # step's refusal of it says (test_dropin_restore.py).
    restored['opt_state'] = jax.device_put(
      restored['opt_state'],
      superoffload.state_shardings(fresh, restored['params']),
    )
  got = run(fresh, restored['params'], restored['opt_state'], range(3, 7))
  assert _bits(got[0]) == _bits(want[0])
  assert _bits(got[1]) == _bits(want[1])
