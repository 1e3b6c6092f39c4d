"""~127M parameters (byte vocabulary, tied embeddings)."""

from experiments.trainer import config


def get_config() -> config.Config:
  """Returns the 125m config."""
  return config.Config(
    d_model=768,
    num_layers=18,
    num_heads=12,
    mlp_dim=3072,
    seq_len=1024,
    batch_size=32,
    steps=20_000,
    warmup_steps=1000,
    learning_rate=6e-4,
    data_max_bytes=1_000_000_000,
    checkpoint_every=1000,
  )
