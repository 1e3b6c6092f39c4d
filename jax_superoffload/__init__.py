"""jax_superoffload: SuperOffload for JAX and Optax."""

from jax_superoffload import kernels

__version__ = '0.1.0'

__all__ = [
  'kernels',
]
