"""What kvhost.sglang's host pools keep between transfer calls so that
sglang's scheduler thread never waits for a copy (internal).

:class:`KeptTickets`: the tickets of backups and loads a pool's calls
returned without waiting for. Each later transfer call polls the oldest
ones (stopping at the first still running, so a call costs one poll in the
common case) and raises a failed one's error, the daemon's, so a failure is
never lost; close() waits for the rest (:meth:`KeptTickets.drain`).

:class:`ReadyFences`: a small ring of ``torch.cuda.Event(interprocess=True)``
and their exported handles, one recorded on the caller's stream per backup
as the daemon's ready fence. An event may be recorded again as soon as the
backup that used it returned: that call waited (on the host) for the
backup's last layer to be queued, and the daemon's stream wait on the fence
is queued before the first layer, so a later record cannot be mistaken for
the one it waited on.

Thread safety: every method may be called from any thread; a ring's record
and export run under its lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, List, Optional, Tuple, TypeVar

from .errors import ResourceExhausted
from .transfer import Ticket

T = TypeVar("T")

#: Events in a pool's ready-fence ring. Each backup call re-arms an event
#: only after the daemon has queued its wait on the previous record (see the
#: module doc), so one would do; a few spare ones cost nothing.
READY_FENCES = 4


class KeptTickets:
    """Tickets returned without a wait, oldest first, each with what it was
    ("backup of 4096 rows") for the error message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: Deque[Tuple[str, Ticket]] = collections.deque()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def keep(self, what: str, ticket: Ticket) -> None:
        """Holds `ticket` until a later check() or drain() sees it done."""
        with self._lock:
            self._kept.append((what, ticket))

    def check(self) -> None:
        """Drops the oldest tickets that finished, up to the first still in
        flight; raises the first failed one's error (the daemon's), which is
        then forgotten: the next call goes on with the others."""
        while True:
            with self._lock:
                if not self._kept:
                    return
                what, ticket = self._kept[0]
            try:
                done = ticket.poll()
            except Exception as e:
                self._forget(ticket)
                _annotate(e, what)
                raise
            if not done:
                return
            self._forget(ticket)

    def wait_oldest(self) -> bool:
        """Waits for the oldest kept ticket (raising its error); False when
        none is kept."""
        with self._lock:
            if not self._kept:
                return False
            what, ticket = self._kept.popleft()
        try:
            ticket.wait()
        except Exception as e:
            _annotate(e, what)
            raise
        return True

    def drain(self) -> Optional[BaseException]:
        """Waits for every kept ticket; the first error (the others are
        waited for all the same), or None."""
        first: Optional[BaseException] = None
        while True:
            try:
                if not self.wait_oldest():
                    return first
            except Exception as e:  # the rest must still be waited for
                first = first or e

    def retrying(self, submit: Callable[[], T]) -> T:
        """submit(); when every event set of the attachment is taken by kept
        transfers (ResourceExhausted), waits for the oldest and tries once
        more."""
        try:
            return submit()
        except ResourceExhausted:
            if not self.wait_oldest():
                raise
        return submit()

    def _forget(self, ticket: Ticket) -> None:
        with self._lock:
            self._kept = collections.deque((w, t) for w, t in self._kept if t is not ticket)


def _annotate(error: BaseException, what: str) -> None:
    """Says which earlier call's transfer failed (the daemon's error is
    raised by a later call)."""
    note = f"kvhost: raised by a later call: the {what} failed"
    if hasattr(error, "add_note"):
        error.add_note(note)


class ReadyFences:
    """A ring of interprocess CUDA events of one device and their handles."""

    def __init__(self, torch: Any, size: int = READY_FENCES) -> None:
        self._torch = torch
        self._lock = threading.Lock()
        self._events: List[Any] = []
        self._handles: List[bytes] = []
        self._size = int(size)
        self._next = 0

    def record(self, stream: Any) -> bytes:
        """Records the ring's next event on `stream`; its handle bytes, for
        BackupRequest.wait_event_handle."""
        with self._lock:
            i = self._next
            self._next = (i + 1) % self._size
            if i == len(self._events):
                event = self._torch.cuda.Event(enable_timing=False, blocking=False,
                                               interprocess=True)
                event.record(stream)
                self._events.append(event)
                self._handles.append(bytes(event.ipc_handle()))
            else:
                self._events[i].record(stream)
            return self._handles[i]
