"""Tests for experiments.trainer.model: shapes, causality, parameter counts."""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803, N806

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.trainer import config
from experiments.trainer import model


def test_causality_and_initial_loss():
  cfg = config.get_config('tiny', seq_len=16)  # RoPE, tied embeddings.
  tokens_BxL = np.random.default_rng(1).integers(0, 256, (2, 16))
  changed_BxL = tokens_BxL.copy()
  changed_BxL[:, 10] = (changed_BxL[:, 10] + 1) % 256
  both_BxL = np.concatenate([tokens_BxL, changed_BxL]).astype(np.int32)

  @jax.jit  # Init and apply in one compile keeps the test fast.
  def run(tokens_BxL):
    net = model.Transformer(cfg, rngs=nnx.Rngs(0))
    loss = model.loss_fn(net, tokens_BxL[:1], tokens_BxL[1:2])
    return net(tokens_BxL), loss

  logits_BxLxV, loss = run(both_BxL)
  assert logits_BxLxV.shape == (4, 16, 256)
  assert logits_BxLxV.dtype == jnp.float32
  logits_BxLxV = np.asarray(logits_BxLxV)
  assert np.all(np.isfinite(logits_BxLxV))
  # Small init: predictions of unrelated targets are close to uniform.
  assert abs(float(loss) - np.log(256)) < 0.1
  # Changing token 10 leaves logits at positions 0..9 unchanged.
  orig_BxLxV, other_BxLxV = logits_BxLxV[:2], logits_BxLxV[2:]
  np.testing.assert_allclose(orig_BxLxV[:, :10], other_BxLxV[:, :10], atol=1e-6)
  assert not np.allclose(orig_BxLxV[:, 10:], other_BxLxV[:, 10:])


@pytest.mark.parametrize(
  'pos_encoding, tie', [('rope', True), ('learned', False)]
)
def test_variants_shapes(pos_encoding, tie):
  cfg = config.get_config(
    'tiny', pos_encoding=pos_encoding, tie_embeddings=tie, seq_len=16
  )
  net = nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
  assert (net.pos_embed is None) == (pos_encoding == 'rope')
  assert (net.lm_head is None) == tie
  tokens_BxL = jax.ShapeDtypeStruct((3, 16), jnp.int32)
  logits_BxLxV = nnx.eval_shape(lambda m, t: m(t), net, tokens_BxL)
  assert logits_BxLxV.shape == (3, 16, 256)
  assert logits_BxLxV.dtype == jnp.float32


def test_rotary_embedding_preserves_norm_and_position_zero():
  rng = np.random.default_rng(0)
  x_BxLxHxK = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)
  y_BxLxHxK = np.asarray(jax.jit(model.rotary_embedding)(x_BxLxHxK))
  np.testing.assert_allclose(y_BxLxHxK[:, 0], x_BxLxHxK[:, 0], atol=1e-6)
  np.testing.assert_allclose(
    np.linalg.norm(y_BxLxHxK, axis=-1),
    np.linalg.norm(x_BxLxHxK, axis=-1),
    rtol=1e-5,
  )


@pytest.mark.parametrize(
  'preset, lo, hi',
  [('small', 3e5, 6e5), ('1b', 0.95e9, 1.1e9)],
)
def test_preset_param_counts(preset, lo, hi):
  cfg = config.get_config(preset)
  abstract = nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
  assert lo <= model.count_params(abstract) <= hi


def test_bad_heads_raise():
  cfg = config.get_config('tiny', d_model=30, num_heads=4)
  with pytest.raises(ValueError, match='num_heads'):
    nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))


def test_init_model_reads_only_model_fields():
  # Transformer must not read a field missing from MODEL_FIELDS, or the
  # cached init would ignore it: build with every other field poisoned.
  cfg = config.get_config('tiny')
  others = {
    f.name: None
    for f in dataclasses.fields(config.Config)
    if f.name not in model.MODEL_FIELDS
  }
  poisoned = dataclasses.replace(cfg, **others)
  nnx.eval_shape(lambda: model.Transformer(poisoned, rngs=nnx.Rngs(0)))


def test_ulysses_attention_matches_plain_with_global_positions():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  # Sharp attention (large init) so that position errors would show.
  cfg = config.get_config('tiny', seq_len=16, num_heads=4, init_std=0.5)
  mesh = jax.make_mesh(
    (2, 2),
    ('data', 'seq'),
    devices=jax.devices()[:4],
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  net = model.init_model(cfg)
  tokens_BxL = np.random.default_rng(2).integers(0, 256, (2, 16))
  tokens_BxL = tokens_BxL.astype(np.int32)
  plain_BxLxV = nnx.jit(lambda m, t: m(t))(net, tokens_BxL)

  model.set_sequence_parallel(net, mesh, 'seq', 'data')
  graphdef, state = nnx.split(net)
  state = jax.device_put(state, NamedSharding(mesh, P()))
  seq_sharded = NamedSharding(mesh, P('data', 'seq'))
  sharded_BxL = jax.device_put(tokens_BxL, seq_sharded)

  @jax.jit
  def forward(state, tokens_BxL):
    return nnx.merge(graphdef, state)(tokens_BxL)

  hlo = forward.lower(state, sharded_BxL).as_text()
  assert 'all-to-all' in hlo or 'all_to_all' in hlo  # Ulysses is in use.
  ulysses_BxLxV = forward(state, sharded_BxL)
  np.testing.assert_allclose(
    np.asarray(ulysses_BxLxV), np.asarray(plain_BxLxV), atol=2e-5
  )
