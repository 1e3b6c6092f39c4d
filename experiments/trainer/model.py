"""A GPT-style decoder-only transformer in Flax NNX.

Token embedding, rotary or learned absolute positions, pre-norm blocks of
causal self-attention (`jax.nn.dot_product_attention`) and a GELU MLP, a final
LayerNorm, and a tied or untied output head.

With `set_sequence_parallel`, attention runs as Ulysses sequence-parallel
attention (`jax_superoffload.ulysses.attention`) over a mesh axis that shards
the sequence. Positions are always global: RoPE and the learned table index
the whole (logical) sequence outside the `shard_map`.

The blocks are a Python list run in a loop (the default), or, with
``scan_layers``, one `nnx.vmap`-built block whose weights carry a leading
layer axis, run with SuperOffload's `weight_flow_scan`. With
``weights_policy="flow"`` those stacked weights live in host memory
(`offload_weights`) and are streamed to the device layer by layer.

Shape suffixes: B batch, L sequence length, D model width, H heads,
K head width, F MLP width, V vocabulary.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803, N806

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jax_superoffload as superoffload
from experiments.trainer.config import POS_ENCODINGS
from experiments.trainer.config import WEIGHTS_POLICIES
from experiments.trainer.config import Config
from jax_superoffload import ulysses


def _dtype(name: str) -> jnp.dtype:
  """Maps a dtype name from the config to a jnp dtype."""
  return jnp.dtype(name)


def rotary_embedding(x_BxLxHxK: jax.Array) -> jax.Array:
  """Applies rotary position embedding (RoPE, half-split layout).

  Args:
    x_BxLxHxK: Queries or keys; position is the index along L.

  Returns:
    The rotated array, same shape and dtype.
  """
  _, seq_len, _, head_dim = x_BxLxHxK.shape
  half = head_dim // 2
  freq_K2 = 1.0 / (10_000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle_LxK2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freq_K2
  sin_1xLx1xK2 = jnp.sin(angle_LxK2)[None, :, None, :]
  cos_1xLx1xK2 = jnp.cos(angle_LxK2)[None, :, None, :]
  x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
  rot1 = x1 * cos_1xLx1xK2 - x2 * sin_1xLx1xK2
  rot2 = x2 * cos_1xLx1xK2 + x1 * sin_1xLx1xK2
  out_BxLxHxK = jnp.concatenate([rot1, rot2], axis=-1)
  return out_BxLxHxK.astype(x_BxLxHxK.dtype)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    """Creates the fused QKV and output projections."""
    if cfg.d_model % cfg.num_heads:
      raise ValueError('num_heads must divide d_model')
    self.num_heads = cfg.num_heads
    self.head_dim = cfg.d_model // cfg.num_heads
    self.rope = cfg.pos_encoding == 'rope'
    init = nnx.initializers.normal(cfg.init_std)
    # GPT-2 scales residual output projections by 1/sqrt(2 * layers).
    out_init = nnx.initializers.normal(
      cfg.init_std / math.sqrt(2 * cfg.num_layers)
    )
    kw = dict(
      use_bias=cfg.use_bias,
      dtype=_dtype(cfg.dtype),
      param_dtype=_dtype(cfg.param_dtype),
      rngs=rngs,
    )
    self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, kernel_init=init, **kw)
    self.out = nnx.Linear(cfg.d_model, cfg.d_model, kernel_init=out_init, **kw)
    # Ulysses sequence parallelism (static; see `set_sequence_parallel`).
    self.mesh: jax.sharding.Mesh | None = None
    self.seq_axis: str | None = None
    self.batch_axis: str | None = None

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    """Attends each position to itself and earlier positions."""
    batch, seq_len, d_model = x_BxLxD.shape
    qkv_BxLx3D = self.qkv(x_BxLxD)
    qkv_BxLx3xHxK = qkv_BxLx3D.reshape(
      batch, seq_len, 3, self.num_heads, self.head_dim
    )
    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
    if self.rope:
      q_BxLxHxK = rotary_embedding(q_BxLxHxK)
      k_BxLxHxK = rotary_embedding(k_BxLxHxK)
    if self.mesh is None:
      o_BxLxHxK = jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True
      )
    else:
      o_BxLxHxK = ulysses.attention(
        q_BxLxHxK,
        k_BxLxHxK,
        v_BxLxHxK,
        mesh=self.mesh,
        axis=self.seq_axis,
        batch_axis=self.batch_axis,
        causal=True,
      )
    return self.out(o_BxLxHxK.reshape(batch, seq_len, d_model))


class Mlp(nnx.Module):
  """Two-layer GELU MLP."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    """Creates the up and down projections."""
    kw = dict(
      use_bias=cfg.use_bias,
      dtype=_dtype(cfg.dtype),
      param_dtype=_dtype(cfg.param_dtype),
      rngs=rngs,
    )
    self.up = nnx.Linear(
      cfg.d_model,
      cfg.mlp_dim,
      kernel_init=nnx.initializers.normal(cfg.init_std),
      **kw,
    )
    self.down = nnx.Linear(
      cfg.mlp_dim,
      cfg.d_model,
      kernel_init=nnx.initializers.normal(
        cfg.init_std / math.sqrt(2 * cfg.num_layers)
      ),
      **kw,
    )

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    """Applies up-projection, GELU and down-projection."""
    h_BxLxF = jax.nn.gelu(self.up(x_BxLxD))
    return self.down(h_BxLxF)


def _layer_norm(cfg: Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """A LayerNorm over the model width."""
  return nnx.LayerNorm(
    cfg.d_model,
    use_bias=cfg.use_bias,
    dtype=_dtype(cfg.dtype),
    param_dtype=_dtype(cfg.param_dtype),
    rngs=rngs,
  )


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    """Creates the norms, attention and MLP of one block."""
    self.attn_norm = _layer_norm(cfg, rngs)
    self.attn = CausalSelfAttention(cfg, rngs=rngs)
    self.mlp_norm = _layer_norm(cfg, rngs)
    self.mlp = Mlp(cfg, rngs=rngs)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    """Applies the block to the residual stream."""
    x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD))
    return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))


def _stacked_blocks(cfg: Config, rngs: nnx.Rngs) -> Block:
  """One `Block` whose parameters have a leading axis of `num_layers`."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs=rngs)

  return create(rngs)


class Transformer(nnx.Module):
  """Decoder-only language model mapping token ids to next-token logits."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    """Creates all layers from `cfg`.

    Args:
      cfg: Model fields are read (d_model, num_layers, ...); `seq_len`
        sizes the learned position table.
      rngs: Random streams for parameter initialization.
    """
    if cfg.pos_encoding not in POS_ENCODINGS:
      raise ValueError(f'unknown pos_encoding {cfg.pos_encoding!r}')
    if cfg.weights_policy not in WEIGHTS_POLICIES:
      raise ValueError(f'unknown weights_policy {cfg.weights_policy!r}')
    if cfg.weights_policy == 'flow' and not cfg.scan_layers:
      raise ValueError('weights_policy="flow" needs scan_layers=True')
    self.scan_layers = cfg.scan_layers
    self.weights_policy = cfg.weights_policy
    init = nnx.initializers.normal(cfg.init_std)
    dtype, param_dtype = _dtype(cfg.dtype), _dtype(cfg.param_dtype)
    self.token_embed = nnx.Embed(
      cfg.vocab_size,
      cfg.d_model,
      embedding_init=init,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.pos_embed = nnx.data(None)
    if cfg.pos_encoding == 'learned':
      self.pos_embed = nnx.Embed(
        cfg.seq_len,
        cfg.d_model,
        embedding_init=init,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
      )
    if cfg.scan_layers:
      self.blocks = _stacked_blocks(cfg, rngs)
    else:
      self.blocks = nnx.List(
        [Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)]
      )
    self.final_norm = _layer_norm(cfg, rngs)
    self.lm_head = nnx.data(None)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Linear(
        cfg.d_model,
        cfg.vocab_size,
        use_bias=False,
        kernel_init=init,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
      )

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    """Computes next-token logits.

    Args:
      tokens_BxL: Integer token ids.

    Returns:
      logits_BxLxV: float32 logits; position i depends on tokens 0..i.
    """
    x_BxLxD = self.token_embed(tokens_BxL)
    if self.pos_embed is not None:
      pos_L = jnp.arange(tokens_BxL.shape[1])
      x_BxLxD = x_BxLxD + self.pos_embed(pos_L)[None]
    if self.scan_layers:
      x_BxLxD = self._scan_blocks(x_BxLxD)
    else:
      for block in self.blocks:
        x_BxLxD = block(x_BxLxD)
    x_BxLxD = self.final_norm(x_BxLxD)
    if self.lm_head is None:
      logits_BxLxV = self.token_embed.attend(x_BxLxD)
    else:
      logits_BxLxV = self.lm_head(x_BxLxD)
    return logits_BxLxV.astype(jnp.float32)

  def _scan_blocks(self, x_BxLxD: jax.Array) -> jax.Array:
    """Runs the stacked blocks, fetching their weights as the policy says."""
    graphdef, stacked = nnx.split(self.blocks)

    def body(layer: nnx.State, x_BxLxD: jax.Array) -> tuple[jax.Array, None]:
      return nnx.merge(graphdef, layer)(x_BxLxD), None

    x_BxLxD, _ = superoffload.weight_flow_scan(
      body,
      x_BxLxD,
      stacked,
      policy=self.weights_policy,
      params_path='blocks',  # Where the optimizer finds them (overlap_scan).
    )
    return x_BxLxD


def offload_weights(model: Transformer) -> None:
  """Moves the stacked block weights to host memory if the policy is "flow".

  Call it after creating the optimizer (optimizers initialize their state
  from device-resident parameters). Works in place, inside or outside
  `nnx.jit`; a no-op for weight-stationary models.

  Args:
    model: The model, updated in place.
  """
  if model.weights_policy == 'flow':
    blocks = nnx.state(model.blocks)
    nnx.update(model.blocks, superoffload.offload_stacked(blocks))


def set_sequence_parallel(
  model: Transformer,
  mesh: jax.sharding.Mesh | None,
  axis: str = 'seq',
  batch_axis: str | None = 'data',
) -> None:
  """Makes every attention layer Ulysses attention over mesh axis `axis`.

  The mesh becomes static module metadata (part of the graph definition,
  so a jitted step compiles for it). Inputs should be sharded along the
  sequence over `axis` (and along the batch over `batch_axis`); the
  sequence length and the number of heads must be divisible by the size of
  `axis`.

  Args:
    model: The model, updated in place.
    mesh: The device mesh; None restores plain single-program attention.
    axis: The mesh axis sharding the sequence.
    batch_axis: The mesh axis sharding the batch, or None.
  """
  for _, module in nnx.iter_modules(model):
    if isinstance(module, CausalSelfAttention):
      module.mesh = mesh
      module.seq_axis = None if mesh is None else axis
      module.batch_axis = None if mesh is None else batch_axis


def apply_gradients(
  model: Transformer, optimizer: nnx.Optimizer, grads: nnx.State
) -> tuple[Any, Any]:
  """`optimizer.update(model, grads)` that keeps offloaded weights offloaded.

  Weight-flow gradients arrive in host memory, and optimizers compute with
  device arrays: the update runs on device copies of the weights and
  gradients, and every weight goes back to the memory it came from. For a
  weight-stationary model this is exactly `optimizer.update`.

  Args:
    model: The model, updated in place.
    optimizer: An `nnx.Optimizer` of `model`, updated in place.
    grads: Gradients of `model`'s parameters.

  Returns:
    ``(updates, params)``: the updates applied and the new parameters, as
    pure arrays in device memory (for norms; the model holds the same
    values where they live).
  """
  if model.weights_policy != 'flow':
    updates = optimizer.update(model, grads)
    return updates, nnx.as_pure(nnx.state(model, nnx.Param))
  state = nnx.state(model)
  spaces = superoffload.memory_spaces(state)  # `state` changes in place.
  nnx.update(model, superoffload.fetch_stacked(state))
  updates = optimizer.update(model, superoffload.fetch_stacked(grads))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  nnx.update(model, superoffload.match_placement(nnx.state(model), spaces))
  return updates, params


def device_copy(model: Transformer, grads: nnx.State) -> nnx.State:
  """`grads` in device memory (weight-flow gradients arrive in host memory)."""
  if model.weights_policy != 'flow':
    return grads
  return superoffload.fetch_stacked(grads)


def loss_fn(
  model: Transformer, inputs_BxL: jax.Array, targets_BxL: jax.Array
) -> jax.Array:
  """Mean next-token cross-entropy in nats."""
  logits_BxLxV = model(inputs_BxL)
  loss_BxL = optax.softmax_cross_entropy_with_integer_labels(
    logits_BxLxV, targets_BxL
  )
  return loss_BxL.mean()


def count_params(model: nnx.Module) -> int:
  """Total number of parameter elements of `model`."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return sum(math.prod(x.shape) for x in leaves)


# The `Config` fields that `Transformer` reads. `init_model` compiles once per
# distinct combination of these, however the other (training) fields differ.
MODEL_FIELDS = (
  'vocab_size',
  'd_model',
  'num_layers',
  'num_heads',
  'mlp_dim',
  'pos_encoding',
  'tie_embeddings',
  'use_bias',
  'init_std',
  'dtype',
  'param_dtype',
  'scan_layers',
  'weights_policy',
  'seq_len',
)


@functools.partial(nnx.jit, static_argnums=0)
def _init(cfg: Config, key: jax.Array) -> Transformer:
  """Jitted constructor; `cfg` is static, so it must be hashable."""
  return Transformer(cfg, rngs=nnx.Rngs(key))


def init_model(cfg: Config, seed: int | None = None) -> Transformer:
  """Creates a `Transformer` with freshly initialized parameters.

  Initialization runs as one jitted computation, which compiles much faster
  than the many small eager initializer ops, and is cached across calls with
  the same model fields.

  Args:
    cfg: The configuration; only `MODEL_FIELDS` are read.
    seed: Seed of the parameter RNG; defaults to ``cfg.seed``.

  Returns:
    The model.
  """
  seed = cfg.seed if seed is None else seed
  model_cfg = Config(**{f: getattr(cfg, f) for f in MODEL_FIELDS})
  return _init(model_cfg, jax.random.key(seed))
