"""~1.0B parameters (byte vocabulary, tied embeddings)."""

from experiments.trainer import config


def get_config() -> config.Config:
  """Returns the 1b config."""
  return config.Config(
    d_model=2048,
    num_layers=20,
    num_heads=16,
    mlp_dim=8192,
    seq_len=2048,
    batch_size=16,
    steps=50_000,
    warmup_steps=2000,
    learning_rate=2e-4,
    data_max_bytes=4_000_000_000,
    checkpoint_every=500,
  )
