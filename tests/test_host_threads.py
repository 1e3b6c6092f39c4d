"""The kernel's threads: XLA's intra-op pool, or its own.

Where XLA hands the kernel a pool of one thread (the CUDA plugin's host
compute ran it at about one core's speed on an H200 machine), the kernel
starts helpers of its own; `JAX_SUPEROFFLOAD_HOST_THREADS` sets the count.
Work chunks are fixed, so no thread count may change a bit. (Equal bits
cannot tell whether helpers ran; with these shapes' six chunks, 3 and 7
threads take the helper path.)
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_superoffload as superoffload
from jax_superoffload import _grace_adam

ENV = 'JAX_SUPEROFFLOAD_HOST_THREADS'
# Several of the kernel's 2^18-element work chunks, and an odd tail.
SHAPES = {'w': (1200, 1001), 'b': (3,), 'v': (300_007,)}
OPTIONS = {
  'fp32': {},
  '8-bit moments': {'moments_8bit': True},
  'bf16 moments': {'mu_dtype': jnp.bfloat16, 'nu_dtype': jnp.bfloat16},
  'STV': {'clip_norm': 1.0, 'skip_nonfinite': True},
}


def test_a_pool_of_several_threads_is_used(monkeypatch):
  monkeypatch.delenv(ENV, raising=False)
  assert _grace_adam.own_helper_threads(8) == -1
  assert _grace_adam.own_helper_threads(2) == -1


def test_a_one_thread_pool_gets_helpers_for_the_allowed_cpus(monkeypatch):
  monkeypatch.delenv(ENV, raising=False)
  allowed = len(os.sched_getaffinity(0))
  assert _grace_adam.own_helper_threads(1) == allowed - 1
  assert _grace_adam.own_helper_threads(0) == allowed - 1  # No pool at all.


def test_the_environment_sets_the_count(monkeypatch):
  monkeypatch.setenv(ENV, '5')
  assert _grace_adam.own_helper_threads(8) == 4
  assert _grace_adam.own_helper_threads(1) == 4
  monkeypatch.setenv(ENV, '1')
  assert _grace_adam.own_helper_threads(8) == 0


def _steps(options: dict, steps: int = 3):
  rng = np.random.default_rng(0)
  params = {
    k: jnp.asarray(rng.standard_normal(shape, np.float32))
    for k, shape in SHAPES.items()
  }
  params = jax.device_put(params, jax.devices()[0])
  tx = superoffload.adamw(1e-2, weight_decay=0.1, executor='ffi', **options)
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return jax.tree.map(jnp.add, params, updates), state

  for i in range(steps):
    scale = np.float32((1e-3, 1e4, 1.0)[i % 3])  # Clips on the large step.
    grads = {
      k: jnp.asarray(rng.standard_normal(p.shape, np.float32) * scale)
      for k, p in params.items()
    }
    params, state = step(params, state, grads)
  return jax.device_get((params, state))


@pytest.mark.parametrize('name', list(OPTIONS))
def test_own_threads_give_the_pools_bits(monkeypatch, name):
  monkeypatch.delenv(ENV, raising=False)
  want = _steps(OPTIONS[name])
  for threads in ('1', '3', '7'):
    monkeypatch.setenv(ENV, threads)
    got = _steps(OPTIONS[name])
    leaves = jax.tree_util.tree_leaves_with_path(got)
    pairs = zip(leaves, jax.tree.leaves(want), strict=True)
    for (path, g), w in pairs:
      np.testing.assert_array_equal(
        np.atleast_1d(np.asarray(g)).view(np.uint8),
        np.atleast_1d(np.asarray(w)).view(np.uint8),
        err_msg=f'{threads} threads, {jax.tree_util.keystr(path)}',
      )


@pytest.mark.parametrize(
  'value', ['four', '0', '-2', '5000', '3x', '+3', ' 3', '3 ', '0x10']
)
def test_a_malformed_count_is_refused_naming_the_variable(monkeypatch, value):
  monkeypatch.setenv(ENV, value)
  with pytest.raises(
    Exception, match=f"{ENV} must be .* not '{re.escape(value)}'"
  ):
    _steps({}, steps=1)
