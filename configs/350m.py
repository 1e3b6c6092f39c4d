"""~353M parameters (byte vocabulary, tied embeddings)."""

from experiments.trainer import config


def get_config() -> config.Config:
  """Returns the 350m config."""
  return config.Config(
    d_model=1024,
    num_layers=28,
    num_heads=16,
    mlp_dim=4096,
    seq_len=1024,
    batch_size=32,
    steps=40_000,
    warmup_steps=2000,
    learning_rate=3e-4,
    data_max_bytes=1_000_000_000,
    checkpoint_every=1000,
  )
