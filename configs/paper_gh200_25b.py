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

from experiments.trainer import config


def get_config() -> config.Config:
  """Returns the paper_gh200_25b config."""
  return config.Config(
    d_model=6400,
    num_layers=51,
    num_heads=50,
    mlp_dim=4 * 6400,
    seq_len=4096,
    batch_size=8,
    dtype='bfloat16',
    param_dtype='bfloat16',
    scan_layers=True,
    steps=50_000,
    warmup_steps=2000,
    learning_rate=1e-4,
    clip_norm=1.0,
    cast='auto',
    data_max_bytes=4_000_000_000,
    checkpoint_every=500,
  )
