"""~17k parameters: a train step takes milliseconds; for tests."""

import ml_collections

from experiments.trainer import config_files


def get_config() -> ml_collections.ConfigDict:
  """Returns the tiny config."""
  cfg = config_files.defaults()
  cfg.d_model = 32
  cfg.num_layers = 1
  cfg.num_heads = 2
  cfg.mlp_dim = 64
  cfg.seq_len = 32
  cfg.batch_size = 4
  cfg.steps = 20
  cfg.warmup_steps = 2
  cfg.learning_rate = 1e-2
  cfg.data_max_bytes = 200_000
  cfg.final_loss_window = 3
  # Tests turn evaluation on where they check it: it compiles a second
  # program.
  cfg.eval_every = 0
  cfg.eval_batches = 2
  return cfg
