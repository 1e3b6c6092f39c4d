"""A Llama-8B-shaped step for one 80 GB GPU: 7.24B parameters.

The trainer's blocks have neither grouped KV heads nor a gated MLP, so the
nearest shape keeps Llama's width, depth and parameters per block: 32
blocks of 4096 with 32 heads of 128, full multi-head attention (4 * 4096**2
weights, where Llama 3's grouped heads have 2.5 * 4096**2) and a plain MLP
of 18432 (2 * 4096 * 18432 weights, where Llama 3's gated MLP has 3 * 4096
* 14336): 218M per block either way. Untied embeddings of a 32000-token
vocabulary (Llama 2's), no biases, rotary positions. Weights and
activations in bfloat16; superoffload keeps the fp32 master and moments in
host memory. Sequence 2048, batch 1, each block rematerialized in the
backward pass (the trainer's scanned blocks always are). No gradient
clipping: clipping arms speculation-then-validation, whose rollback copy
more than doubles the host state (28 bytes a parameter, 203 GB) and whose
steps start only after the backward loop. Scanned blocks start their host
steps after the backward loop too (`overlap_scan` off): started in it,
each 16-bit stack's new fp32 master crosses to the device whole before it
is rounded (38.11 GB of device memory compiled, against 31.06 after the
loop by the 0.12.0.1 CUDA plugin's compiler; 0.12.1's places the
buckets' new weights in device memory, 38.76); at 8B and batch 1 the
host's Adam (about 1.3 s predicted at the H200 machine's measured 5.4
Gparam/s) outlasts the whole backward anyway.

Compiled for an H100 without a GPU (docs/gpu.md has the table and the
command); not run on one.
It trains on bytes (`vocab_size` 32000 only sizes the tables).
"""

import ml_collections

from experiments.trainer import config_files


def get_config() -> ml_collections.ConfigDict:
  """Returns the llama8b config."""
  cfg = config_files.defaults()
  cfg.vocab_size = 32000
  cfg.tie_embeddings = False
  cfg.use_bias = False
  cfg.d_model = 4096
  cfg.num_layers = 32
  cfg.num_heads = 32
  cfg.mlp_dim = 18432
  cfg.seq_len = 2048
  cfg.batch_size = 1
  cfg.dtype = 'bfloat16'
  cfg.param_dtype = 'bfloat16'
  cfg.scan_layers = True
  cfg.overlap_scan = False
  cfg.steps = 50_000
  cfg.warmup_steps = 2000
  cfg.learning_rate = 1e-4
  cfg.data_max_bytes = 4_000_000_000
  cfg.checkpoint_every = 500
  return cfg
