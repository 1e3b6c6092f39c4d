"""The byte-level decoder-only LM trainer (Flax NNX) of jax_superoffload.

`python -m experiments.trainer --config configs/demo.py` trains; see
`experiments.trainer.train` for what it writes and
`experiments.trainer.config_cli` for the config files and flags. Modules:
`config` (the typed config), `config_files` (ml_collections config files),
`config_cli` (the command line), `config_checks`, `model`, `data`, `optim`
(the optimizer and schedule), `steps` (the jitted train and eval steps),
`preflight` (every check before anything compiles), `loop`,
`checkpointing`, `digests` (checksums of sharded arrays), `distributed`
(several processes), `supervisor` (the process per rank that ends a run
cleanly), `liveness` (the private jax API, in one place), `chaos` (the
chaos rounds), `folder_lock`, `run_log`, `perf`, `cpu_peak` (the CPU's
recorded peak) and `plotting`; `train` ties them together. `linen_train`
is the same kind of model in Flax Linen and `switch_optimizer` moves a run
between optimizers.
"""
