"""Attachments and transfers: the worker's calls.

A worker attaches its device KV buffers to a pool (:class:`AttachCalls`,
mixed into :class:`kvhost.Client`) and gets an :class:`Attachment`. Through
it, ``backup`` copies device rows to host slots and ``load`` host slots to
device rows; each returns a :class:`Ticket` to wait for or poll. A load
with ``per_layer=True`` returns a :class:`LoadTicket` whose
``wait_layer(l, stream)`` lets layer ``l``'s compute start while later
layers still arrive; a backup with ``per_layer=True`` (an attachment with
``layer_progress``) returns one too, whose ``wait_layer(last, stream)``
makes a stream wait for the whole backup without the host waiting for it.

Device indices are rows of the attached buffers (tokens; pages for a
row-per-page component); host indices are the pool's slots from alloc.

A pool group (a hybrid model's pools, e.g. MHA + MAMBA) attaches with one
device pool per entry (``attach_group_shm``; on CUDA ``attach_group_cuda``
or ``attach_group_tensors``). Its transfers take the anchor
entry's rows as the plain ones and the other entries' as ``pool_transfers``:
``{entry: (host_slots, device_rows)}``.

CUDA handles travel as ints (``cudaStream_t``, ``cudaEvent_t``). A stream
may be given as an int, as anything with ``.cuda_stream`` (torch.cuda.Stream)
or ``.ptr`` (cupy), or None (the legacy default stream). The worker's event
before a backup may be the 64 handle bytes, a ``torch.cuda.Event(
interprocess=True)`` (its ``ipc_handle()``), or a ``cudaEvent_t`` int
(exported with :func:`kvhost.cuda_export_event`); kvhost/_streams.py
turns each into what the ABI takes.

Ownership: an Attachment keeps its client and device buffers referenced;
``close()`` frees the handle, ``detach()`` ends the attachment on the
daemon, and leaving its ``with`` block does both.
"""

from __future__ import annotations

import ctypes as C
import json
import time
from typing import (Any, Dict, List, Literal, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union, overload)

from . import _arrays, _json, _lib
from ._handles import Handle
from ._streams import event_bytes, stream_arg
from .errors import DeadlineExceeded, KvhostError, NotFound
from .worker import open_copier

#: Room for a TransferStatus; a bigger one costs one retry of the same read.
_STATUS_GUESS = 4096
#: Ticket.wait's default, the ABI's own (kvhost_transfer_wait with 0).
_DEFAULT_WAIT_S = 600.0
#: Ticket.wait asks the daemon this long at a time, so that a signal
#: (Ctrl-C) is served within it; each slice is one cheap WaitTransfer RPC.
_WAIT_SLICE_S = 1.0


#: backup / load's pool_transfers: entry name -> (host slots, device rows).
PoolTransfers = Mapping[str, Tuple[Any, Any]]


class _PoolTransferArgs:
    """pool_transfers as a kvhost_pool_transfer array, and what keeps the
    arrays it points to alive until the call returned."""

    def __init__(self, pool_transfers: PoolTransfers) -> None:
        self._keep: List[Any] = []
        items = list(pool_transfers.items())
        self.array = (_lib.PoolTransferStruct * max(len(items), 1))()
        self.count = len(items)
        for i, (entry, rows) in enumerate(items):
            if not isinstance(entry, str):
                raise TypeError(f"pool_transfers keys must be entry names (str), not "
                                f"{type(entry).__name__}")
            if not isinstance(rows, (tuple, list)) or len(rows) != 2:
                raise TypeError(f"pool_transfers[{entry!r}] must be (host_indices, "
                                f"device_indices)")
            host, nh, keep_h = _arrays.int64_arg(rows[0], f"pool_transfers[{entry!r}] host")
            dev, nd, keep_d = _arrays.int64_arg(rows[1], f"pool_transfers[{entry!r}] device")
            name = _lib.text(entry, "pool_transfers entry name")
            self._keep += [name, keep_h, keep_d]
            self.array[i] = _lib.PoolTransferStruct(name, host, nh, dev, nd)


class CudaGroupEntry(NamedTuple):
    """One pool group entry's CUDA buffers, for attach_group_cuda.

    ``layers`` maps each component name of the entry's pool ("k", "v",
    "temporal", "conv0", ...) to its per-layer device pointers, in layer
    order, every component the same number of layers; an entry whose pool
    has no components (LOGICAL) gives ``{}``. Each buffer holds
    ``device_size_tokens`` rows (row-per-page components: / page_size).
    ``layer_bytes`` (optional) gives each component's buffer size, checked
    against the pool before anything is exported. The layers are device
    layers [start_layer, end_layer) of the entry's pool (0 / 0: the pool's
    own range), covering every layer its layer_map names.
    """

    layers: Mapping[str, Sequence[int]]
    device_size_tokens: int
    layer_bytes: Optional[Mapping[str, int]] = None
    start_layer: int = 0
    end_layer: int = 0


class _ComponentArrays:
    """attach_cuda's per-component pointers as the ABI's arrays (names,
    pointers component-major, optional sizes), kept alive with this object."""

    def __init__(self, layers: Mapping[str, Sequence[int]],
                 layer_bytes: Optional[Mapping[str, int]], what: str) -> None:
        names = list(layers)
        counts = {len(layers[n]) for n in names}
        if len(counts) > 1:
            raise ValueError(f"{what}every component needs the same number of layers, got " +
                             ", ".join(f"{n}: {len(layers[n])}" for n in names))
        self.count = len(names)
        self.num_layers = counts.pop() if counts else 0
        self.names = (C.c_char_p * max(len(names), 1))(
            *[_lib.text(n, "component name") for n in names])
        self.ptrs = _arrays.pointer_list([p for n in names for p in layers[n]] or [0])
        self.sizes = None
        if layer_bytes is not None:
            missing = [n for n in names if n not in layer_bytes]
            if missing:
                raise ValueError(f"{what}layer_bytes lacks component(s) {', '.join(missing)}")
            self.sizes = (C.c_uint64 * max(len(names), 1))(
                *[int(layer_bytes[n]) for n in names])


def _options_json(**options: Any) -> Optional[bytes]:
    """An attach's kvhost.v1.AttachDeviceRequest fields, the ones given."""
    given = {k: v for k, v in options.items() if v is not None}
    return json.dumps(given).encode() if given else None


class Ticket:
    """A transfer the daemon runs: wait() for it, or poll().

    ``status`` is the last kvhost.v1.TransferStatus seen (a dict), None
    before the first wait or poll that finished.
    """

    def __init__(self, client: Any, ticket_id: int, done: bool = False) -> None:
        self._client = client
        #: The daemon's ticket id.
        self.id = int(ticket_id)
        self.status: Optional[Dict[str, Any]] = None
        self._done = done

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Blocks until the transfer is done; its TransferStatus.

        Raises the transfer's error if it failed, DeadlineExceeded after
        `timeout` seconds (None: 10 min; 0: only a look). Waits in slices of a second so
        that Ctrl-C (KeyboardInterrupt) is served while it waits.
        """
        total = _DEFAULT_WAIT_S if timeout is None else float(timeout)
        deadline = time.monotonic() + total
        while True:
            left = deadline - time.monotonic()
            try:
                text = _lib.call_out(_lib.lib().kvhost_transfer_wait, self._client._handle(),
                                     self.id, _lib.ms(max(min(left, _WAIT_SLICE_S), 0.001)),
                                     guess=_STATUS_GUESS)
            except DeadlineExceeded:
                # The slice ran out, or the transfer itself failed so: poll
                # tells them apart (it raises the transfer's own error).
                if self.poll():
                    assert self.status is not None
                    return self.status
                if left <= _WAIT_SLICE_S:
                    raise
                continue
            self.status, self._done = _json.loads(text), True
            return self.status

    def poll(self, status: bool = True) -> bool:
        """True once the transfer finished; raises its error if it failed.

        status=False leaves ``status`` as it is (None, as for a ticket made
        done by a waiting call) and skips rendering the daemon's
        TransferStatus as JSON, which costs more than the poll
        itself: for a caller that only needs to know (the sglang pools'
        per-call check of the transfers they did not wait for).
        """
        if self._done:
            return True
        done = C.c_int32(0)
        if not status:
            _lib.call(_lib.lib().kvhost_transfer_poll, self._client._handle(), self.id,
                      C.byref(done), None, 0, None)
            self._done = bool(done.value)
            return self._done
        text = _lib.call_out(_lib.lib().kvhost_transfer_poll, self._client._handle(), self.id,
                             C.byref(done), guess=_STATUS_GUESS)
        if done.value:
            self.status, self._done = _json.loads(text), True
        return self._done

    @property
    def done(self) -> bool:
        """poll() as a property."""
        return self.poll()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id}, done={self._done})"


class LoadTicket(Ticket):
    """A transfer with per-layer waits: Attachment.load(per_layer=True), or
    Attachment.backup(per_layer=True), whose last layer is the whole backup."""

    def __init__(self, client: Any, events: "LoadEvents", raw: _lib.LoadTicketStruct) -> None:
        super().__init__(client, raw.ticket_id)
        self._events = events
        self._raw = raw
        #: The attachment's event set this load records into; -1: none.
        self.event_set = int(raw.event_set)
        #: The pool layer of the attachment's first layer.
        self.layer_base = int(raw.layer_base)

    def wait_layer(self, layer: int, stream: Any = None,
                   timeout: Optional[float] = None) -> None:
        """Layer `layer` (of the attachment) of this transfer.

        Waits on the host until the transfer recorded it, i.e. the daemon
        queued that layer's copies (DeadlineExceeded after `timeout` s;
        None: 10 s), then, on the cuda backend, makes `stream` wait for the
        layer's event, which completes after its copies (torch:
        torch.cuda.current_stream()). At once for event_set -1.
        """
        _lib.call(_lib.lib().kvhost_wait_layer, self._events._p(), C.byref(self._raw),
                  int(layer), stream_arg(stream), _lib.ms(timeout))


class LoadEvents(Handle):
    """What an attachment's loads are waited on per layer (internal)."""

    _DESTROY = "kvhost_load_events_destroy"


class Attachment(Handle):
    """A worker's device buffers attached to a pool.

    ``id`` is the daemon's attachment id (a capability: show it to no one
    else), ``pool`` the pool's name (a group's: its anchor pool), ``group``
    the pool group's name ("" for a plain pool), ``info`` the
    kvhost.v1.Attachment.
    Garbage collection frees only the handle, as close() does; detach() or
    leaving a ``with`` block ends the attachment on the daemon (a worker
    session's end does too).
    """

    _DESTROY = "kvhost_attachment_destroy"

    def __init__(self, client: Any, ptr: C.c_void_p, pool: str, device: Any) -> None:
        super().__init__(client, ptr)
        self.pool = pool
        # The buffers must outlive the attachment: an ShmDevicePool, or the
        # caller's tensors when made by attach_tensors.
        self._device = device
        self._events: Optional[LoadEvents] = None
        self.detached = False
        lib = _lib.lib()
        self.id = _lib.call_out(lib.kvhost_attachment_id, ptr, guess=128)
        self.info: Dict[str, Any] = _json.loads(_lib.call_out(lib.kvhost_attachment_json, ptr))
        self.group: str = self.info.get("group", "")

    def _client_handle(self) -> C.c_void_p:
        assert self._client is not None
        return self._client._handle()

    @overload
    def backup(self, host_indices: Any, device_indices: Any, *, wait: bool = ...,
               timeout: Optional[float] = ..., event: Any = ...,
               pool_transfers: Optional[PoolTransfers] = ...,
               per_layer: Literal[True]) -> LoadTicket: ...

    @overload
    def backup(self, host_indices: Any, device_indices: Any, *, wait: bool = ...,
               timeout: Optional[float] = ..., event: Any = ...,
               pool_transfers: Optional[PoolTransfers] = ...,
               per_layer: bool = ...) -> Ticket: ...

    def backup(self, host_indices: Any, device_indices: Any, *, wait: bool = False,
               timeout: Optional[float] = None, event: Any = None,
               pool_transfers: Optional[PoolTransfers] = None,
               per_layer: bool = False) -> Ticket:
        """Device rows -> host slots.

        `event` (cuda backend): the worker's interprocess event, recorded
        after the rows were written; the copies wait for it (keep it alive
        until the ticket is done). The host backend refuses one
        (FailedPrecondition). With wait=True, returns once done (its error
        raised), waiting up to `timeout` s (None: 10 min).

        per_layer=True returns a LoadTicket (not with wait=True): on an
        attachment with layer_progress the backup takes an event set as a
        load does (ResourceExhausted while every set is busy), and
        ``wait_layer(last attached layer, stream)`` makes `stream` wait
        until every copy is done (cuda backend) without waiting on the host
        for them; its event_set is -1 without layer_progress (the attachment
        needs what load(per_layer=True) needs: on the host backend,
        layer_progress).

        A group attachment: host_indices / device_indices are the anchor
        entry's rows (either may be empty) and `pool_transfers` the other
        entries', ``{entry: (host_slots, device_rows)}``. All are checked
        before anything is copied: an entry the group lacks, or the anchor
        named there, is InvalidArgument naming it.
        """
        host, nh, keep_h = _arrays.int64_arg(host_indices, "host_indices")
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        handle = event_bytes(event)
        if per_layer:
            if wait:
                raise ValueError("per_layer=True returns at once; wait on its last layer or "
                                 "its ticket")
            events = self.load_events()
            raw = _lib.LoadTicketStruct()
            lib, client = _lib.lib(), self._client_handle()
            nbytes = 0 if handle is None else len(handle)
            if pool_transfers is not None:
                pt = _PoolTransferArgs(pool_transfers)
                _lib.call(lib.kvhost_backup_group_with_events, client, self._p(), host, nh, dev,
                          nd, pt.array, pt.count, handle, nbytes, C.byref(raw))
                del pt
            else:
                _lib.call(lib.kvhost_backup_with_events, client, self._p(), host, nh, dev, nd,
                          handle, nbytes, C.byref(raw))
            del keep_h, keep_d
            return LoadTicket(self._client, events, raw)
        ticket = C.c_uint64(0)
        flags = _lib.TRANSFER_WAIT if wait else 0
        if pool_transfers is not None:
            pt = _PoolTransferArgs(pool_transfers)
            _lib.call(_lib.lib().kvhost_backup_group, self._client_handle(), self._p(), host, nh,
                      dev, nd, pt.array, pt.count, handle, 0 if handle is None else len(handle),
                      flags, _lib.ms(timeout), C.byref(ticket))
            del pt
        else:
            _lib.call(_lib.lib().kvhost_backup, self._client_handle(), self._p(), host, nh, dev,
                      nd, handle, 0 if handle is None else len(handle), flags, _lib.ms(timeout),
                      C.byref(ticket))
        del keep_h, keep_d
        return Ticket(self._client, ticket.value, done=wait)

    def alloc_backup(self, device_indices: Any, *, wait: bool = False,
                     timeout: Optional[float] = None, event: Any = None,
                     numpy: Optional[bool] = None) -> Tuple[Any, Ticket]:
        """Allocates host slots of the attachment's pool and backs the device
        rows up into them, in one call: returns (host slots, ticket).

        A plain pool's attachment (a group's: alloc, then backup with
        pool_transfers). len(device_indices) must be whole pages. A refused
        backup leaves nothing allocated; `event`, `wait` and `timeout` are
        backup's. With wait=True a failed or timed-out transfer raises, its
        slots still allocated and on the error as `host_indices` (free them
        once the ticket is done).
        """
        as_numpy = _arrays.want_numpy(numpy)
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        handle = event_bytes(event)
        out = (C.c_int64 * max(nd, 1))()
        count = C.c_size_t(0)
        ticket = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_alloc_backup, self._client_handle(), self._p(), dev, nd, out,
                  nd, C.byref(count), handle, 0 if handle is None else len(handle), 0,
                  _lib.ms(timeout), C.byref(ticket))
        del keep_d
        host = _arrays.int64_result(out, int(count.value), as_numpy)
        done = Ticket(self._client, ticket.value)
        if wait:
            try:
                done.wait(timeout)
            except KvhostError as e:
                e.host_indices = host  # type: ignore[attr-defined]
                raise
        return host, done

    @overload
    def load(self, host_indices: Any, device_indices: Any, *, wait: bool = ...,
             timeout: Optional[float] = ..., per_layer: Literal[True],
             pool_transfers: Optional[PoolTransfers] = ..., event: Any = ...) -> LoadTicket: ...

    @overload
    def load(self, host_indices: Any, device_indices: Any, *, wait: bool = ...,
             timeout: Optional[float] = ..., per_layer: bool = ...,
             pool_transfers: Optional[PoolTransfers] = ..., event: Any = ...) -> Ticket: ...

    def load(self, host_indices: Any, device_indices: Any, *, wait: bool = False,
             timeout: Optional[float] = None, per_layer: bool = False,
             pool_transfers: Optional[PoolTransfers] = None, event: Any = None) -> Ticket:
        """Host slots -> device rows.

        per_layer=True returns a LoadTicket to wait on layer by layer (the
        attachment needs layer_progress=True on the host backend; on the cuda
        backend its load events); it cannot be combined with wait=True.
        ResourceExhausted while every event set of the attachment is busy.
        `pool_transfers`: a group attachment's other entries, as backup's.
        `event` (cuda backend, with per_layer=True): the worker's
        interprocess event, recorded on its stream after the work the load
        must follow (a forward pass still using the destination rows); the
        copies wait for that record first (keep the event alive until the
        ticket is done). The host backend refuses one (FailedPrecondition).
        """
        host, nh, keep_h = _arrays.int64_arg(host_indices, "host_indices")
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        lib, client = _lib.lib(), self._client_handle()
        pt = None if pool_transfers is None else _PoolTransferArgs(pool_transfers)
        if per_layer:
            if wait:
                raise ValueError("per_layer=True returns at once; wait on its layers or ticket")
            events = self.load_events()
            raw = _lib.LoadTicketStruct()
            handle = event_bytes(event)
            if handle is not None:
                _lib.call(lib.kvhost_load_group_with_events_after, client, self._p(), host, nh,
                          dev, nd, None if pt is None else pt.array, 0 if pt is None else pt.count,
                          handle, len(handle), C.byref(raw))
            elif pt is not None:
                _lib.call(lib.kvhost_load_group_with_events, client, self._p(), host, nh, dev, nd,
                          pt.array, pt.count, C.byref(raw))
            else:
                _lib.call(lib.kvhost_load_with_events, client, self._p(), host, nh, dev, nd,
                          C.byref(raw))
            del keep_h, keep_d, pt
            return LoadTicket(self._client, events, raw)
        if event is not None:
            raise ValueError("event needs per_layer=True (a load that waits for the worker's "
                             "event returns at once, to be waited on per layer)")
        ticket = C.c_uint64(0)
        flags = _lib.TRANSFER_WAIT if wait else 0
        if pt is not None:
            _lib.call(lib.kvhost_load_group, client, self._p(), host, nh, dev, nd, pt.array,
                      pt.count, flags, _lib.ms(timeout), C.byref(ticket))
        else:
            _lib.call(lib.kvhost_load, client, self._p(), host, nh, dev, nd, flags,
                      _lib.ms(timeout), C.byref(ticket))
        del keep_h, keep_d, pt
        return Ticket(self._client, ticket.value, done=wait)

    def load_events(self) -> LoadEvents:
        """Opens (once) what this attachment's loads are waited on per layer.

        FailedPrecondition for an attachment that has neither load events nor
        layer counters (attach with layer_progress=True). On CUDA the current
        device must be the attachment's GPU.
        """
        if self._events is None or self._events.closed:
            ptr = C.c_void_p()
            _lib.call(_lib.lib().kvhost_load_events_open, self._client_handle(), self._p(),
                      C.byref(ptr))
            self._events = LoadEvents(self._client, ptr)
        return self._events

    #: Regions one pool map may carry (kvhostd's kMaxWorkerCopyRegions).
    MAX_REGIONS = 16

    def pool_map(self) -> List[Tuple[int, int]]:
        """The attached pool's regions for this process's own mapping:
        ``[(fd, bytes), ...]`` in region order, new read-write descriptors
        the caller owns (map each MAP_SHARED, whole, then close it), fetched
        over kvhostd's handoff socket with this client's session and token
        (HANDOFF_KIND_POOL_MAP; never a path). The pool stays held for the
        attachment's session until it ends. FailedPrecondition for an
        attachment made without a session or of a pool group.
        """
        fds = (C.c_int * self.MAX_REGIONS)()
        sizes = (C.c_uint64 * self.MAX_REGIONS)()
        count = C.c_size_t()
        _lib.call(_lib.lib().kvhost_pool_map_open, self._client_handle(), self._p(), fds, sizes,
                  self.MAX_REGIONS, C.byref(count))
        return [(int(fds[i]), int(sizes[i])) for i in range(count.value)]

    def worker_copier(self, blocks: int = 0) -> Any:
        """A WorkerCopier on this attachment (CUDA; see kvhost.worker)."""
        return open_copier(self, blocks)

    def detach(self) -> None:
        """Ends the attachment on the daemon; the handle stays until close().

        NotFound when the daemon no longer knows it (detached already, or
        lost with a daemon restart).
        """
        _lib.call(_lib.lib().kvhost_detach, self._client_handle(), self._p())
        self.detached = True

    def _release(self) -> None:
        if self._events is not None:
            self._events._release()
        super()._release()

    def __exit__(self, *exc: Any) -> None:
        """Detaches (one already gone is fine) and frees the handle."""
        try:
            client = self._client
            if not self.detached and not self.closed and not (client is None or client.closed):
                try:
                    self.detach()
                except NotFound:
                    pass  # gone already (a restart took it): the goal holds
                except Exception:
                    if exc[0] is None:
                        raise
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"Attachment(pool={self.pool!r}, {'closed' if self.closed else 'open'})"


class AttachCalls:
    """Device pools and attach calls of a Client (mixed in)."""

    def _handle(self) -> C.c_void_p:  # provided by Client
        raise NotImplementedError

    def shm_device_pool(self, pool: str, device_size_tokens: int, shm_dir: Optional[str] = None,
                        start_layer: int = 0, end_layer: int = 0) -> Any:
        """A shared-memory device pool shaped after `pool` (host backend).

        `device_size_tokens` rows per buffer (row-per-page components: /
        page_size); `shm_dir` must be the daemon's --shm-dir (None: the one
        its status reports); layers [start_layer, end_layer), 0 / 0 for the
        pool's.
        Returns a kvhost.shm.ShmDevicePool (a context manager).
        """
        from . import shm  # noqa: PLC0415
        return shm.create(self, pool, device_size_tokens, shm_dir, start_layer, end_layer)

    def attach_shm(self, pool: str, device: Any, *, layer_progress: Optional[bool] = None,
                   load_only: Optional[bool] = None, tp_rank: Optional[int] = None,
                   load_event_sets: Optional[int] = None) -> Attachment:
        """Attaches a ShmDevicePool to `pool` (host backend).

        layer_progress=True makes per-layer waits of loads possible.
        """
        options = _options_json(layer_progress=layer_progress, load_only=load_only,
                                tp_rank=tp_rank, load_event_sets=load_event_sets)
        ptr = C.c_void_p()
        _lib.call(_lib.lib().kvhost_attach_shm, self._handle(), _lib.text(pool, "pool name"),
                  device._p(), options, C.byref(ptr))
        return Attachment(self, ptr, pool, device)

    def attach_group_shm(self, group: str, devices: Mapping[str, Any], *,
                         layer_progress: Optional[bool] = None,
                         load_only: Optional[bool] = None, tp_rank: Optional[int] = None,
                         load_event_sets: Optional[int] = None) -> Attachment:
        """Attaches pool group `group` with one ShmDevicePool per entry (host
        backend): ``{entry: device}``, each device made by shm_device_pool
        from that entry's pool and holding every device layer its layer_map
        names. Every entry of the group is given once.

        NotFound for an unknown group; InvalidArgument naming an entry the
        group lacks or one left out. Back up and load the attachment with
        ``pool_transfers``. Options as attach_shm's.
        """
        items = list(devices.items())
        if not items:
            raise ValueError("devices needs at least one entry")
        names = (C.c_char_p * len(items))(*[_lib.text(entry, "entry name") for entry, _ in items])
        ptrs = (C.c_void_p * len(items))(*[device._p() for _, device in items])
        options = _options_json(layer_progress=layer_progress, load_only=load_only,
                                tp_rank=tp_rank, load_event_sets=load_event_sets)
        ptr = C.c_void_p()
        _lib.call(_lib.lib().kvhost_attach_group_shm, self._handle(),
                  _lib.text(group, "group name"), len(items), names, ptrs, options, C.byref(ptr))
        att = Attachment(self, ptr, group, dict(devices))
        att.pool = att.info.get("pool", group)
        return att

    def attach_cuda(self, pool: str, layers: Mapping[str, Sequence[int]],
                    device_size_tokens: int, *,
                    layer_bytes: Optional[Mapping[str, int]] = None,
                    start_layer: Optional[int] = None, end_layer: Optional[int] = None,
                    layer_progress: Optional[bool] = None, load_only: Optional[bool] = None,
                    tp_rank: Optional[int] = None, load_event_sets: Optional[int] = None,
                    keep_alive: Any = None) -> Attachment:
        """Attaches a worker's CUDA buffers to `pool` (cuda backend).

        `layers` maps each component name of the pool ("k", "v", ...) to its
        per-layer device pointers, in layer order, every component the same
        number of layers. Each buffer holds `device_size_tokens` rows
        (row-per-page components: / page_size). `layer_bytes` (optional)
        gives each component's buffer size; one too small for its rows is
        InvalidArgument before anything is exported. `keep_alive` is held by
        the attachment (the tensors behind the pointers, say).
        Unimplemented in a library built without CUDA, FailedPrecondition
        without a usable GPU.
        """
        if not layers:
            raise ValueError("layers needs at least one component")
        arrays = _ComponentArrays(layers, layer_bytes, "")
        options = _options_json(layer_progress=layer_progress, load_only=load_only,
                                tp_rank=tp_rank, load_event_sets=load_event_sets,
                                start_layer=start_layer, end_layer=end_layer)
        ptr = C.c_void_p()
        _lib.call(_lib.lib().kvhost_attach_cuda, self._handle(), _lib.text(pool, "pool name"),
                  arrays.count, arrays.names, arrays.num_layers, arrays.ptrs, arrays.sizes,
                  int(device_size_tokens), options, C.byref(ptr))
        del arrays
        return Attachment(self, ptr, pool, keep_alive)

    def attach_group_cuda(self, group: str,
                          entries: Mapping[str, Union[CudaGroupEntry, Mapping[str, Any]]], *,
                          layer_progress: Optional[bool] = None,
                          load_only: Optional[bool] = None, tp_rank: Optional[int] = None,
                          load_event_sets: Optional[int] = None,
                          keep_alive: Any = None) -> Attachment:
        """Attaches pool group `group` with a worker's CUDA buffers (cuda
        backend): ``{entry: CudaGroupEntry(...)}`` (or a dict of its fields),
        every entry of the group once, every buffer on one GPU.

        Where an entry gives layer_bytes, its sizes are checked against its
        pool before anything is exported (InvalidArgument naming the entry
        and component). NotFound for an unknown group; InvalidArgument naming
        an entry the group lacks or one left out. Back up and load the
        attachment with ``pool_transfers``. `keep_alive` is held by the
        attachment. Unimplemented in a library built without CUDA,
        FailedPrecondition without a usable GPU.
        """
        items = list(entries.items())
        if not items:
            raise ValueError("entries needs at least one entry")
        keep: List[Any] = []
        structs = (_lib.CudaGroupEntryStruct * len(items))()
        for i, (name, given) in enumerate(items):
            if not isinstance(name, str):
                raise TypeError(f"entries keys must be entry names (str), not "
                                f"{type(name).__name__}")
            entry = given if isinstance(given, CudaGroupEntry) else CudaGroupEntry(**given)
            arrays = _ComponentArrays(entry.layers, entry.layer_bytes, f"entry '{name}': ")
            encoded = _lib.text(name, "entry name")
            keep += [arrays, encoded]
            structs[i] = _lib.CudaGroupEntryStruct(
                encoded, arrays.count, arrays.names, arrays.ptrs, arrays.sizes,
                int(entry.device_size_tokens), arrays.num_layers, int(entry.start_layer),
                int(entry.end_layer), 0)
        options = _options_json(layer_progress=layer_progress, load_only=load_only,
                                tp_rank=tp_rank, load_event_sets=load_event_sets)
        ptr = C.c_void_p()
        _lib.call(_lib.lib().kvhost_attach_group_cuda, self._handle(),
                  _lib.text(group, "group name"), len(items), structs, options, C.byref(ptr))
        del keep
        att = Attachment(self, ptr, group, keep_alive)
        att.pool = att.info.get("pool", group)
        return att
