"""The SuperOffload paper's largest model on one GH200: ~25B parameters.

The shape `superoffload.ModelSpec.from_params(25e9)` predicts with (hidden
6400, 51 layers, heads of 128; 12 * 51 * 6400**2 = 25.1e9 parameters) at
the sequence length and batch of `experiments/benchmarks/paper_predictions`
(4096 x 8). Weights stay on the device in bfloat16; the fp32 master, mu and
nu live in the Grace host's memory, updated there per bucket while the
backward pass runs (speculation-then-validation armed by the clipping).

Not run: no GH200 was used. The cost model's predictions for this size are
in experiments/benchmarks/paper_predictions.md.
"""

import ml_collections

from experiments.trainer import config_files


def get_config() -> ml_collections.ConfigDict:
  """Returns the paper_gh200_25b config."""
  cfg = config_files.defaults()
  cfg.d_model = 6400
  cfg.num_layers = 51
  cfg.num_heads = 50
  cfg.mlp_dim = 4 * 6400
  cfg.seq_len = 4096
  cfg.batch_size = 8
  cfg.dtype = 'bfloat16'
  cfg.param_dtype = 'bfloat16'
  cfg.scan_layers = True
  cfg.steps = 50_000
  cfg.warmup_steps = 2000
  cfg.learning_rate = 1e-4
  cfg.clip_norm = 1.0
  cfg.cast = 'auto'
  cfg.data_max_bytes = 4_000_000_000
  cfg.checkpoint_every = 500
  return cfg
