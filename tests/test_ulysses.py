# ruff: noqa: N803, N806
"""Ulysses attention against dense `jax.nn.dot_product_attention`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jax_superoffload import ulysses

B, S, D = 2, 16, 4


def _seq_mesh(size: int) -> jax.sharding.Mesh:
  return jax.make_mesh((size,), ('seq',), devices=jax.devices()[:size])


def _qkv(H: int, Hkv: int, seed: int = 0, batch: int = B):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, S, H, D), dtype=np.float32)
  k = rng.standard_normal((batch, S, Hkv, D), dtype=np.float32)
  v = rng.standard_normal((batch, S, Hkv, D), dtype=np.float32)
  cot = rng.standard_normal((batch, S, H, D), dtype=np.float32)
  return q, k, v, cot


def _out_and_grads(attn, q, k, v, cot):
  """Output and d<out, cot>/d(q, k, v)."""
  out, vjp = jax.vjp(attn, q, k, v)
  return out, vjp(cot)


@functools.partial(jax.jit, static_argnames='causal')
def _dense(q, k, v, cot, mask=None, *, causal=False):
  attn = functools.partial(
    jax.nn.dot_product_attention, mask=mask, is_causal=causal
  )
  return _out_and_grads(attn, q, k, v, cot)


def _assert_close(got, want):
  (out, grads), (want_out, want_grads) = got, want
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  for name, g, w in zip('qkv', grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=f'd{name}')


@pytest.mark.parametrize(
  ('size', 'H', 'Hkv', 'causal'),
  [
    (2, 4, 4, False),
    (2, 8, 4, True),  # GQA, kv heads already divisible: no repeat.
    (4, 8, 8, False),
    (4, 8, 2, True),  # GQA, kv heads repeated 2x.
    (4, 8, 1, False),  # MQA, the kv head repeated 4x.
    (8, 8, 8, True),
    (8, 8, 2, False),  # GQA, kv heads repeated 4x.
    (8, 8, 2, True),
  ],
)
def test_matches_dense(size, H, Hkv, causal):
  q, k, v, cot = _qkv(H, Hkv)
  uly = functools.partial(
    ulysses.attention, mesh=_seq_mesh(size), axis='seq', causal=causal
  )
  got = jax.jit(functools.partial(_out_and_grads, uly))(q, k, v, cot)
  _assert_close(got, _dense(q, k, v, cot, causal=causal))


def test_padding_and_head_masks_match_dense():
  H, Hkv = 8, 2
  q, k, v, cot = _qkv(H, Hkv, seed=1)
  rng = np.random.default_rng(2)
  kv_mask_BxS = rng.random((B, S)) > 0.3
  kv_mask_BxS[:, 0] = True  # Every causal row keeps a valid key.
  mask_1xHxSxS = rng.random((1, H, S, S)) > 0.2
  mask_1xHxSxS[..., 0] = True
  uly = functools.partial(
    ulysses.attention,
    mesh=_seq_mesh(4),
    axis='seq',
    causal=True,
    mask=mask_1xHxSxS,
    kv_mask=kv_mask_BxS,
  )
  got = jax.jit(functools.partial(_out_and_grads, uly))(q, k, v, cot)
  mask = np.logical_and(mask_1xHxSxS, kv_mask_BxS[:, None, None, :])
  _assert_close(got, _dense(q, k, v, cot, mask, causal=True))


def test_data_axis_on_auto_mesh():
  mesh = jax.make_mesh(
    (2, 4), ('data', 'seq'), axis_types=(AxisType.Auto, AxisType.Auto)
  )
  q, k, v, cot = _qkv(8, 2, seed=3, batch=4)
  kv_mask_BxS = np.ones((4, S), bool)
  kv_mask_BxS[:, -3:] = False
  uly = functools.partial(
    ulysses.attention,
    mesh=mesh,
    axis='seq',
    batch_axis='data',
    kv_mask=kv_mask_BxS,
  )
  out, grads = jax.jit(functools.partial(_out_and_grads, uly))(q, k, v, cot)
  mask = kv_mask_BxS[:, None, None, :]
  _assert_close((out, grads), _dense(q, k, v, cot, mask))
  want = jax.NamedSharding(mesh, jax.P('data', 'seq'))
  assert out.sharding.is_equivalent_to(want, out.ndim)


def test_custom_attention_fn_sees_local_heads():
  seen = []

  def attention_fn(q, k, v, *, mask, scale, is_causal):
    seen.append((q.shape, k.shape, mask, scale, is_causal))
    return jax.nn.dot_product_attention(
      q, k, v, mask=mask, scale=scale, is_causal=is_causal
    )

  q, k, v, _ = _qkv(8, 2)
  out = jax.jit(
    functools.partial(
      ulysses.attention,
      mesh=_seq_mesh(4),
      axis='seq',
      scale=0.3,
      attention_fn=attention_fn,
    )
  )(q, k, v)
  # Per device: the whole sequence, 8/4 query heads, 2*2/4 kv heads.
  assert seen == [((B, S, 2, D), (B, S, 1, D), None, 0.3, False)]
  np.testing.assert_allclose(
    out, jax.nn.dot_product_attention(q, k, v, scale=0.3), atol=2e-5
  )


def test_helpers_move_layouts_inside_shard_map():
  size = 4
  mesh = _seq_mesh(size)
  x_BxSxHxD = np.arange(B * S * 8 * D, dtype=np.float32).reshape(B, S, 8, D)

  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=jax.P(None, 'seq'),
    out_specs=(jax.P(None, None, 'seq'), jax.P(None, 'seq')),
  )
  def roundtrip(x_BxSpxHxD):
    x_BxSxHpxD = ulysses.seq_to_heads(x_BxSpxHxD, 'seq')
    assert x_BxSxHpxD.shape == (B, S, 8 // size, D)
    return x_BxSxHpxD, ulysses.heads_to_seq(x_BxSxHpxD, 'seq')

  heads, back = roundtrip(
    jax.reshard(x_BxSxHxD, jax.NamedSharding(mesh, jax.P(None, 'seq')))
  )
  # Gathered on heads: device i's block is heads [2i, 2i+2) of the whole
  # sequence, so the global array is the input unchanged.
  np.testing.assert_array_equal(heads, x_BxSxHxD)
  np.testing.assert_array_equal(back, x_BxSxHxD)


@pytest.mark.parametrize(
  ('kv_heads', 'size', 'want'),
  [(8, 4, 1), (2, 4, 2), (2, 8, 4), (1, 8, 8), (6, 4, 2), (3, 2, 2)],
)
def test_kv_repeat_factor(kv_heads, size, want):
  assert ulysses.kv_repeat_factor(kv_heads, size) == want
  assert (kv_heads * want) % size == 0


@pytest.mark.parametrize(
  ('q_shape', 'kv_shape', 'size', 'message'),
  [
    (
      (1, 10, 8, 4),
      (1, 10, 8, 4),
      4,
      r'sequence length \(10\) must be divisible by the sequence-parallel '
      r'size \(4\)',
    ),
    (
      (1, 16, 6, 4),
      (1, 16, 6, 4),
      4,
      r'query heads \(6\) must be divisible by the sequence-parallel size '
      r'\(4\)',
    ),
    (
      (1, 16, 8, 4),
      (1, 16, 3, 4),
      4,
      r'query heads \(8\) must be a multiple of kv heads \(3\)',
    ),
    ((1, 16, 8), (1, 16, 8, 4), 4, r'q must have rank 4 .* \(1, 16, 8\)'),
    ((1, 16, 8, 4), (1, 16, 8, 2), 4, r'must agree on batch and head dim'),
    ((2, 16, 8, 4), (1, 16, 8, 4), 4, r'must agree on batch and head dim'),
  ],
)
def test_bad_shapes_raise(q_shape, kv_shape, size, message):
  q = jnp.zeros(q_shape)
  k = jnp.zeros(kv_shape)
  with pytest.raises(ValueError, match=message):
    ulysses.attention(q, k, k, mesh=_seq_mesh(size), axis='seq')


def test_bad_arguments_raise():
  mesh = _seq_mesh(4)
  q, k, v, _ = _qkv(8, 8)
  call = functools.partial(ulysses.attention, mesh=mesh, axis='seq')
  with pytest.raises(ValueError, match=r'k and v must have the same shape'):
    call(q, k, v[:, :, :4])
  with pytest.raises(ValueError, match=r'share a dtype.*float32, float16'):
    call(q, k, v.astype(np.float16))
  with pytest.raises(ValueError, match=r"mesh axis 'sp' not in"):
    ulysses.attention(q, k, v, mesh=mesh, axis='sp')
  with pytest.raises(ValueError, match=r'kv_mask must be bool \[B, S\]'):
    call(q, k, v, kv_mask=np.ones((B, S - 1), bool))
  with pytest.raises(ValueError, match=r'mask must be bool, rank 4'):
    call(q, k, v, mask=np.ones((B, 3, S, S), bool))
  with pytest.raises(ValueError, match=r'batch \(2\) must be divisible'):
    mesh2 = jax.make_mesh((4, 2), ('data', 'seq'))
    ulysses.attention(q, k, v, mesh=mesh2, axis='seq', batch_axis='data')


def test_eight_way_ulysses_cuts_attention_temp_memory():
  # XLA's CPU attention materialises the [B, H, S, S] logits; 8-way Ulysses
  # keeps H/8 heads of them per device.
  x = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32)
  mesh = _seq_mesh(8)

  def temp_bytes(fn):
    compiled = jax.jit(fn).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  dense = temp_bytes(jax.nn.dot_product_attention)
  sharded = temp_bytes(
    functools.partial(ulysses.attention, mesh=mesh, axis='seq')
  )
  assert sharded * 6 <= dense, (sharded, dense)
