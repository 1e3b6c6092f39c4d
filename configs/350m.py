"""~353M parameters (byte vocabulary, tied embeddings)."""

import ml_collections

from experiments.trainer import config_files


def get_config() -> ml_collections.ConfigDict:
  """Returns the 350m config."""
  cfg = config_files.defaults()
  cfg.d_model = 1024
  cfg.num_layers = 28
  cfg.num_heads = 16
  cfg.mlp_dim = 4096
  cfg.seq_len = 1024
  cfg.batch_size = 32
  cfg.steps = 40_000
  cfg.warmup_steps = 2000
  cfg.learning_rate = 3e-4
  cfg.data_max_bytes = 1_000_000_000
  cfg.checkpoint_every = 1000
  return cfg
