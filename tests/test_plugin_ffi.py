"""Registration of Grace Adam's handlers in a PJRT plugin's FFI registry.

A fake `PJRT_Api` built with ctypes checks the extension walk and the
arguments on any machine; the real CUDA plugin (the `jax-cuda13-pjrt`
wheel, which loads without a GPU) is used where it is installed or
`$JAX_SUPEROFFLOAD_CUDA_PLUGIN` names it (`make cuda-plugin` unpacks it).
"""

import ctypes
import json
import os
import re
import subprocess
import sys
import warnings

import jax
import pytest

from jax_superoffload import _grace_adam
from jax_superoffload._src.host import executors
from jax_superoffload._src.host import plugin_ffi as pf

TARGETS = sorted(_grace_adam.registrations())


class FakeApi:
  """A `PJRT_Api` head with an extension chain, in Python memory."""

  def __init__(self, types=(4, 5, 0), ffi_size=48, major=0, error=None):
    self.calls, self.destroyed, self.error = [], [], error
    self.register = pf._CALL(self._register)
    self.message = pf._VOID_CALL(self._message)
    self.destroy = pf._VOID_CALL(self._destroy)
    self.links, self.error_text = [], ctypes.create_string_buffer(b'boom')
    following = None
    for t in reversed(types):
      if t == pf.FFI_EXTENSION_TYPE:
        link = pf._FfiExtension(register_handler=self._address(self.register))
        link.base = pf._ExtensionBase(ffi_size, t, following)
      else:
        link = pf._ExtensionBase(24, t, following)
      self.links.append(link)
      following = ctypes.addressof(link)
    version = pf._ApiVersion(24, None, major, 116)
    self.head = pf._ApiHead(1144, following, version)
    self.head.error_destroy = self._address(self.destroy)
    self.head.error_message = self._address(self.message)

  @staticmethod
  def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value

  @property
  def address(self) -> int:
    return ctypes.addressof(self.head)

  def _register(self, args_address):
    args = pf._RegisterHandlerArgs.from_address(args_address)
    self.calls.append(
      {
        'struct_size': args.struct_size,
        'name': ctypes.string_at(args.target_name, args.target_name_size),
        'platform': ctypes.string_at(
          args.platform_name, args.platform_name_size
        ),
        'handler': args.handler,
        'traits': args.traits,
      }
    )
    return ctypes.addressof(self.error_text) if self.error else None

  def _message(self, args_address):
    args = pf._ErrorMessageArgs.from_address(args_address)
    args.message = ctypes.cast(self.error_text, ctypes.POINTER(ctypes.c_char))
    args.message_size = len(self.error_text.value)

  def _destroy(self, args_address):
    self.destroyed.append(pf._ErrorDestroyArgs.from_address(args_address).error)


def test_files_every_handler_for_host_with_the_52_byte_layout():
  api = FakeApi()
  got = pf.register_in_api(api.address)
  assert got.ok, got.reason
  assert got.api_version == (0, 116)
  assert sorted(got.targets) == TARGETS
  assert sorted(c['name'].decode() for c in api.calls) == TARGETS
  capsules = _grace_adam.registrations()
  for call in api.calls:
    assert call['struct_size'] == 52
    assert call['platform'] == b'Host'
    assert call['traits'] == 0
    assert call['handler'] == pf._capsule_pointer(
      capsules[call['name'].decode()]
    )


@pytest.mark.parametrize(
  ('api', 'reason'),
  [
    (lambda: FakeApi(types=(4, 0)), r'no FFI extension \(type 5\).*\[4, 0\]'),
    (lambda: FakeApi(ffi_size=40), 'older layout without register_handler'),
    (lambda: FakeApi(major=1), 'major version 1'),
  ],
)
def test_fails_soft_with_a_reason(api, reason):
  fake = api()
  got = pf.register_in_api(fake.address)
  assert not got.ok
  assert fake.calls == []
  assert re.search(reason, got.reason), got.reason


def test_a_plugin_error_is_reported_and_destroyed():
  api = FakeApi(error=True)
  got = pf.register_in_api(api.address)
  assert not got.ok
  assert 'boom' in got.reason and TARGETS[0][:10] in got.reason
  assert api.destroyed == [ctypes.addressof(api.error_text)]


def test_no_plugin_and_not_a_plugin(monkeypatch):
  monkeypatch.setattr(pf, 'find_cuda_plugin', lambda: None)
  assert 'no CUDA PJRT plugin' in pf.register_host_handlers().reason
  got = pf.register_host_handlers(_grace_adam.__file__)
  assert not got.ok and 'exports no GetPjrtApi' in got.reason
  got = pf.register_host_handlers('/nonexistent/xla_cuda_plugin.so')
  assert not got.ok and 'cannot load' in got.reason


@pytest.mark.parametrize(
  ('driver', 'ok', 'asked', 'want'),
  [
    (True, True, 'auto', 'stream'),
    (True, False, 'auto', 'stream'),
    (False, True, 'auto', 'ffi'),
    (False, False, 'auto', 'xla_host'),
    (False, False, 'xla_host', 'xla_host'),
    (True, True, 'device', 'device'),
  ],
)
def test_auto_on_a_gpu_is_stream_where_the_driver_files_it(
  monkeypatch, driver, ok, asked, want
):
  # Else ffi where the kernel registers with the plugin's host compute,
  # else xla_host.
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  registration = pf.Registration(ok, 'test')
  monkeypatch.setattr(pf, 'host_registration', lambda: registration)
  filed = (driver, '' if driver else 'no CUDA driver here')
  monkeypatch.setattr(
    executors.grace_adam, 'stream_registration', lambda: filed
  )
  assert executors.resolve(asked) == want


def test_explicit_ffi_on_gpu_warns_without_registration(monkeypatch):
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  failed = pf.Registration(False, 'no plugin here')
  monkeypatch.setattr(pf, 'host_registration', lambda: failed)
  with pytest.warns(UserWarning, match='no plugin here'):
    assert executors.resolve('ffi') == 'ffi'
  monkeypatch.setattr(
    pf, 'host_registration', lambda: pf.Registration(True, '')
  )
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert executors.resolve('ffi') == 'ffi'


def test_cpu_keeps_ffi_without_looking_for_a_plugin(monkeypatch):
  def fail():
    raise AssertionError('no plugin look-up on CPU')

  monkeypatch.setattr(pf, 'host_registration', fail)
  assert jax.default_backend() == 'cpu'
  assert executors.resolve('auto') == 'ffi'


_REAL = """
import dataclasses, json, sys
from jax_superoffload._src.host import plugin_ffi
first = plugin_ffi.register_host_handlers(sys.argv[1])
again = plugin_ffi.register_host_handlers(sys.argv[1])
print(json.dumps([dataclasses.asdict(first), dataclasses.asdict(again)]))
"""


def test_real_cuda_plugin_registration():
  # Without importing it: its jax_plugins package would start a CUDA check.
  library = os.environ.get(pf.PLUGIN_ENV) or pf._installed_plugin()
  if not library:
    pytest.skip(
      'no CUDA PJRT plugin: `make cuda-plugin` (the jax-cuda13-pjrt wheel, '
      f'no dependencies) or set {pf.PLUGIN_ENV}'
    )
  # Its own process: the 400 MB library stays out of the test process.
  proc = subprocess.run(
    [sys.executable, '-c', _REAL, library],
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  )
  first, again = json.loads(proc.stdout.splitlines()[-1])
  assert first['ok'], first['reason']
  assert again['ok'], again['reason']  # Filing the same handler is a no-op.
  assert first['api_version'][0] == 0
  assert sorted(first['targets']) == TARGETS
