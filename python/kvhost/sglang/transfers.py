"""What kvhost.sglang's host pools keep between transfer calls so that
sglang's scheduler thread never waits for a copy (internal).

:class:`SchedulerTransfers`: backup_from_device_all_layer and
load_to_device_per_layer of one host pool or pool group, the one
implementation both use. On the cuda backend (a stream given) a backup
records a ready fence on the stream, submits per layer and makes the stream
wait for its last layer; a load's layer-0 call records a ready fence on the
stream too (so that the copies follow what sglang queued before the load:
its start event, a forward pass still using the destination rows), submits
every layer, and each layer's call makes the stream wait for its layer;
neither waits on the host for a copy, and their tickets are kept. On the host backend (no stream)
both wait on the host, as sglang's CPU events are always complete.

:class:`KeptTickets`: the tickets of backups and loads a pool's calls
returned without waiting for. Each later transfer call polls the oldest
ones (stopping at the first still running, so a call costs one poll in the
common case) and raises a failed one's error, the daemon's, so a failure is
never lost; close() waits for the rest (:meth:`KeptTickets.drain`).

:class:`ReadyFences`: a small ring of ``torch.cuda.Event(interprocess=True)``
and their exported handles, one recorded on the caller's stream per backup
(and per load) as the daemon's ready fence; backups and loads have a ring
each. An event may be recorded again as soon as the call that used it
returned: that call waited (on the host) for a layer of the transfer to be
queued (a backup's last, a load's first), and the daemon's stream wait on
the fence is queued before the first layer, so a later record cannot be
mistaken for the one it waited on.

Thread safety: every method may be called from any thread; a ring's record
and export run under its lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, TypeVar

from ..errors import ResourceExhausted
from ..transfer import Attachment, LoadTicket, Ticket

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
                done = ticket.poll(status=False)
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


def _rows(indices: Any) -> int:
    """How many rows an index list names, for messages."""
    try:
        return len(indices)
    except TypeError:
        return -1


class SchedulerTransfers:
    """One host pool's (or pool group's) transfer calls and what they keep:
    the tickets not waited for (``kept``), the backups' ready fences, and
    the load in progress per attachment."""

    def __init__(self) -> None:
        self.kept = KeptTickets()
        self._lock = threading.Lock()
        self._fences: Optional[ReadyFences] = None  # backups'
        self._load_fences: Optional[ReadyFences] = None
        self._loads: Dict[int, LoadTicket] = {}

    def backup(self, att: Attachment, stream: Any, host: Any, device: Any, *, layers: int,
               torch: Any = None, event: Any = None, pool_transfers: Any = None) -> None:
        """Device rows -> host slots of every layer (module doc). `stream`:
        torch's current stream on the cuda backend, None on the host backend;
        `layers`: the attachment's ticket layers; `event`: the caller's own
        ready fence (an interprocess event recorded after the rows), else
        one of the ring's is recorded on `stream` (`torch` makes the ring)."""
        if stream is None:
            att.backup(host, device, wait=True, event=event, pool_transfers=pool_transfers)
            return
        self.kept.check()
        if event is None:
            with self._lock:
                if self._fences is None:
                    self._fences = ReadyFences(torch)
                fences = self._fences
            event = fences.record(stream)
        ticket = self.kept.retrying(lambda: att.backup(host, device, event=event, per_layer=True,
                                                       pool_transfers=pool_transfers))
        self.kept.keep(f"backup of {_rows(device)} rows (ticket {ticket.id})", ticket)
        ticket.wait_layer(layers - 1, stream)

    def load_layer(self, att: Attachment, stream: Any, layer: int, host: Any, device: Any, *,
                   layers: int, what: str, torch: Any = None, pool_transfers: Any = None,
                   ends: Optional[bool] = None, missing_ok: bool = False) -> None:
        """Layer `layer` of a load (module doc): layer 0 records a ready fence
        on `stream` (cuda backend; `torch` makes the ring) and submits every
        layer, each call waits for its own. The call that `ends` the load (default:
        the last layer's; a pool with packed MTP draft layers ends it at its
        last target layer, sglang's order) also waits for every later layer
        of it. RuntimeError, naming `what` ("pool 'x'"), for a later layer
        with no load of layer 0 pending, unless `missing_ok` (a draft layer
        whose load has ended: it was waited for then)."""
        key = id(att)
        if layer == 0:
            event = None
            if stream is not None:
                self.kept.check()
                with self._lock:
                    if self._load_fences is None:
                        self._load_fences = ReadyFences(torch)
                    fences = self._load_fences
                event = fences.record(stream)
            ticket = self.kept.retrying(lambda: att.load(host, device, per_layer=True,
                                                         pool_transfers=pool_transfers,
                                                         event=event))
            with self._lock:
                self._loads[key] = ticket
        else:
            with self._lock:
                pending = self._loads.get(key)
            if pending is None:
                if missing_ok:
                    return
                raise RuntimeError(f"load_to_device_per_layer: layer {layer} of {what} without "
                                   f"a pending load of layer 0")
            ticket = pending
        ticket.wait_layer(layer, stream)
        if not (layer >= layers - 1 if ends is None else ends):
            return
        if layer < layers - 1:
            ticket.wait_layer(layers - 1, stream)  # the later (draft) layers end it too
        with self._lock:
            if self._loads.get(key) is ticket:
                del self._loads[key]
        if stream is None:
            ticket.wait()  # raises the load's error, and frees its event set
        else:
            self.kept.keep(f"load of {_rows(device)} rows (ticket {ticket.id})", ticket)

    def drain(self) -> Optional[BaseException]:
        """Waits for every transfer not waited for, loads whose last layer
        was never asked for too; the first error, or None."""
        with self._lock:
            loads, self._loads = list(self._loads.values()), {}
            # Every record is consumed once its transfer's first layer is queued.
            self._fences = self._load_fences = None
        for ticket in loads:
            self.kept.keep(f"load (ticket {ticket.id}) left before its last layer", ticket)
        return self.kept.drain()
