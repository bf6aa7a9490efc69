"""kvhost.Client: one connection to a kvhostd, and the worker session.

A :class:`Client` wraps one ``kvhost_client`` of the C ABI, which wraps the
C++ ``kvhost::Client``: one gRPC channel (it connects on the first call) and,
for a worker, one session that a background thread keeps open and reopens
after a daemon restart. The calls on pools and slots come from
:class:`~kvhost.pools.PoolCalls`, the L3 tier's from
:class:`~kvhost.storage.StorageCalls`, the node cache's from
:class:`~kvhost.cache.CacheCalls`, the ones that attach device buffers from
:class:`~kvhost.transfer.AttachCalls` and, from torch tensors,
:class:`~kvhost.torch_helpers.TorchAttachCalls`.

Thread safety: a Client may be used from any number of threads at once
(the ABI's calls release the GIL while they wait). Closing it while
another thread is inside a call is not allowed.

Ownership: the client owns the handles made through it and releases any
still open when it closes (see kvhost._handles). Closing ends the session,
so the daemon closes the session's attachments; attachments made without a
session (``session=False``) live on in the daemon until detached.
"""

from __future__ import annotations

import ctypes as C
import os
from typing import TYPE_CHECKING, Any, Dict, NamedTuple, Optional, Union, cast

from . import _json, _lib
from ._handles import Registry
from .cache import CacheCalls
from .pools import PoolCalls
from .storage import StorageCalls
from .torch_helpers import TorchAttachCalls
from .transfer import AttachCalls

if TYPE_CHECKING:
    from .async_calls import AsyncCalls

#: KVHOST_DEFAULT_ADDRESS of kvhost/defaults.h (kvhostd --listen's default;
#: tests/python_package_test.py checks they agree): the daemon's socket on a node.
DEFAULT_ADDRESS = "unix:///run/kvhost/kvhost.sock"


class SessionState(NamedTuple):
    """The worker session as it stands (kvhost_client_session_state)."""

    #: True while the session's stream is up.
    open: bool
    #: Sessions opened after the first (one per daemon restart or broken link).
    reconnects: int
    #: The session's id; "" before it was first opened.
    session_id: str


class SessionLosses(NamedTuple):
    """What the session lost since the client was made.

    Each loss (a daemon restart, or a broken connection whose session timed
    out) took the attachments of the session with it: attach again.
    """

    #: Losses so far.
    count: int  # type: ignore[assignment]  # shadows tuple.count, as it always did
    #: The last one's description ("" when none), e.g. "kvhostd restarted
    #: (...); 1 attachment(s) lost: ...".
    last: str


def _flag(value: bool) -> str:
    return "1" if value else "0"


class Client(Registry, PoolCalls, StorageCalls, CacheCalls, AttachCalls, TorchAttachCalls):
    """A connection to kvhostd. Use as a context manager, or call close().

    Args:
      address: "unix:///path.sock", a socket path, or "host:port".
      timeout: deadline of each call in seconds (None: the client's 30 s).
      session: attach within a worker session (a worker); False for a
        scheduler or a tool, whose attachments outlive the client.
      reconnect: True: the session is reopened after a daemon restart, with
        attempts backing off up to 5 s; a number: that most time between
        attempts, in seconds. The C ABI always reopens a session, so False
        is only allowed with ``session=False`` (where there is none).
      worker_name: the name in the daemon's logs (default "<host>:<pid>").
      owner_token: sent with every call; the owner of the pools this client
        creates (default: $KVHOST_OWNER_TOKEN, if set). Pools shared by
        several clients (kvhost.sglang's) need it: an existing pool is only
        adopted when this token opens it.
      tls_ca_file, tls_cert_file, tls_key_file, tls_server_name, insecure:
        TCP addresses only (see docs/RELIABILITY.md).
      max_message_bytes: largest message either way (default 64 MiB).
      wait_ready: if given, wait this many seconds for the daemon to serve
        before returning (DeadlineExceeded if it does not).

    Raises:
      InvalidArgument: a malformed option (the ABI names it).
      LibraryError: libkvhost_c.so cannot be loaded.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: Optional[float] = None,
                 session: bool = True, reconnect: Union[bool, float] = True, *,
                 worker_name: Optional[str] = None, owner_token: Optional[str] = None,
                 tls_ca_file: Optional[str] = None, tls_cert_file: Optional[str] = None,
                 tls_key_file: Optional[str] = None, tls_server_name: Optional[str] = None,
                 insecure: Optional[bool] = None, max_message_bytes: Optional[int] = None,
                 wait_ready: Optional[float] = None) -> None:
        Registry.__init__(self)
        self._init_pool_calls()
        self._ptr: Optional[C.c_void_p] = None
        self.address = address
        self.session = bool(session)
        if reconnect is False and self.session:
            raise ValueError("reconnect=False needs session=False: the C ABI always reopens a "
                             "worker session after a daemon restart")
        if owner_token is None:
            owner_token = os.environ.get("KVHOST_OWNER_TOKEN") or None
        options: Dict[str, str] = {"address": address, "worker_session": _flag(session)}
        if timeout is not None:
            options["timeout_ms"] = str(_lib.ms(timeout))
        if not isinstance(reconnect, bool):
            options["reconnect_max_backoff_ms"] = str(_lib.ms(reconnect))
        for key, value in (("worker_name", worker_name), ("owner_token", owner_token),
                           ("tls_ca_file", tls_ca_file), ("tls_cert_file", tls_cert_file),
                           ("tls_key_file", tls_key_file),
                           ("tls_server_name", tls_server_name)):
            if value is not None:
                options[key] = str(value)
        if insecure is not None:
            options["insecure"] = _flag(insecure)
        if max_message_bytes is not None:
            options["max_message_bytes"] = str(int(max_message_bytes))
        self._connect(options)
        if wait_ready is not None:
            self.wait_ready(wait_ready)

    def _connect(self, options: Dict[str, str]) -> None:
        lib = _lib.lib()
        opts = C.c_void_p()
        _lib.call(lib.kvhost_client_options_create, C.byref(opts))
        try:
            for key, value in options.items():
                _lib.call(lib.kvhost_client_options_set, opts, _lib.text(key, "option name"),
                          _lib.text(value, f"option {key}"))
            client = C.c_void_p()
            _lib.call(lib.kvhost_client_connect, opts, C.byref(client))
            self._ptr = client
        finally:
            lib.kvhost_client_options_destroy(opts)

    # --- lifetime ---------------------------------------------------------

    def _handle(self) -> C.c_void_p:
        """The kvhost_client* for a call; ValueError once closed."""
        if self._ptr is None:
            raise ValueError("the kvhost Client is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return self._ptr is None

    def close(self) -> None:
        """Releases the handles made through this client, ends the session
        (the daemon closes its attachments) and the channel. Idempotent."""
        if self._ptr is None:
            return
        self._release_handles()
        ptr, self._ptr = self._ptr, None
        _lib.lib().kvhost_client_close(ptr)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"kvhost.Client({self.address!r}, session={self.session}, {state})"

    # --- daemon and session -----------------------------------------------

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Waits until the daemon serves; DeadlineExceeded after `timeout` s."""
        _lib.call(_lib.lib().kvhost_client_wait_ready, self._handle(), _lib.ms(timeout))

    def daemon_status(self) -> Dict[str, Any]:
        """kvhost.v1.DaemonStatus as a dict (backend, pools, memory, tickets...)."""
        return cast(Dict[str, Any], _json.loads(_lib.call_out(
            _lib.lib().kvhost_daemon_status_json, self._handle())))

    def open_session(self, timeout: Optional[float] = None) -> None:
        """Opens the worker session now (attaching does it otherwise); idempotent."""
        _lib.call(_lib.lib().kvhost_client_open_session, self._handle(), _lib.ms(timeout))

    def session_state(self) -> SessionState:
        """Whether the session is open, its reconnects and its id."""
        is_open, reconnects = C.c_int32(0), C.c_uint64(0)
        session_id = _lib.call_out(_lib.lib().kvhost_client_session_state, self._handle(),
                                   C.byref(is_open), C.byref(reconnects), guess=256)
        return SessionState(bool(is_open.value), int(reconnects.value), session_id)

    def async_calls(self) -> "AsyncCalls":
        """An AsyncCalls of this client: alloc, free, backup and load
        submitted to an executor thread, each returning a
        concurrent.futures.Future at once (kvhost.async_calls). Close it (or
        use it as a context manager); the client closes it otherwise."""
        from .async_calls import AsyncCalls  # noqa: PLC0415 (imports transfer)
        return AsyncCalls(self)

    def session_losses(self) -> SessionLosses:
        """Session losses since the client was made, and the last one's words.

        Poll this after a suspected daemon restart: the attachments a loss
        names are gone (their calls raise NotFound); attach again.
        """
        count = C.c_uint64(0)
        last = _lib.call_out(_lib.lib().kvhost_client_session_losses, self._handle(),
                             C.byref(count))
        return SessionLosses(int(count.value), last)


def connect(address: str = DEFAULT_ADDRESS, timeout: Optional[float] = None,
            session: bool = True, **options: Any) -> Client:
    """Client(address, timeout, session, **options), for those who prefer a call."""
    return Client(address, timeout, session, **options)
