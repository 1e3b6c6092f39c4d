"""How the kernel streams memory: prefetch policies, the donated bf16 copy,
and the independent limit that bench_adam judges it against."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import stream_limit
from jax_superoffload import kernels
from jax_superoffload._src.host import grace_adam

ENV = 'JAX_SUPEROFFLOAD_PREFETCH'


def _state(n, seed=0):
  rng = np.random.default_rng(seed)
  master = rng.standard_normal(n).astype(np.float32)
  mu = (rng.standard_normal(n) * 1e-2).astype(np.float32)
  nu = (rng.random(n) * 1e-4).astype(np.float32)
  grad = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(
    np.float32
  )
  return master, grad, mu, nu


def _lowp_step(master, grad, mu, nu, lowp=None):
  return kernels.adam_step(
    master,
    grad,
    mu,
    nu,
    count=3,
    learning_rate=1e-2,
    weight_decay=0.01,
    lowp_dtype=jnp.bfloat16,
    lowp_out=lowp,
  )


def test_prefetch_policy_default_and_override(monkeypatch):
  monkeypatch.delenv(ENV, raising=False)
  assert kernels.prefetch_policy() == 't0'
  for policy in ('t0', 'nta', 'none'):
    monkeypatch.setenv(ENV, policy)
    assert kernels.prefetch_policy() == policy
  monkeypatch.setenv(ENV, 'T0')
  with pytest.raises(ValueError, match=ENV):
    kernels.prefetch_policy()


def test_every_prefetch_policy_gives_the_same_bits(monkeypatch):
  n = 70001  # Several chunks' worth of lines, and an odd tail.
  args = [jnp.asarray(x) for x in _state(n)]
  results = {}
  for policy in ('t0', 'nta', 'none'):
    monkeypatch.setenv(ENV, policy)
    # A fresh function: the policy is fixed when a call is traced.
    step = jax.jit(lambda *a: _lowp_step(*a))
    assert f'prefetch = "{policy}"' in step.lower(*args).as_text()
    results[policy] = [np.asarray(x) for x in step(*args)]
  for policy in ('nta', 'none'):
    for got, want in zip(results[policy], results['t0'], strict=True):
      np.testing.assert_array_equal(
        got.view(np.uint8), want.view(np.uint8), err_msg=policy
      )


def test_bad_prefetch_variable_is_an_error_not_a_crash(monkeypatch):
  args = [jnp.asarray(x) for x in _state(64)]
  monkeypatch.setenv(ENV, 'fast')
  with pytest.raises(Exception, match=f"{ENV} must be .* not 'fast'"):
    jax.block_until_ready(jax.jit(lambda *a: _lowp_step(*a))(*args))


def test_settings_are_fixed_when_the_call_is_traced(monkeypatch):
  # The environment is read once, by Python as it traces; the handlers
  # take the settings as attributes and never read it themselves, so a
  # compiled step keeps its settings whatever the environment says later.
  args = [jnp.asarray(x) for x in _state(64)]
  monkeypatch.setenv(ENV, 'nta')
  monkeypatch.setenv('JAX_SUPEROFFLOAD_HOST_THREADS', '3')
  step = jax.jit(lambda *a: _lowp_step(*a))
  text = step.lower(*args).as_text()
  assert 'prefetch = "nta"' in text and 'host_threads = 3' in text
  want = [np.asarray(x) for x in step(*args)]
  monkeypatch.setenv(ENV, 'fast')
  monkeypatch.setenv('JAX_SUPEROFFLOAD_HOST_THREADS', 'four')
  got = [np.asarray(x) for x in step(*args)]
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def test_lowp_copy_writes_into_the_donated_destination():
  n = 1 << 16
  master, grad, mu, nu = (jnp.asarray(x) for x in _state(n))
  fresh = [np.asarray(x) for x in jax.jit(_lowp_step)(master, grad, mu, nu)]
  step = jax.jit(_lowp_step, donate_argnums=(0, 2, 3, 4))
  lowp = jnp.full(n, 7.0, jnp.bfloat16)
  hlo = step.lower(master, grad, mu, nu, lowp).compile().as_text()
  target = grace_adam.ADAM_STEP_LOWP_INTO_TARGET
  assert f'custom_call_target="{target}"' in hlo
  assert ' copy(' not in hlo and ' copy-start(' not in hlo
  pointer = lowp.unsafe_buffer_pointer()
  out = step(master, grad, mu, nu, lowp)
  assert out[3].unsafe_buffer_pointer() == pointer
  for got, want in zip(out, fresh, strict=True):
    np.testing.assert_array_equal(
      np.asarray(got).view(np.uint8), want.view(np.uint8)
    )


@pytest.mark.parametrize(
  ('lowp_dtype', 'lowp_out', 'error', 'match'),
  [
    (None, jnp.zeros(8, jnp.bfloat16), ValueError, 'needs lowp_dtype'),
    (jnp.bfloat16, jnp.zeros(8, jnp.float16), TypeError, r'bfloat16\[8\]'),
    (jnp.bfloat16, jnp.zeros(9, jnp.bfloat16), TypeError, r'got bfloat16\[9\]'),
  ],
)
def test_bad_lowp_destination_is_refused(lowp_dtype, lowp_out, error, match):
  master, grad, mu, nu = (jnp.asarray(x) for x in _state(8))
  with pytest.raises(error, match=match):
    kernels.adam_step(
      master,
      grad,
      mu,
      nu,
      count=0,
      learning_rate=1e-3,
      lowp_dtype=lowp_dtype,
      lowp_out=lowp_out,
    )


@pytest.fixture(scope='module')
def limit_lib(tmp_path_factory):
  lib, command = stream_limit.build(str(tmp_path_factory.mktemp('limit')))
  assert '-march=native' in command
  return lib


@pytest.mark.parametrize('threads', [1, 2, 3])
def test_independent_limit_moves_an_adam_steps_bytes(limit_lib, threads):
  n = 16 * 67  # An odd number of lines, split unevenly between threads.
  limit = stream_limit.StreamLimit(limit_lib, n, threads)
  assert {'plain', 'prefetch t0', 'prefetch nta'} <= set(limit.runs)
  arrays = [limit.stream(k) for k in range(4)]
  rng = np.random.default_rng(threads)
  for name, run in limit.runs.items():
    for a in arrays:
      a[:] = rng.standard_normal(n).astype(np.float32)
    before = [a.copy() for a in arrays]
    run()
    np.testing.assert_array_equal(arrays[0], before[0] + before[1], name)
    np.testing.assert_array_equal(arrays[1], before[1], name)
    np.testing.assert_array_equal(arrays[2], before[3], name)
    np.testing.assert_array_equal(arrays[3], before[2], name)


@pytest.mark.parametrize('moment_bytes', [2, 1])
@pytest.mark.parametrize('threads', [1, 3])
def test_narrow_moment_limit_moves_its_bytes(limit_lib, threads, moment_bytes):
  n = 64 * 37  # An odd number of steps, split unevenly between threads.
  limit = stream_limit.StreamLimit(limit_lib, n, threads, moment_bytes)
  assert limit.bytes_per_param == 12 + 4 * moment_bytes
  arrays = [limit.stream(k) for k in range(4)]
  rng = np.random.default_rng(threads)
  moved = n * moment_bytes // 4  # The floats' worth of moment bytes moved.
  for name, run in limit.runs.items():
    for a in arrays:
      a[:] = rng.standard_normal(n).astype(np.float32)
    before = [a.copy() for a in arrays]
    run()
    np.testing.assert_array_equal(arrays[0], before[0] + before[1], name)
    np.testing.assert_array_equal(arrays[1], before[1], name)
    np.testing.assert_array_equal(arrays[2][:moved], before[3][:moved], name)
    np.testing.assert_array_equal(arrays[3][:moved], before[2][:moved], name)
    np.testing.assert_array_equal(arrays[2][moved:], before[2][moved:], name)


def test_independent_limit_shares_no_code_with_the_kernel():
  source = stream_limit.SOURCE.read_text()
  assert '#include "xla_ffi' not in source
  assert 'jax_superoffload' not in source
