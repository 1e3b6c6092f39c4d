"""jax_superoffload: SuperOffload for JAX and Optax.

Optax transformations whose Adam state lives in host memory and whose step
runs on the CPU (the Grace Adam kernel, through XLA FFI).
"""

from jax_superoffload import kernels
from jax_superoffload._src.adam import adam, adamw
from jax_superoffload._src.transform import SuperOffloadState

__version__ = '0.1.0'

__all__ = [
  'SuperOffloadState',
  'adam',
  'adamw',
  'kernels',
]
