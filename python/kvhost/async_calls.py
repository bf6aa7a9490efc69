"""Asynchronous calls: alloc, free, backup and load without blocking.

A scheduler's thread must not wait on an RPC. :class:`AsyncCalls` (made by
``client.async_calls()`` or ``AsyncCalls(client)``) submits the calls to
one executor thread of the C ABI (``kvhost_async``, over the C++
``kvhost::AsyncClient``) and returns a :class:`concurrent.futures.Future`
at once. The executor runs the calls one at a time in the order they were
submitted: an alloc reaches the daemon before a backup submitted after it,
and the futures complete in that order too::

    with client.async_calls() as calls:
        slots = calls.alloc("p", 64)             # a Future; returns at once
        done = calls.free("p", old_slots)
        ...
        slots.result()                            # the indices, or raises
    # leaving the block waited for every call submitted

A future's result is what the synchronous call returns (alloc's indices,
free's count, backup's and load's :class:`~kvhost.transfer.Ticket`); its
exception is the same :class:`~kvhost.errors.KvhostError` subclass with
the daemon's code and message (``NotFound`` naming an unknown pool, ...).
``completed`` counts the calls that finished, failed ones included: since
they finish in order, the first ``completed`` calls submitted are done, the
one number a scheduler polls (sglang's ack queues). ``asyncio`` code can
await a future through ``asyncio.wrap_future``.

Futures are completed from the ABI's callback, on the executor thread,
before ``completed`` counts them; their done-callbacks run there too, so
they must not block (above all not on a later future of the same
AsyncCalls, which waits behind them).

``close()`` and leaving the ``with`` block wait for every call submitted
(as ``concurrent.futures.Executor.shutdown`` does); ``close(wait=False)``,
closing the client and garbage collection let the running call finish and
complete every queued one with :class:`~kvhost.errors.Cancelled` instead.

Thread safety: submit from any number of threads at once. Ownership: an
AsyncCalls belongs to its client, which closes it first when it closes.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes as C
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _arrays, _lib
from ._handles import Handle
from ._streams import event_bytes
from .errors import Cancelled
from .transfer import Ticket

#: KVHOST_ASYNC_MAX_REQUESTS: calls queued, running or finished and not yet
#: handed to their future at once; one more raises ResourceExhausted.
MAX_REQUESTS = 65536

#: Takes a finished request's result from the ABI (raising its error).
_Finish = Callable[[C.c_void_p, int], Any]


class _Completions:
    """The ABI's callback: completes each request's future.

    Apart from AsyncCalls so that the callback (held by the ABI) keeps no
    AsyncCalls alive, and the AsyncCalls can be collected and closed.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: Dict[int, Tuple[concurrent.futures.Future[Any], _Finish]] = {}
        self.ptr: Optional[C.c_void_p] = None
        self.executor_ident: Optional[int] = None

    def __call__(self, request_id: int, _code: int, _user: Any) -> None:
        self.executor_ident = threading.get_ident()
        with self.lock:
            entry = self.pending.pop(int(request_id), None)
        if entry is None or self.ptr is None:
            return
        future, finish = entry
        try:
            value = finish(self.ptr, int(request_id))
        except BaseException as e:  # the call's error, for the future
            future.set_exception(e)
        else:
            future.set_result(value)

    def cancel_left(self, why: str) -> None:
        """Completes any future still pending (none after a clean destroy)."""
        with self.lock:
            left = list(self.pending.values())
            self.pending.clear()
        for future, _ in left:
            if not future.done():
                future.set_exception(Cancelled(1, why))


def _take_value(ptr: C.c_void_p, request_id: int) -> int:
    value = C.c_uint64(0)
    _lib.call(_lib.lib().kvhost_async_take_value, ptr, request_id, C.byref(value))
    return int(value.value)


class AsyncCalls(Handle):
    """A client's calls, submitted to an executor thread (see the module doc).

    Args:
      client: the kvhost.Client whose calls these are; it must stay open.

    Raises:
      ValueError: the client is closed.
    """

    _DESTROY = "kvhost_async_destroy"

    def __init__(self, client: Any) -> None:
        ptr = C.c_void_p()
        _lib.call(_lib.lib().kvhost_async_create, client._handle(), C.byref(ptr))
        self._state = _Completions()
        self._state.ptr = ptr
        # The ABI holds the callback's address: keep the object alive as long.
        self._callback: Optional[Any] = _lib.ASYNC_CALLBACK(self._state)
        self._submitted = 0
        try:
            _lib.call(_lib.lib().kvhost_async_set_callback, ptr, self._callback, None)
        except BaseException:
            _lib.lib().kvhost_async_destroy(ptr)
            raise
        super().__init__(client, ptr)
        _open.add(self)

    # --- submitting -----------------------------------------------------------

    def _submit(self, fn: Any, args: Tuple[Any, ...],
                finish: _Finish) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # a submitted call cannot be taken back
        request_id = C.c_uint64(0)
        # Held across the submit, so that the callback (which may come
        # before the submit returns) finds the future.
        with self._state.lock:
            _lib.call(fn, self._p(), *args, C.byref(request_id))
            self._state.pending[int(request_id.value)] = (future, finish)
            self._submitted = max(self._submitted, int(request_id.value))
        return future

    def alloc(self, pool: str, num_tokens: int, *,
              numpy: Optional[bool] = None) -> concurrent.futures.Future[Any]:
        """Client.alloc, submitted: a future of the slots' indices (numpy
        int64 when numpy is installed or numpy=True, else a list).

        Raises at once (nothing submitted) ResourceExhausted when
        MAX_REQUESTS calls are pending, ValueError once closed.
        """
        as_numpy = _arrays.want_numpy(numpy)
        n = int(num_tokens)
        if n < 0:
            raise ValueError(f"num_tokens {n} is negative")
        if not isinstance(pool, str):
            raise TypeError(f"pool name must be a str, not {type(pool).__name__}")

        def finish(ptr: C.c_void_p, request_id: int) -> Any:
            out = (C.c_int64 * max(n, 1))()
            count = C.c_size_t(0)
            _lib.call(_lib.lib().kvhost_async_take_indices, ptr, request_id, out, n,
                      C.byref(count))
            return _arrays.int64_result(out, int(count.value), as_numpy)

        name = _lib.text(pool, "pool name")
        return self._submit(_lib.lib().kvhost_async_alloc, (name, n), finish)

    def free(self, pool: str, indices: Any) -> concurrent.futures.Future[Any]:
        """Client.free, submitted: a future of the slots freed. The indices
        are copied before this returns."""
        if not isinstance(pool, str):
            raise TypeError(f"pool name must be a str, not {type(pool).__name__}")
        ptr, n, keep = _arrays.int64_arg(indices)
        name = _lib.text(pool, "pool name")
        future = self._submit(_lib.lib().kvhost_async_free, (name, ptr, n), _take_value)
        del keep
        return future

    def _ticket(self, wait: bool) -> _Finish:
        client = self._client

        def finish(ptr: C.c_void_p, request_id: int) -> Ticket:
            return Ticket(client, _take_value(ptr, request_id), done=wait)

        return finish

    def backup(self, attachment: Any, host_indices: Any, device_indices: Any, *,
               wait: bool = False, timeout: Optional[float] = None,
               event: Any = None) -> concurrent.futures.Future[Any]:
        """Attachment.backup, submitted: a future of its Ticket.

        The future completes once the daemon accepted the backup; with
        wait=True once the transfer finished (its error the future's),
        which holds up every call behind it as long. The indices, the
        attachment's id and the event are copied before this returns.
        """
        host, nh, keep_h = _arrays.int64_arg(host_indices, "host_indices")
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        handle = event_bytes(event)
        flags = _lib.TRANSFER_WAIT if wait else 0
        future = self._submit(_lib.lib().kvhost_async_backup,
                              (attachment._p(), host, nh, dev, nd, handle,
                               0 if handle is None else len(handle), flags, _lib.ms(timeout)),
                              self._ticket(wait))
        del keep_h, keep_d
        return future

    def load(self, attachment: Any, host_indices: Any, device_indices: Any, *,
             wait: bool = False, timeout: Optional[float] = None) -> concurrent.futures.Future[Any]:
        """Attachment.load, submitted: a future of its Ticket; as backup."""
        host, nh, keep_h = _arrays.int64_arg(host_indices, "host_indices")
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        flags = _lib.TRANSFER_WAIT if wait else 0
        future = self._submit(_lib.lib().kvhost_async_load,
                              (attachment._p(), host, nh, dev, nd, flags, _lib.ms(timeout)),
                              self._ticket(wait))
        del keep_h, keep_d
        return future

    # --- progress -----------------------------------------------------------

    @property
    def completed(self) -> int:
        """Calls finished so far (failed and cancelled ones too): the first
        ``completed`` calls submitted are done. 0 once closed."""
        ptr = self._ptr
        return 0 if ptr is None else int(_lib.lib().kvhost_async_completed(ptr))

    @property
    def submitted(self) -> int:
        """Calls submitted so far (refused ones not counted)."""
        return self._submitted

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Waits until every call submitted so far finished; False if
        `timeout` seconds (None: no limit) passed first. Not from a
        future's callback (it runs on the executor, which would wait for
        itself)."""
        with self._state.lock:
            futures: List[concurrent.futures.Future[Any]] = [f for f, _ in
                                                        self._state.pending.values()]
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    # --- lifetime -----------------------------------------------------------

    def close(self, wait: bool = True) -> None:
        """Closes the executor; later submits raise ValueError. Idempotent.

        wait=True first waits for every call submitted so far (unless called
        from one of its futures' callbacks, on the executor, which cannot
        wait for itself); wait=False completes the queued calls with
        Cancelled (the running one finishes).
        """
        if wait and not self.closed and threading.get_ident() != self._state.executor_ident:
            self.drain()
        self._release()

    def _release(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is None or not ptr.value:
            return
        _open.discard(self)
        if threading.get_ident() == self._state.executor_ident:
            # From one of its own future's callbacks: the executor cannot
            # join itself, so another thread destroys the handle.
            threading.Thread(target=self._destroy, args=(ptr,), daemon=True).start()
        else:
            self._destroy(ptr)

    def _destroy(self, ptr: C.c_void_p) -> None:
        # The queued calls complete with CANCELLED through the callback, on
        # the executor, before this returns.
        _lib.lib().kvhost_async_destroy(ptr)
        self._state.ptr = None
        self._state.cancel_left("the kvhost AsyncCalls was closed")
        self._callback = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"AsyncCalls(submitted={self.submitted}, completed={self.completed}, {state})"


#: Every AsyncCalls still open: closed at exit (their queued calls
#: cancelled, not waited for), while Python can still run the callbacks.
_open: "weakref.WeakSet[AsyncCalls]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for calls in list(_open):
        try:
            calls.close(wait=False)
        except Exception:  # exiting anyway
            pass
