"""Test setup: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
