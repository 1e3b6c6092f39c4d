"""The trainer over several processes: `jax.distributed`, a watchdog, a vote.

`initialize` starts `jax.distributed` when the config asks for it (explicit
``--coordinator``/``--num-processes``/``--process-id``, or ``--distributed
auto`` for the cluster auto-detection of `jax.distributed.initialize`: SLURM,
Open MPI, Cloud TPU); with neither the trainer stays one process and never
touches `jax.distributed`.

A lost process is caught by `Watchdog`: every process keeps one TCP
connection to process 0, opened after `jax.distributed` is up. The kernel
closes a dead process's sockets however it dies (kill -9 included), so the
peer reads end-of-file at once, prints one line naming the lost process
and exits with `LOST_PROCESS_EXIT`, instead of waiting in a collective for
XLA's heartbeat timeout (``--heartbeat-timeout-s``), whose abort remains the
fallback for a host that hangs or is cut off without closing its sockets.
"""

import dataclasses
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax

from experiments.trainer import config as config_lib

# Exit status of a process whose peer was lost.
LOST_PROCESS_EXIT = 4
# Key-value store keys of the coordination service.
_WATCH_KEY = 'experiments.train/watchdog'
_VOTE_KEY = 'experiments.train/vote/'
# Sent on a watchdog connection before a clean close.
_BYE = b'bye\n'


@dataclasses.dataclass(frozen=True)
class Topology:
  """Which process this is, of how many, and where the coordinator is."""

  process_id: int = 0
  num_processes: int = 1
  coordinator: str | None = None

  @property
  def primary(self) -> bool:
    """Whether this process writes the run folder (process 0)."""
    return self.process_id == 0

  @property
  def distributed(self) -> bool:
    """Whether `jax.distributed` is initialized for this run."""
    return self.coordinator is not None or self.num_processes > 1


# One process, no jax.distributed: the trainer as it runs by default.
SINGLE = Topology()


def wanted(cfg: config_lib.Config) -> bool:
  """Whether `cfg` asks for `jax.distributed` at all."""
  return cfg.distributed == 'auto' or cfg.coordinator is not None


def initialize(cfg: config_lib.Config) -> Topology:
  """Starts `jax.distributed` as `cfg` asks (once per process).

  Returns:
    This process's place in the run; ``Topology()`` without distribution.

  Raises:
    config_lib.ConfigError: If the explicit flags are incomplete.
  """
  if not wanted(cfg):
    return SINGLE
  if not jax.distributed.is_initialized():
    # CPU collectives between processes go through gloo (no-op elsewhere).
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    try:
      jax.distributed.initialize(
        coordinator_address=cfg.coordinator,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        initialization_timeout=cfg.init_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        shutdown_timeout_seconds=cfg.shutdown_timeout_s,
      )
    except ValueError as e:  # Auto-detection found no cluster, for one.
      text = ' '.join(str(e).split())
      raise config_lib.ConfigError(f'jax.distributed: {text}') from None
  # The address jax.distributed settled on (auto-detected, or the flag's).
  coordinator = _state().coordinator_address or cfg.coordinator or 'auto'
  return Topology(jax.process_index(), jax.process_count(), coordinator)


def _state() -> Any:
  from jax._src import distributed as jax_distributed

  return jax_distributed.global_state


def _client() -> Any:
  return _state().client


def agree(topology: Topology, name: str, check: Callable[[], None]) -> None:
  """Runs `check` on process 0 and raises its `ConfigError` everywhere.

  The other processes wait for process 0's verdict, so a start refused
  there (a folder in use, a bad checkpoint) stops every process with the
  same one line.
  """
  if not topology.distributed:
    check()
    return
  client = _client()
  key = _VOTE_KEY + name
  if topology.primary:
    try:
      check()
    except config_lib.ConfigError as e:
      client.key_value_set(key, 'error:' + str(e))
      raise
    client.key_value_set(key, 'ok')
    return
  verdict = client.blocking_key_value_get(key, 3_600_000)
  if verdict.startswith('error:'):
    raise config_lib.ConfigError(verdict.removeprefix('error:'))


class Watchdog:
  """Exits at once, with one line, when a peer process dies."""

  def __init__(self, topology: Topology, host: str):
    """Connects every process to process 0 (collective: all must call)."""
    self.topology = topology
    self._closing = False
    self._socks: list[socket.socket] = []
    client = _client()
    if topology.primary:
      server = socket.create_server((host, 0))
      client.key_value_set(_WATCH_KEY, f'{host}:{server.getsockname()[1]}')
      for _ in range(topology.num_processes - 1):
        conn, _ = server.accept()
        peer = int(conn.recv(16).decode().strip())
        self._watch(conn, peer)
      server.close()
    else:
      address = client.blocking_key_value_get(_WATCH_KEY, 600_000)
      where, port = address.rsplit(':', 1)
      conn = socket.create_connection((where, int(port)))
      conn.sendall(f'{topology.process_id}\n'.encode())
      self._watch(conn, 0)

  def _watch(self, conn: socket.socket, peer: int) -> None:
    self._socks.append(conn)
    thread = threading.Thread(target=self._read, args=(conn, peer), daemon=True)
    thread.start()

  def _read(self, conn: socket.socket, peer: int) -> None:
    data = b''
    try:
      while chunk := conn.recv(64):
        data += chunk
    except OSError:
      pass
    if self._closing or data.endswith(_BYE):
      return
    me = self.topology
    sys.stderr.write(
      f'error: lost process {peer} of {me.num_processes} (its connection '
      f'to process {me.process_id} closed without a clean exit); process '
      f'{me.process_id} stops\n'
    )
    sys.stderr.flush()
    os._exit(LOST_PROCESS_EXIT)

  def close(self) -> None:
    """Says goodbye to the peers (a clean exit is no loss)."""
    self._closing = True
    for conn in self._socks:
      try:
        conn.sendall(_BYE)
        conn.shutdown(socket.SHUT_WR)
      except OSError:
        pass


def coordinator_host(topology: Topology) -> str:
  """The host process 0 listens on: the coordinator's, else its own name."""
  if topology.coordinator and ':' in topology.coordinator:
    return topology.coordinator.rsplit(':', 1)[0]
  return socket.gethostname()
