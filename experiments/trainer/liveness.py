"""The parts of `jax.distributed` that jax does not make public, in one place.

jax has no public key-value store, error callback or address query for the
coordination service it starts (`jax.experimental.multihost_utils.
live_devices` exists, but is a barrier-like context that needs
``jax_enable_recoverability``, not a watchdog). The trainer needs three
things from it:

* the coordination client's key-value store (`coordination_client`), for
  the start-up vote and the watchdog's rendezvous;
* the address jax settled on (`coordinator_address`);
* an error callback for the client (`client_error_callback`), which jax's
  own `initialize` does not pass: without it the client aborts the process
  (``client.h``: "Terminating process because the JAX distributed service
  detected fatal errors", SIGABRT) when the coordinator or a peer is lost.

All three go through `_private_distributed`, which checks that what it uses
is there and otherwise raises `MissingJaxAPIError` naming it and the jax
version. Tested on jax 0.10.2, 0.12.0.1 and 0.12.1.
"""

from typing import Any

import jax


class MissingJaxAPIError(RuntimeError):
  """This jax lacks a private API the multi-process trainer relies on."""


_CALLBACK = 'missed_heartbeat_callback'


def _private_distributed() -> Any:
  """`jax._src.distributed`, checked for what this module uses.

  Raises:
    MissingJaxAPIError: If the module, its ``global_state`` or the client
      factory's error-callback argument is missing in this jax.
  """
  try:
    from jax._src import distributed as private
  except ImportError as e:
    raise _missing('jax._src.distributed', e) from None
  state = getattr(private, 'global_state', None)
  factory = getattr(
    getattr(private, '_jax', None), 'get_distributed_runtime_client', None
  )
  if state is None or not hasattr(state, 'client'):
    raise _missing('jax._src.distributed.global_state.client')
  if factory is None or _CALLBACK not in (factory.__doc__ or ''):
    raise _missing(f'get_distributed_runtime_client({_CALLBACK}=...)')
  return private


def _missing(what: str, cause: Exception | None = None) -> MissingJaxAPIError:
  why = f' ({cause})' if cause else ''
  return MissingJaxAPIError(
    f'jax {jax.__version__} has no {what}{why}; the multi-process trainer '
    'needs it (tested with jax 0.10.2, 0.12.0.1 and 0.12.1)'
  )


def coordination_client() -> Any:
  """The connected `DistributedRuntimeClient` (key-value store, barriers).

  Raises:
    MissingJaxAPIError: Without the private API, or before
      `jax.distributed.initialize`.
  """
  client = _private_distributed().global_state.client
  if client is None:
    raise MissingJaxAPIError('jax.distributed is not initialized')
  for method in ('key_value_set', 'blocking_key_value_get'):
    if not hasattr(client, method):
      raise _missing(f'DistributedRuntimeClient.{method}')
  return client


def coordinator_address() -> str | None:
  """The coordinator's address as jax settled on it (auto-detected too)."""
  return _private_distributed().global_state.coordinator_address
