"""The trainer over several processes: `jax.distributed`, a watchdog, a vote.

`initialize` starts `jax.distributed` when the config asks for it (explicit
``--coordinator``/``--num-processes``/``--process-id``, or ``--distributed
auto`` for the cluster auto-detection of `jax.distributed.initialize`: SLURM,
Open MPI, Cloud TPU); with neither the trainer stays one process and never
touches `jax.distributed`.

Launched from the command line, each process of the run is a trainer child
of an `experiments.trainer.supervisor`, which holds the watchdog, the exit
status and stderr, so that any process's death ends every other with one
line and exit 4 (see there for why the trainer's own process cannot). This
module is the child's side: `Watchdog` sets up its supervisor's watchdog
connection through jax's key-value store and sends it signs of life. A
trainer started in-process (`train.train`) has no supervisor; its
`Watchdog` then watches the peers itself, as well as one process can.
"""

import contextlib
import ctypes
import dataclasses
import os
import queue
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jaxlib.version

from experiments.trainer import config as config_lib
from experiments.trainer import liveness
from experiments.trainer import supervisor

# Exit status of a process whose peer was lost.
LOST_PROCESS_EXIT = supervisor.LOST_EXIT
# Key-value store keys of the coordination service.
_WATCH_KEY = 'experiments.train/watchdog'
_VOTE_KEY = 'experiments.train/vote/'
# Sent on an in-process watchdog connection before a clean close.
_BYE = b'bye\n'
# Where process 0's coordination service listens (jax's own variable).
BIND_ENV = 'JAX_COORDINATOR_BIND_ADDRESS'
# Test-only: SIGUSR1 raises an exception in the main thread when set.
RAISE_ENV = supervisor.RAISE_ENV


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


def supervised() -> bool:
  """Whether this process is a trainer child of a `supervisor`."""
  return supervisor.LINK_ENV in os.environ


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
    _install_test_hooks()
    if supervised():
      _link().start()
    # CPU collectives between processes go through gloo (no-op elsewhere).
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    try:
      jax.distributed.initialize(
        coordinator_address=cfg.coordinator,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        initialization_timeout=cfg.init_timeout_s,
        # XLA's heartbeat is the fallback: the watchdog's bound comes first.
        heartbeat_timeout_seconds=2 * cfg.heartbeat_timeout_s,
        shutdown_timeout_seconds=cfg.shutdown_timeout_s,
        coordinator_bind_address=bind_address(
          cfg.coordinator, cfg.coordinator_bind
        ),
      )
    except ValueError as e:  # Auto-detection found no cluster, for one.
      raise config_lib.ConfigError(f'jax.distributed: {_one_line(e)}') from None
    except Exception as e:  # The coordinator, or a peer, never answered.
      print(
        f'error: jax.distributed did not start: {_one_line(e)}',
        file=sys.stderr,
        flush=True,
      )
      os._exit(LOST_PROCESS_EXIT)
  if jax.process_count() > 1 and cache_hangs_collectives():
    # Before the run's first compile, which reads the setting once.
    jax.config.update('jax_enable_compilation_cache', False)
  # The address jax.distributed settled on (auto-detected, or the flag's).
  coordinator = liveness.coordinator_address() or cfg.coordinator or 'auto'
  topology = Topology(jax.process_index(), jax.process_count(), coordinator)
  if supervised():
    _link().send(
      f'hello {topology.process_id} {topology.num_processes} {coordinator}'
    )
    # Signs of life from here on: the supervisor counts a silence as a hang.
    _link().beat(max(0.05, cfg.heartbeat_timeout_s / 4))
  return topology


def cache_hangs_collectives() -> bool:
  """Whether a cached executable's collectives hang beside compiled ones.

  jaxlib 0.12.1's XLA:CPU: a cross-process collective (gloo) of an
  executable read from the persistent compilation cache never meets the
  same collective of one compiled in the run; both processes wait in it
  forever. Both read, or both compiled, they meet (jaxlib 0.12.0.1: in
  every mix). A shared cache folder always mixes them: only process 0
  writes the cache, and each process's cache key hashes its own devices,
  so on a warm cache process 0 reads what the others compile.
  `tests/test_jaxlib_cache_collectives.py` holds the reproducer (no
  trainer code), and says when a jaxlib fixes it. Only the CPU backend is
  known to be affected; the GPU's collectives (NCCL) were not tried.
  """
  return jaxlib_version() >= (0, 12, 1) and jax.default_backend() == 'cpu'


def jaxlib_version() -> tuple[int, ...]:
  """The installed jaxlib's release numbers, e.g. (0, 12, 0, 1)."""
  release = re.match(r'[0-9]+(\.[0-9]+)*', jaxlib.version.__version__)
  return tuple(int(x) for x in release[0].split('.'))


def bind_address(
  coordinator: str | None, bind: str | None = None
) -> str | None:
  """Where process 0's coordination service listens.

  `bind` (``--config.coordinator_bind``) wins, then
  ``JAX_COORDINATOR_BIND_ADDRESS``; else a loopback coordinator (127.0.0.1,
  ::1, localhost) binds loopback only; else None: jax's default, every
  interface (``[::]:PORT``).
  """
  if bind := bind or os.environ.get(BIND_ENV):
    return bind
  if coordinator is None or ':' not in coordinator:
    return None
  host, port = coordinator.rsplit(':', 1)
  host = host.strip('[]')
  if host == 'localhost' or host.startswith('127.') or host == '::1':
    return f'[{host}]:{port}' if ':' in host else f'{host}:{port}'
  return None


def _one_line(error: BaseException, limit: int = 300) -> str:
  text = ' '.join(str(error).split()) or type(error).__name__
  return text if len(text) <= limit else text[: limit - 3] + '...'


# Test-only: set once SIGUSR1 has asked for an exception (RAISE_ENV).
_RAISE_ASKED = threading.Event()


def _install_test_hooks() -> None:
  """Test-only: `RAISE_ENV` makes SIGUSR1 raise in the main thread."""
  if os.environ.get(RAISE_ENV):

    def _raise(signum: int, frame: Any) -> None:
      _RAISE_ASKED.set()
      raise RuntimeError(f'{RAISE_ENV}: an exception, as asked')

    signal.signal(signal.SIGUSR1, _raise)


def raise_if_asked() -> None:
  """Test-only: raises at a step's start if SIGUSR1 asked for an exception.

  A handler's exception surfaces wherever the main thread is, and there
  code that ignores exceptions (a weakref callback, a `__del__`, a broad
  `except` in a library) can lose it: the chaos rounds then saw the victim
  train to the end (round 39 of 100). A real exception has a place it is raised
  from; this gives the injected one such a place too.
  """
  if _RAISE_ASKED.is_set():
    raise RuntimeError(f'{RAISE_ENV}: an exception, as asked (step start)')


class _Link:
  """The trainer child's side of its supervisor's link (a socket pair)."""

  def __init__(self):
    self.sock = socket.socket(fileno=int(os.environ[supervisor.LINK_ENV]))
    self.replies: queue.Queue[str] = queue.Queue()
    self.lock = threading.Lock()

  def start(self) -> None:
    """Dies with the supervisor; leaves SIGINT to it; starts heartbeats."""
    _die_with_parent()
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    buffer = b''
    while data := self.sock.recv(4096):
      buffer += data
      while b'\n' in buffer:
        line, buffer = buffer.split(b'\n', 1)
        self.replies.put(line.decode())
    os._exit(LOST_PROCESS_EXIT)  # The supervisor is gone: so are we.

  def send(self, line: str) -> None:
    """Sends one line to the supervisor."""
    with self.lock:
      self.sock.sendall((line + '\n').encode())

  def ask(self, line: str, timeout_s: float) -> str:
    """Sends `line` and returns the supervisor's reply."""
    self.send(line)
    return self.replies.get(timeout=timeout_s)

  def beat(self, period_s: float) -> None:
    """Sends a sign of life every `period_s` seconds (a daemon thread)."""

    def loop() -> None:
      while True:
        self.send('beat')
        threading.Event().wait(period_s)

    threading.Thread(target=loop, daemon=True).start()


_the_link: list[_Link] = []


def _link() -> _Link:
  if not _the_link:
    _the_link.append(_Link())
  return _the_link[0]


def _die_with_parent() -> None:
  """Asks Linux to kill this process when its parent dies (best effort)."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
  except (OSError, AttributeError):
    pass


def agree(topology: Topology, name: str, check: Callable[[], None]) -> None:
  """Runs `check` on process 0 and raises its `ConfigError` everywhere.

  The other processes wait for process 0's verdict, so a start refused
  there (a folder in use, a bad checkpoint) stops every process with the
  same one line.
  """
  if not topology.distributed:
    check()
    return
  client = liveness.coordination_client()
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
  """Connects this process to its peers' watchdogs (collective).

  Under a supervisor: process 0's supervisor listens and every other
  supervisor connects to it (the address goes through jax's key-value
  store); the child sends its supervisor a sign of life every `bound_s` / 4
  seconds from `initialize` on. In-process (no supervisor), this process watches
  the connections itself and exits with one line when one closes without a
  goodbye (best effort: jax's client may abort the process first).
  """

  def __init__(self, topology: Topology, host: str, bound_s: float = 100.0):
    """Sets up the watchdog connections (every process must call it)."""
    self.topology = topology
    self._closing = False
    self._socks: list[socket.socket] = []
    client = liveness.coordination_client()
    timeout_ms = int(1000 * bound_s)
    if supervised():
      link = _link()
      if topology.primary:
        port = link.ask(f'listen {host}', bound_s).split()[1]
        client.key_value_set(_WATCH_KEY, f'{host}:{port}')
      else:
        address = client.blocking_key_value_get(_WATCH_KEY, timeout_ms)
        link.ask(f'connect {address}', bound_s)
    elif topology.primary:
      server = socket.create_server((host, 0))
      client.key_value_set(_WATCH_KEY, f'{host}:{server.getsockname()[1]}')
      for _ in range(topology.num_processes - 1):
        conn, _ = server.accept()
        self._watch(conn, int(conn.recv(16).decode().strip()))
      server.close()
    else:
      address = client.blocking_key_value_get(_WATCH_KEY, timeout_ms)
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
    with contextlib.suppress(OSError):
      while chunk := conn.recv(64):
        data += chunk
    if self._closing or data.endswith(_BYE):
      return
    me = self.topology
    os.write(
      2,
      f'error: lost process {peer} of {me.num_processes} (its connection '
      f'to process {me.process_id} closed without a clean exit); process '
      f'{me.process_id} stops\n'.encode(),
    )
    os._exit(LOST_PROCESS_EXIT)

  def close(self) -> None:
    """Says goodbye (a clean exit is no loss; the run's end is settled)."""
    self._closing = True
    if supervised():
      _link().send('bye')
    for conn in self._socks:
      with contextlib.suppress(OSError):
        conn.sendall(_BYE)
        conn.shutdown(socket.SHUT_WR)


def coordinator_host(topology: Topology) -> str:
  """The host process 0 listens on: the coordinator's, else its own name."""
  if topology.coordinator and ':' in topology.coordinator:
    return topology.coordinator.rsplit(':', 1)[0]
  return socket.gethostname()
