"""~1.0B parameters (byte vocabulary, tied embeddings)."""

import ml_collections

from experiments.trainer import config_files


def get_config() -> ml_collections.ConfigDict:
  """Returns the 1b config."""
  cfg = config_files.defaults()
  cfg.d_model = 2048
  cfg.num_layers = 20
  cfg.num_heads = 16
  cfg.mlp_dim = 8192
  cfg.seq_len = 2048
  cfg.batch_size = 16
  cfg.steps = 50_000
  cfg.warmup_steps = 2000
  cfg.learning_rate = 2e-4
  cfg.data_max_bytes = 4_000_000_000
  cfg.checkpoint_every = 500
  return cfg
