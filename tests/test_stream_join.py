"""The stream join target (issue 37) as Python calls it, on the CPU backend.

On a GPU the join waits for the step's stream launches; on the CPU, where
every step has run before its call returned, its aliased results are an
identity (xla_ffi/stream_launch.h). Operands past those only order it. A
call whose results do not alias is refused: on a GPU the aliases are what
keep the launches' device results alive until the join.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_superoffload import _grace_adam
from jax_superoffload._src.host import grace_adam


def _join(*xs, aliased=True, extra=()):
  return jax.ffi.ffi_call(
    grace_adam.STREAM_JOIN_TARGET,
    [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs],
    input_output_aliases={i: i for i in range(len(xs))} if aliased else None,
  )(*xs, *extra)


def _operands():
  rng = np.random.default_rng(37)
  return (
    jnp.asarray(rng.standard_normal((64, 3)), jnp.float32),
    jnp.asarray(rng.standard_normal(129), jnp.bfloat16),
    jnp.float32(np.nan),
    jnp.arange(5, dtype=jnp.int32),
    jnp.zeros((1,), jnp.float32) - 0.0,
  )


def test_join_is_an_identity_bit_for_bit():
  xs = _operands()
  got = jax.jit(lambda *xs: _join(*xs))(*xs)
  assert len(got) == len(xs)
  for x, y in zip(xs, got, strict=True):
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.asarray(y).tobytes() == np.asarray(x).tobytes()


def test_join_results_feed_later_computation():
  x = jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32)

  @jax.jit
  def step(x):
    (y,) = _join(x * 3.0)
    return y + 1.0

  assert np.asarray(step(x)).tobytes() == np.asarray(x * 3.0 + 1.0).tobytes()


def test_join_ordering_operands_are_only_read():
  xs = _operands()[:2]
  barrier = jnp.int32(-7)

  @jax.jit
  def join(xs, barrier):
    return _join(*xs, extra=(barrier, xs[0]))

  got = join(xs, barrier)
  assert len(got) == len(xs)
  for x, y in zip(xs, got, strict=True):
    assert np.asarray(y).tobytes() == np.asarray(x).tobytes()


def test_join_without_aliases_is_refused():
  x = jnp.ones(8, jnp.float32)
  with pytest.raises(Exception, match='must alias operand 0'):
    jax.block_until_ready(jax.jit(lambda x: _join(x, aliased=False))(x))


def test_join_is_filed_for_both_platforms():
  name = 'jax_superoffload_stream_join'
  assert name == grace_adam.STREAM_JOIN_TARGET
  assert name in _grace_adam.registrations()
  assert name in _grace_adam.stream_registrations()


def test_no_staging_without_a_stream_launch():
  assert _grace_adam.stream_staging_allocations() == 0
