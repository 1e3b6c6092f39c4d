"""executor="stream": the kernel outside host compute, and what it relies on.

On a GPU the stream executor runs Grace Adam as a host function on the
device's stream; on the CPU backend the same program calls the same
kernels directly, so the numbers here are the GPU path's numbers, checked
against the host-compute executor ("ffi", itself checked against float64
in test_moments.py and test_stv_exact.py). What the CPU can also check is
the property the GPU relies on: every operand that comes from a device
computation reaches the kernel flattened (rank 1), so its layout cannot
conflict with the one the kernel reads (the unscanned decoder failed to
compile on XLA:GPU for want of this); and host compute gets rank-1
operands too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_superoffload as superoffload
from jax_superoffload._src.host import executors
from jax_superoffload._src.host import grace_adam
from tests import state_compare

OPTIONS = {
  'plain': {},
  'nesterov': {'nesterov': True},
  'clip (STV redoes)': {'clip_norm': 0.5},
  'skip non-finite (STV drops)': {'skip_nonfinite': True},
  'bf16 moments': {'mu_dtype': jnp.bfloat16, 'nu_dtype': jnp.bfloat16},
  '8-bit moments': {'moments_8bit': True},
  '8-bit moments + clip': {'moments_8bit': True, 'clip_norm': 0.5},
  'small buckets': {'bucket_bytes': 4096},
}


def _params():
  rng = np.random.default_rng(0)
  params = {
    'w': rng.standard_normal((64, 48), np.float32),
    'b': np.zeros(48, np.float32),
    'h': rng.standard_normal((7, 3, 5), np.float32).astype(jnp.bfloat16),
    'one': np.float32(0.5) * np.ones(1, np.float32),
  }
  return jax.device_put(params, jax.devices()[0])


def _grads(params, i):
  def grad(x):
    g = jnp.sin(x.astype(jnp.float32) * (i + 1)) * 3.0
    if i == 2:  # A non-finite step, for skip_nonfinite.
      g = g.at[(0,) * g.ndim].set(jnp.nan)
    return g.astype(x.dtype)

  return jax.tree.map(grad, params)


def _train(executor: str, options: dict, steps: int = 4):
  tx = superoffload.adamw(1e-2, weight_decay=0.1, executor=executor, **options)
  params = _params()
  state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(steps):
    grads = _grads(params, i)
    if i == 2 and not options.get('skip_nonfinite'):
      grads = _grads(params, 3)
    params, state = step(params, state, grads)
  return params, state


@pytest.mark.parametrize('options', OPTIONS.values(), ids=OPTIONS.keys())
def test_stream_is_the_ffi_executor_bit_for_bit(options):
  want = _train('ffi', options)
  got = state_compare.without_digest(_train('stream', options))
  for path, a, b in zip(
    jax.tree_util.tree_leaves_with_path(want),
    jax.tree.leaves(want),
    jax.tree.leaves(got),
    strict=True,
  ):
    assert a.dtype == b.dtype and a.shape == b.shape, path[0]
    np.testing.assert_array_equal(
      np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path[0])
    )
  state = got[1]
  if options.get('clip_norm'):
    assert int(state.redone) > 0
  if options.get('skip_nonfinite'):
    assert int(state.skipped) == 1


def test_stream_follows_optax():
  # Against the peer itself, not only our other executor.
  params = _params()
  mine = superoffload.adamw(1e-2, weight_decay=0.1, executor='stream')
  theirs = optax.adamw(1e-2, weight_decay=0.1)
  p, q = params, jax.tree.map(jnp.copy, params)
  s, t = mine.init(p), theirs.init(q)
  for i in range(3):
    g = jax.tree.map(lambda x: x.astype(jnp.float32), _grads(p, 3 + i))
    u, s = jax.jit(mine.update)(g, s, p)
    p = optax.apply_updates(p, u)
    g = jax.tree.map(lambda x: x.astype(jnp.float32), _grads(q, 3 + i))
    u, t = jax.jit(theirs.update)(g, t, q)
    q = optax.apply_updates(q, u)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
    # bf16 leaves: the master is fp32 here while optax steps the bf16
    # weights, so they may part by a few bf16 units (2^-8 relative) in
    # three steps; fp32 leaves by fp32 rounding.
    tol = 2e-6 if a.dtype == jnp.float32 else 4 * 2.0**-8
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def _sub_jaxprs(params) -> list:
  try:
    from jax.extend.core import jaxprs_in_params
  except ImportError:  # Older JAX.
    jaxprs_in_params = jax.core.jaxprs_in_params
  return list(jaxprs_in_params(params))


def _ffi_calls(jaxpr) -> list:
  """Every ffi_call equation of a closed jaxpr, nested ones included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'ffi_call':
      found.append(eqn)
    for sub in _sub_jaxprs(eqn.params):
      found += _ffi_calls(sub)
  return found


def _region_calls(jaxpr) -> list:
  """Every equation whose parameters hold a host-compute region."""
  found = []
  for eqn in jaxpr.eqns:
    if 'compute_on' in eqn.primitive.name or 'compute_type' in eqn.params:
      found.append(eqn)
    for sub in _sub_jaxprs(eqn.params):
      found += _region_calls(sub)
  return found


def _update_jaxpr(executor: str, options: dict, params):
  tx = superoffload.adamw(1e-2, executor=executor, **options)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  return jax.make_jaxpr(tx.update)(grads, state, params).jaxpr


@pytest.mark.parametrize(
  'options', [{}, {'clip_norm': 0.5}, {'moments_8bit': True}]
)
def test_stream_kernel_reads_flat_operands_and_host_state(options):
  params = _params()
  jaxpr = _update_jaxpr('stream', options, params)
  calls = _ffi_calls(jaxpr)
  assert calls, 'the stream executor calls the kernel outside host compute'
  state_shapes = {
    s
    for x in jax.tree.leaves(params)
    for s in (x.shape, (2, *x.shape))  # STV's two rows.
  }
  host_state = 0
  for eqn in calls:
    for var in eqn.invars:
      aval = var.aval
      space = str(getattr(aval, 'memory_space', 'host')).lower()
      if 'host' in space:
        host_state += 1  # State: the step's own host arrays, any shape.
        continue
      # Everything else comes from the device: flattened there, so that
      # its layout cannot conflict with the one the kernel reads.
      assert aval.ndim <= 1, (eqn.params.get('call_target_name'), aval)
      assert aval.shape not in state_shapes or aval.ndim <= 1
  assert host_state >= 3 * len(jax.tree.leaves(params))


def test_host_compute_gets_rank_1_operands():
  # XLA:GPU fixes a host call's parameter layouts, never its operands':
  # a column-major gradient failed the verifier. Rank 1 has one layout.
  params = _params()
  jaxpr = _update_jaxpr('ffi', {}, params)
  regions = _region_calls(jaxpr)
  assert regions
  for eqn in regions:
    for var in eqn.invars:
      assert var.aval.ndim <= 1, (eqn.primitive.name, var.aval)


def test_auto_stays_ffi_on_the_cpu():
  assert jax.default_backend() == 'cpu'
  assert executors.resolve('auto') == 'ffi'
  assert executors.resolve('stream') == 'stream'
  with pytest.raises(ValueError, match='executor must be one of'):
    executors.resolve('cuda')


def test_the_cuda_driver_is_only_looked_up():
  # This machine has no GPU: the driver is reported missing, the library
  # still loads, and nothing registers for CUDA.
  loaded, why = grace_adam._grace_adam.cuda_driver()
  if loaded:
    pytest.skip('a CUDA driver is installed here')
  assert 'libcuda' in why


def test_one_host_pool_per_process(monkeypatch):
  # XLA:CPU hands the kernel a pool of its own threads; the environment
  # variable makes steps use the process's pool instead, which grows to the
  # count asked for (or stays as earlier steps in this process left it) and
  # no further, however many steps run.
  before = grace_adam.host_pool_workers()
  monkeypatch.setenv('JAX_SUPEROFFLOAD_HOST_THREADS', '3')
  tx = superoffload.adamw(1e-2, executor='stream')
  params = {'w': jnp.ones((1100, 1000)), 'v': jnp.ones((600_001,))}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for _ in range(5):
    _, state = step(params, state, params)
  jax.block_until_ready(state)
  grown = grace_adam.host_pool_workers()
  assert grown == max(before, 2)
  monkeypatch.setenv('JAX_SUPEROFFLOAD_HOST_THREADS', '2')
  for _ in range(3):
    _, state = step(params, state, params)
  jax.block_until_ready(state)
  assert grace_adam.host_pool_workers() == grown  # Never started again.
