"""The C++ test's vectors are what the NumPy reference writes."""

from tests import moments_vectors


def test_vectors_file_is_what_the_reference_writes():
  # Regenerate with `python -m tests.moments_vectors` after changing the
  # reference; xla_ffi/moments_vectors_test.cc checks the kernel on every
  # instruction set against the file.
  written = moments_vectors.PATH.read_bytes()
  assert moments_vectors.generate() == written
