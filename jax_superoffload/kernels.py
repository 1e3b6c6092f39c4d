"""Low-level entry points of the Grace Adam CPU kernel.

`adam_step` runs one fused Adam/AdamW step through an XLA FFI custom call;
`adam_step_reference` is the same step in `jax.numpy`.
"""

from jax_superoffload._src.host.adam_reference import adam_step_reference
from jax_superoffload._src.host.grace_adam import adam_step
from jax_superoffload._src.host.grace_adam import instruction_set
from jax_superoffload._src.host.grace_adam import prefetch_policy
from jax_superoffload._src.host.grace_adam import stream_roofline

__all__ = [
  'adam_step',
  'adam_step_reference',
  'instruction_set',
  'prefetch_policy',
  'stream_roofline',
]
