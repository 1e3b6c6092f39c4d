"""~17k parameters: a train step takes milliseconds; for tests."""

from experiments.trainer import config


def get_config() -> config.Config:
  """Returns the tiny config."""
  return config.Config(
    d_model=32,
    num_layers=1,
    num_heads=2,
    mlp_dim=64,
    seq_len=32,
    batch_size=4,
    steps=20,
    warmup_steps=2,
    learning_rate=1e-2,
    data_max_bytes=200_000,
    final_loss_window=3,
    # Tests turn evaluation on where they check it: it compiles a second
    # program.
    eval_every=0,
    eval_batches=2,
  )
