"""~127M parameters (byte vocabulary, tied embeddings)."""

import ml_collections

from experiments.trainer import config_files


def get_config() -> ml_collections.ConfigDict:
  """Returns the 125m config."""
  cfg = config_files.defaults()
  cfg.d_model = 768
  cfg.num_layers = 18
  cfg.num_heads = 12
  cfg.mlp_dim = 3072
  cfg.seq_len = 1024
  cfg.batch_size = 32
  cfg.steps = 20_000
  cfg.warmup_steps = 1000
  cfg.learning_rate = 6e-4
  cfg.data_max_bytes = 1_000_000_000
  cfg.checkpoint_every = 1000
  return cfg
