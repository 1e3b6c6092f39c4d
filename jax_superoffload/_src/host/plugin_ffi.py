"""Grace Adam's FFI handlers in a PJRT plugin's registry (GPU host compute).

On a GPU, XLA compiles a `compute_on('device_host')` region inside the CUDA
PJRT plugin, whose own XLA:CPU looks custom-call handlers up for platform
"Host" in the plugin's FFI registry. `jax.ffi.register_ffi_target(...,
platform='cpu')` files them in jaxlib's registry only, which the plugin
never reads. The plugin offers its registry through the PJRT FFI extension
(`xla/pjrt/c/pjrt_c_api_ffi_extension.h`), one link of the extension chain
of the `PJRT_Api` that its exported `GetPjrtApi()` returns; this module
walks that chain with ctypes and files each handler for "Host".

Every failure is soft: `register_host_handlers` returns a `Registration`
whose `reason` says what was missing or of another layout. Registration
only files the handlers; whether the plugin's host compiler finds them, and
whether they run there (they use XLA:CPU's intra-op thread pool), only a
GPU run can show.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import os
import pathlib

from jax_superoffload import _grace_adam

# Set to a plugin library to register in it when JAX has not loaded one
# (tests on CPU machines with the plugin wheel unpacked aside).
PLUGIN_ENV = 'JAX_SUPEROFFLOAD_CUDA_PLUGIN'
PLUGIN_PACKAGES = ('jax_plugins.xla_cuda13', 'jax_plugins.xla_cuda12')
PLUGIN_FILES = ('xla_cuda_plugin.so', 'pjrt_c_api_gpu_plugin.so')
HOST_PLATFORM = 'Host'
# PJRT_Extension_Type_FFI in `pjrt_c_api.h`.
FFI_EXTENSION_TYPE = 5
# The PJRT C API minor versions this layout was checked against (jax-cuda13
# plugins 0.10.2, 0.11.2 and 0.12.0.1 report 0.112, 0.115 and 0.116).
CHECKED_MINORS = (112, 115, 116)
_MAX_EXTENSIONS = 64  # A chain longer than this is not a chain.
_LIBRARIES: dict[str, ctypes.CDLL] = {}

_size_t = ctypes.c_size_t
_ptr = ctypes.c_void_p


class _ExtensionBase(ctypes.Structure):
  _fields_ = (('struct_size', _size_t), ('type', ctypes.c_int), ('next', _ptr))


class _ApiVersion(ctypes.Structure):
  _fields_ = (
    ('struct_size', _size_t),
    ('extension_start', _ptr),
    ('major', ctypes.c_int),
    ('minor', ctypes.c_int),
  )


class _ApiHead(ctypes.Structure):
  """The first fields of `PJRT_Api`, all this module reads."""

  _fields_ = (
    ('struct_size', _size_t),
    ('extension_start', _ptr),
    ('version', _ApiVersion),
    ('error_destroy', _ptr),
    ('error_message', _ptr),
    ('error_get_code', _ptr),
  )


class _FfiExtension(ctypes.Structure):
  _fields_ = (
    ('base', _ExtensionBase),
    ('type_register', _ptr),
    ('user_data_add', _ptr),
    ('register_handler', _ptr),
  )


class _RegisterHandlerArgs(ctypes.Structure):
  _fields_ = (
    ('struct_size', _size_t),
    ('target_name', ctypes.c_char_p),
    ('target_name_size', _size_t),
    ('handler', _ptr),  # An XLA_FFI_Handler*.
    ('platform_name', ctypes.c_char_p),
    ('platform_name_size', _size_t),
    ('traits', ctypes.c_uint32),
  )


class _ErrorMessageArgs(ctypes.Structure):
  _fields_ = (
    ('struct_size', _size_t),
    ('extension_start', _ptr),
    ('error', _ptr),
    ('message', ctypes.POINTER(ctypes.c_char)),
    ('message_size', _size_t),
  )


class _ErrorDestroyArgs(ctypes.Structure):
  _fields_ = (
    ('struct_size', _size_t),
    ('extension_start', _ptr),
    ('error', _ptr),
  )


def _struct_size(struct: type[ctypes.Structure], last: str) -> int:
  """`PJRT_STRUCT_SIZE`: the offset of the last field plus its size."""
  field = getattr(struct, last)
  return field.offset + field.size


_FFI_EXTENSION_SIZE = _struct_size(_FfiExtension, 'register_handler')  # 48
_REGISTER_ARGS_SIZE = _struct_size(_RegisterHandlerArgs, 'traits')  # 52
_API_HEAD_SIZE = _struct_size(_ApiHead, 'error_get_code')
_CALL = ctypes.CFUNCTYPE(_ptr, _ptr)  # PJRT_Error* f(Args*).
_VOID_CALL = ctypes.CFUNCTYPE(None, _ptr)  # void f(Args*).


@dataclasses.dataclass(frozen=True)
class Registration:
  """What `register_host_handlers` did, and why not where it did not."""

  ok: bool  # Every handler was filed for the platform without error.
  reason: str  # What was done, or the first thing that was missing.
  library: str | None = None  # The plugin library used.
  api_version: tuple[int, int] | None = None  # Its PJRT C API version.
  targets: tuple[str, ...] = ()  # The custom-call targets filed.


def _loaded_plugin() -> str | None:
  """A CUDA plugin library this process has already loaded, if any."""
  try:
    maps = pathlib.Path('/proc/self/maps').read_text()
  except OSError:
    return None
  for line in maps.splitlines():
    path = line.split(maxsplit=5)[-1]
    if path.endswith(PLUGIN_FILES):
      return path
  return None


def _installed_plugin() -> str | None:
  """The library of an installed `jax_plugins` CUDA package, if any."""
  for package in PLUGIN_PACKAGES:
    try:
      spec = importlib.util.find_spec(package)
    except ImportError:
      continue
    for folder in (spec.submodule_search_locations or []) if spec else []:
      for name in PLUGIN_FILES:
        path = pathlib.Path(folder) / name
        if path.exists():
          return str(path)
  return None


def find_cuda_plugin() -> str | None:
  """The CUDA PJRT plugin library to register in, or None.

  The copy JAX has loaded comes first: registering in another copy of the
  same file would fill a registry that no compiler reads. Then
  `$JAX_SUPEROFFLOAD_CUDA_PLUGIN`, then an installed `jax-cuda1x-pjrt`.
  """
  return _loaded_plugin() or os.environ.get(PLUGIN_ENV) or _installed_plugin()


# Own prototypes rather than setting argtypes on the shared
# `ctypes.pythonapi` functions, which other code may have typed differently.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
  ('PyCapsule_GetName', ctypes.pythonapi)
)
_capsule_pointer_of = ctypes.PYFUNCTYPE(
  _ptr, ctypes.py_object, ctypes.c_char_p
)(('PyCapsule_GetPointer', ctypes.pythonapi))


def _capsule_pointer(capsule: object) -> int:
  """The handler address inside a handler capsule."""
  return _capsule_pointer_of(capsule, _capsule_name(capsule))


def _error_text(head: _ApiHead, error: int) -> str:
  """The message of a `PJRT_Error*`, which is destroyed afterwards."""
  args = _ErrorMessageArgs(
    _struct_size(_ErrorMessageArgs, 'message_size'), None, error, None, 0
  )
  _VOID_CALL(head.error_message)(ctypes.addressof(args))
  text = ctypes.string_at(args.message, args.message_size).decode(
    errors='replace'
  )
  destroy = _ErrorDestroyArgs(
    _struct_size(_ErrorDestroyArgs, 'error'), None, error
  )
  _VOID_CALL(head.error_destroy)(ctypes.addressof(destroy))
  return text


def _load_api(library: str) -> tuple[int | None, str]:
  """The address of the plugin's `PJRT_Api`, or None and why not."""
  try:
    lib = ctypes.CDLL(library)
  except OSError as e:
    return None, f'cannot load {library}: {e}'
  try:
    get_api = lib.GetPjrtApi
  except AttributeError:
    return None, f'{library} exports no GetPjrtApi'
  get_api.restype, get_api.argtypes = _ptr, []
  address = get_api()
  if not address:
    return None, f'GetPjrtApi() of {library} returned NULL'
  _LIBRARIES[library] = lib  # The registry lives in it: keep it loaded.
  return address, ''


def _ffi_extension(head: _ApiHead) -> tuple[_FfiExtension | None, str]:
  """The FFI extension from the API's chain, or None and why not."""
  seen, address = [], head.extension_start
  while address and len(seen) < _MAX_EXTENSIONS:
    base = _ExtensionBase.from_address(address)
    if base.type == FFI_EXTENSION_TYPE:
      if base.struct_size < _FFI_EXTENSION_SIZE:
        return None, (
          f'the FFI extension is {base.struct_size} bytes, an older layout '
          f'without register_handler (needs {_FFI_EXTENSION_SIZE})'
        )
      ffi = _FfiExtension.from_address(address)
      if not ffi.register_handler:
        return None, 'the FFI extension has no register_handler'
      return ffi, ''
    seen.append(base.type)
    address = base.next
  return None, f'no FFI extension (type 5) among extension types {seen}'


def _register(head, ffi, name: str, handler: int, platform: str) -> str:
  """Files one handler; returns '' or the plugin's error message."""
  target, platform_bytes = name.encode(), platform.encode()
  args = _RegisterHandlerArgs(
    _REGISTER_ARGS_SIZE,
    target,
    len(target),
    handler,
    platform_bytes,
    len(platform_bytes),
    0,
  )
  error = _CALL(ffi.register_handler)(ctypes.addressof(args))
  return _error_text(head, error) if error else ''


def register_host_handlers(
  library: str | None = None, platform: str = HOST_PLATFORM
) -> Registration:
  """Files Grace Adam's FFI handlers in a PJRT plugin's registry.

  Args:
    library: the plugin library (default: `find_cuda_plugin()`).
    platform: the XLA platform to file them for; "Host" is the one the
      plugin's host-compute compiler looks up.

  Returns:
    A `Registration`; `ok` only when every handler was filed.
  """
  library = library or find_cuda_plugin()
  if library is None:
    return Registration(False, 'no CUDA PJRT plugin is loaded or installed')
  address, why = _load_api(library)
  if address is None:
    return Registration(False, why, library)
  return dataclasses.replace(
    register_in_api(address, platform), library=library
  )


def register_in_api(api: int, platform: str = HOST_PLATFORM) -> Registration:
  """`register_host_handlers` on a `PJRT_Api` at address `api`."""
  head = _ApiHead.from_address(api)
  if head.struct_size < _API_HEAD_SIZE:
    return Registration(False, f'a PJRT_Api of {head.struct_size} bytes')
  version = (head.version.major, head.version.minor)
  if version[0] != 0:
    return Registration(
      False, f'PJRT C API major version {version[0]}, not 0', None, version
    )
  ffi, why = _ffi_extension(head)
  if ffi is None:
    return Registration(False, why, None, version)
  handlers = _grace_adam.registrations()
  for name, capsule in handlers.items():
    error = _register(head, ffi, name, _capsule_pointer(capsule), platform)
    if error:
      why = f'register_handler({name!r}): {error}'
      return Registration(False, why, None, version)
  checked = '' if version[1] in CHECKED_MINORS else ' (a version not checked)'
  return Registration(
    True,
    f'{len(handlers)} handlers filed for {platform!r} in PJRT C API '
    f'{version[0]}.{version[1]}{checked}',
    None,
    version,
    tuple(handlers),
  )


@functools.cache
def host_registration() -> Registration:
  """Files the kernel as host compute in the CUDA PJRT plugin, once.

  Calls `register_host_handlers()` the first time in a process and returns
  its `Registration` (``ok``, and ``reason`` saying what was done or what
  was missing) then and on every later call.
  """
  return register_host_handlers()
