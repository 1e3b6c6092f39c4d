"""A Flax Linen training loop with `flax.training.train_state.TrainState`.

The other common Flax loop, next to the NNX trainer (`experiments.trainer`):
a small Linen byte-level decoder on the same data, trained by a jitted,
donated ``state.apply_gradients`` step whose optimizer is
``superoffload.adamw`` (or ``optax.adamw`` to compare)::

    python -m experiments.trainer.linen_train --steps 200
    python -m experiments.trainer.linen_train --optimizer optax --data README.md

SuperOffload needs nothing Linen-specific: `TrainState` calls ``tx.init``
and ``tx.update`` like any optax optimizer, and the Adam state lands in
host memory.
"""

# Tensor names carry their shapes (`x_BxLxD`), NanoDO style.
# ruff: noqa: N803, N806

import argparse
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jax_superoffload as superoffload
from experiments.trainer import data as data_lib


class Block(nn.Module):
  """Pre-norm causal self-attention and MLP."""

  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    """Maps the residual stream to the next one."""
    mask_Bx1xLxL = nn.make_causal_mask(x_BxLxD[..., 0])
    h_BxLxD = nn.LayerNorm()(x_BxLxD)
    attention = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)
    x_BxLxD = x_BxLxD + attention(h_BxLxD, h_BxLxD, mask=mask_Bx1xLxL)
    h_BxLxF = nn.gelu(nn.Dense(self.mlp_dim)(nn.LayerNorm()(x_BxLxD)))
    return x_BxLxD + nn.Dense(x_BxLxD.shape[-1])(h_BxLxF)


class ByteLM(nn.Module):
  """Byte-level decoder: embedding, learned positions, blocks, tied head."""

  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 256
  max_len: int = 512

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    """Maps byte ids to next-byte logits."""
    embed = nn.Embed(256, self.d_model)
    init = nn.initializers.normal(0.02)
    pos_PxD = self.param('pos', init, (self.max_len, self.d_model))
    x_BxLxD = embed(tokens_BxL) + pos_PxD[: tokens_BxL.shape[1]]
    for _ in range(self.num_layers):
      x_BxLxD = Block(self.num_heads, self.mlp_dim)(x_BxLxD)
    return embed.attend(nn.LayerNorm()(x_BxLxD))


def make_state(
  tx: optax.GradientTransformation, seq_len: int, seed: int = 0
) -> train_state.TrainState:
  """A `TrainState` of a fresh `ByteLM` with optimizer `tx`."""
  model = ByteLM()
  tokens_1xL = jnp.zeros((1, seq_len), jnp.int32)
  params = model.init(jax.random.key(seed), tokens_1xL)['params']
  # Committed parameters: the step compiles once (see the README).
  params = jax.device_put(params, jax.devices()[0])
  return train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=tx
  )


@functools.partial(jax.jit, donate_argnums=0)
def train_step(
  state: train_state.TrainState, inputs_BxL: jax.Array, targets_BxL: jax.Array
) -> tuple[train_state.TrainState, jax.Array]:
  """One AdamW step; returns the new state and the loss before it."""

  def loss_fn(params):
    logits_BxLxV = state.apply_fn({'params': params}, inputs_BxL)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits_BxLxV, targets_BxL
    ).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def make_optimizer(name: str, steps: int, learning_rate: float):
  """``superoffload.adamw`` or ``optax.adamw`` on a warmup-cosine schedule."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, learning_rate, max(1, steps // 10), max(steps, 2)
  )
  adamw = {'superoffload': superoffload.adamw, 'optax': optax.adamw}[name]
  return adamw(schedule, b2=0.95, weight_decay=0.1)


def train(
  data: str | None,
  steps: int,
  optimizer: str = 'superoffload',
  batch_size: int = 8,
  seq_len: int = 64,
  learning_rate: float = 3e-3,
  log_every: int = 0,
) -> list[float]:
  """Trains a `ByteLM` and returns the loss of every step.

  Args:
    data: Text file or folder (None: the stdlib's sources), as the NNX
      trainer reads it.
    steps: Optimizer steps.
    optimizer: "superoffload" or "optax".
    batch_size: Sequences per batch.
    seq_len: Tokens per sequence.
    learning_rate: Peak learning rate.
    log_every: Print the loss every this many steps (0: never).
  """
  tokens_N = data_lib.read_corpus(data, 4_000_000)
  batches = data_lib.BatchIterator(tokens_N, batch_size, seq_len, seed=0)
  tx = make_optimizer(optimizer, steps, learning_rate)
  state = make_state(tx, seq_len)
  losses = []
  for step in range(steps):
    inputs_BxL, targets_BxL = next(batches)
    state, loss = train_step(state, inputs_BxL, targets_BxL)
    losses.append(float(loss))
    if log_every and (step % log_every == 0 or step == steps - 1):
      print(f'step {step}: loss {losses[-1]:.4f}')
  return losses


def main(argv: Sequence[str] | None = None) -> int:
  """CLI entry point."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data', default=None, help='text file or folder')
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument(
    '--optimizer', choices=('superoffload', 'optax'), default='superoffload'
  )
  parser.add_argument('--batch-size', type=int, default=8)
  parser.add_argument('--seq-len', type=int, default=64)
  parser.add_argument('--learning-rate', type=float, default=3e-3)
  args = parser.parse_args(argv)
  losses = train(
    args.data,
    args.steps,
    args.optimizer,
    args.batch_size,
    args.seq_len,
    args.learning_rate,
    log_every=max(1, args.steps // 10),
  )
  print(f'done: loss {losses[0]:.4f} -> {losses[-1]:.4f} ({args.optimizer})')
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
