"""Low-level entry points of the Grace Adam CPU kernel.

`adam_step` runs one fused Adam/AdamW step through an XLA FFI custom call;
`adam_step_reference` is the same step in `jax.numpy`. The bucket entry
points (`adam_step_segments`, `adam_step_lowp_segments`,
`adam_step_speculative`) are the calls the optimizer's host step makes on a
bucket of leaves, with the step's scalars as one `Hyperparams`.
"""

from jax_superoffload._src.core.hyperparams import Hyperparams
from jax_superoffload._src.core.moments import BLOCK as MOMENT_BLOCK
from jax_superoffload._src.host.adam_reference import adam_step_reference
from jax_superoffload._src.host.grace_adam import adam_step
from jax_superoffload._src.host.grace_adam import adam_step_lowp_segments
from jax_superoffload._src.host.grace_adam import adam_step_segments
from jax_superoffload._src.host.grace_adam import adam_step_speculative
from jax_superoffload._src.host.grace_adam import instruction_set
from jax_superoffload._src.host.grace_adam import prefetch_policy
from jax_superoffload._src.host.grace_adam import stream_roofline

__all__ = [
  'MOMENT_BLOCK',
  'Hyperparams',
  'adam_step',
  'adam_step_lowp_segments',
  'adam_step_reference',
  'adam_step_segments',
  'adam_step_speculative',
  'instruction_set',
  'prefetch_policy',
  'stream_roofline',
]
