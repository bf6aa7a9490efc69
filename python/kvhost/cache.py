"""The node cache from Python (kvhost.v1.CacheService): a pool created with
``node_cache`` whose pages are addressed by key (an engine's block hashes),
shared by every engine instance on the node that presents the cache's owner
token, and outliving them.

``client.node_cache(name)`` (:class:`CacheCalls`, mixed into
:class:`kvhost.Client`) gives a :class:`NodeCache` bound to one cache. Keys
are bytes or str (UTF-8), 1 to 256 bytes each, at most 4096 a call. A
stored page is a backup of ``page_size`` device rows per key of an
:class:`~kvhost.Attachment` of the cache's pool (key i's rows are
``device_indices[i * page_size:(i + 1) * page_size]``), a restore a load of
them; wait for either's :class:`~kvhost.Ticket`. ``store``, ``restore`` and
``lookup(pin=True)`` need a client with a worker session (``session=True``),
whose end releases their pins and drops their stores in flight.

Per-key states and evict outcomes are results, not exceptions. Errors are
the daemon's: InvalidArgument for a bad key, key count or row count (naming
it), FailedPrecondition for a restore of a key not present (naming it), a
pool that is not a node cache, or a call that needs a worker session,
NotFound for an unknown cache or pin, PermissionDenied without the cache's
owner token. A refused call changes nothing.
"""

from __future__ import annotations

import ctypes as C
import enum
from dataclasses import dataclass, fields
from typing import Any, List, NamedTuple, Optional, Sequence

from . import _arrays, _lib
from ._arrays import Key
from ._streams import event_bytes
from .transfer import LoadTicket, Ticket


class KeyState(enum.IntEnum):
    """A key's state (kvhost.v1.CacheKeyState, KVHOST_CACHE_*)."""

    ABSENT = 0
    #: Published: its page holds all its bytes.
    PRESENT = 1
    #: A store is writing it: not readable yet (a store skips it too).
    PENDING = 2


class EvictOutcome(enum.IntEnum):
    """What an evict did to one key (kvhost.v1.CacheEvictReply.Outcome)."""

    EVICTED = 0
    ABSENT = 1
    #: Pinned or being written: kept.
    BUSY = 2


class EventKind(enum.IntEnum):
    """kvhost.v1.CacheEvent.Kind."""

    STORED = 0
    EVICTED = 1


class LookupResult(NamedTuple):
    """Which keys are present."""

    #: Keys present from the first on.
    prefix: int
    #: One per key, in the order given.
    states: List[KeyState]
    #: With pin=True and a non-empty prefix: the pin, for release_pin (else 0).
    pin_id: int


class StoreResult(NamedTuple):
    """What a store writes and skips."""

    #: Per key: ABSENT for a key this store writes, PRESENT (stored already)
    #: or PENDING (another store writes it) for one it skips.
    states: List[KeyState]
    #: The backup of the written keys, published when it ends well; None
    #: when every key was skipped.
    ticket: Optional[Ticket]
    #: Published pages evicted to make room.
    evicted: int


@dataclass(frozen=True)
class CacheStats:
    """kvhost.v1.CacheStats: keys now, and counts since the pool was created."""

    page_num: int
    free_pages: int
    published: int
    writing: int
    pinned: int
    hits: int
    misses: int
    stored: int
    skipped: int
    evicted: int
    aborted: int
    #: Keys the L3 tier behind the cache took (write-through), gave
    #: (fetch_missing) and did not have.
    l3_written: int = 0
    l3_fetched: int = 0
    l3_missed: int = 0


class CacheEvent(NamedTuple):
    """A key stored or evicted."""

    seq: int
    kind: EventKind
    key: bytes


class CacheEventBatch(NamedTuple):
    """One read of the cache's events."""

    #: Oldest first.
    events: List[CacheEvent]
    #: The after_seq of the next read.
    next_after: int
    #: Events after the asked sequence number were dropped before this read
    #: (the reader fell behind, or kvhostd restarted): resynchronise from a
    #: full lookup of what the reader tracks.
    gap: bool


class NodeCache:
    """One node cache (a pool made with ``node_cache``) of a client.

    Made by :meth:`kvhost.Client.node_cache`; holds no handle of its own, so
    it needs no closing (the client must stay open).
    """

    #: Keys a call may name (KVHOST_CACHE_MAX_KEYS).
    MAX_KEYS = 4096
    #: Bytes of a key at most (KVHOST_CACHE_MAX_KEY_BYTES).
    MAX_KEY_BYTES = _lib.CACHE_MAX_KEY_BYTES
    #: Events one read returns at most (KVHOST_CACHE_MAX_EVENTS).
    MAX_EVENTS = 4096

    def __init__(self, client: Any, name: str) -> None:
        self._client = client
        #: The cache's pool name.
        self.name = name
        self._name = _lib.text(name, "cache name")

    def lookup(self, keys: Sequence[Key], pin: bool = False) -> LookupResult:
        """Which keys are present, and the length of the present prefix.

        pin=True (worker session) pins that prefix until release_pin or the
        session's end, so that no eviction takes it before a restore.
        """
        kptrs, klens, n, keep = _arrays.keys_arg(keys)
        prefix, pin_id = C.c_uint32(0), C.c_uint64(0)
        states = (C.c_int32 * max(n, 1))()
        _lib.call(_lib.lib().kvhost_cache_lookup, self._client._handle(), self._name, kptrs,
                  klens, n, 1 if pin else 0, C.byref(prefix), states, C.byref(pin_id))
        del keep
        return LookupResult(int(prefix.value), [KeyState(states[i]) for i in range(n)],
                            int(pin_id.value))

    def store(self, attachment: Any, keys: Sequence[Key], device_indices: Any, *,
              event: Any = None) -> StoreResult:
        """Backs up the keys not yet present from `attachment`'s device rows
        (page_size rows per key, in key order). `event` (cuda backend): the
        worker's interprocess event recorded after the rows were written,
        as Attachment.backup's; the host backend refuses one."""
        kptrs, klens, n, keep = _arrays.keys_arg(keys)
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        handle = event_bytes(event)
        states = (C.c_int32 * max(n, 1))()
        raw = _lib.LoadTicketStruct()
        evicted = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_cache_store, self._client._handle(), self._name,
                  attachment._p(), kptrs, klens, n, dev, nd, handle,
                  0 if handle is None else len(handle), states, C.byref(raw), C.byref(evicted))
        del keep, keep_d
        ticket = Ticket(self._client, raw.ticket_id) if raw.ticket_id else None
        return StoreResult([KeyState(states[i]) for i in range(n)], ticket, int(evicted.value))

    def restore(self, attachment: Any, keys: Sequence[Key], device_indices: Any, *,
                per_layer: bool = False, event: Any = None) -> Ticket:
        """Loads every key's page into `attachment`'s device rows (as
        store's); every key must be present (FailedPrecondition naming the
        first that is not). The pages stay pinned until the ticket ends.

        per_layer=True returns a LoadTicket to wait on layer by layer, as
        Attachment.load(per_layer=True) does (the attachment needs
        layer_progress on the host backend). `event` (cuda backend): the
        worker's event the copies wait for first, as load's.
        """
        kptrs, klens, n, keep = _arrays.keys_arg(keys)
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        handle = event_bytes(event)
        events = attachment.load_events() if per_layer else None
        raw = _lib.LoadTicketStruct()
        _lib.call(_lib.lib().kvhost_cache_restore, self._client._handle(), self._name,
                  attachment._p(), kptrs, klens, n, dev, nd, handle,
                  0 if handle is None else len(handle), C.byref(raw))
        del keep, keep_d
        if events is not None:
            return LoadTicket(self._client, events, raw)
        return Ticket(self._client, raw.ticket_id)

    def store_from_pool(self, pool: Any, host_indices: Any, keys: Sequence[Key]) -> StoreResult:
        """Stores the keys not yet present from an index-addressed pool's
        slots: key i's page is host_indices[i * page_size, (i + 1) *
        page_size), whole allocated pages of `pool` (a name, or anything with
        a ``name``), a pool of the cache's shape whose host layout may
        differ. Copied inside kvhostd, host memory to host memory, on either
        backend; the ticket waits as store's (no event set)."""
        kptrs, klens, n, keep = _arrays.keys_arg(keys)
        idx, ni, keep_i = _arrays.int64_arg(host_indices, "host_indices")
        states = (C.c_int32 * max(n, 1))()
        raw = _lib.LoadTicketStruct()
        evicted = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_cache_store_from_pool, self._client._handle(), self._name,
                  _pool_name(pool), kptrs, klens, n, idx, ni, states, C.byref(raw),
                  C.byref(evicted))
        del keep, keep_i
        ticket = Ticket(self._client, raw.ticket_id) if raw.ticket_id else None
        return StoreResult([KeyState(states[i]) for i in range(n)], ticket, int(evicted.value))

    def restore_to_pool(self, pool: Any, host_indices: Any, keys: Sequence[Key]) -> Ticket:
        """Loads every key's page into `pool`'s slots (as store_from_pool's);
        every key must be present (FailedPrecondition naming the first that
        is not), the pages pinned until the ticket ends. Refused, as a
        backup into it is, while another instance's live session holds the
        pool (claim_pool)."""
        kptrs, klens, n, keep = _arrays.keys_arg(keys)
        idx, ni, keep_i = _arrays.int64_arg(host_indices, "host_indices")
        raw = _lib.LoadTicketStruct()
        _lib.call(_lib.lib().kvhost_cache_restore_to_pool, self._client._handle(), self._name,
                  _pool_name(pool), kptrs, klens, n, idx, ni, C.byref(raw))
        del keep, keep_i
        return Ticket(self._client, raw.ticket_id)

    def release_pin(self, pin_id: int) -> None:
        """Releases a pin of lookup(pin=True); NotFound for one not of this
        client's session (or released already)."""
        _lib.call(_lib.lib().kvhost_cache_release_pin, self._client._handle(), self._name,
                  int(pin_id))

    def evict(self, keys: Sequence[Key]) -> List[EvictOutcome]:
        """Evicts published, unpinned keys; what happened to each, in order."""
        kptrs, klens, n, keep = _arrays.keys_arg(keys)
        outcomes = (C.c_int32 * max(n, 1))()
        _lib.call(_lib.lib().kvhost_cache_evict, self._client._handle(), self._name, kptrs, klens,
                  n, outcomes, None)
        del keep
        return [EvictOutcome(outcomes[i]) for i in range(n)]

    def stats(self) -> CacheStats:
        """The cache's counters now."""
        raw = _lib.CacheStatsStruct()
        _lib.call(_lib.lib().kvhost_cache_get_stats, self._client._handle(), self._name,
                  C.byref(raw))
        return CacheStats(**{f.name: int(getattr(raw, f.name)) for f in fields(CacheStats)})

    def events(self, after_seq: int = 0, max_events: int = 0) -> CacheEventBatch:
        """Stored and evicted keys after sequence number `after_seq` (0:
        from the oldest kept), at most `max_events` (0: MAX_EVENTS); resume
        with the batch's next_after."""
        if int(max_events) < 0:
            raise ValueError(f"max_events {max_events} is negative")
        room = min(int(max_events) or self.MAX_EVENTS, self.MAX_EVENTS)
        out = (_lib.CacheEventStruct * room)()
        count, next_after, gap = C.c_size_t(0), C.c_uint64(0), C.c_int32(0)
        _lib.call(_lib.lib().kvhost_cache_read_events, self._client._handle(), self._name,
                  int(after_seq), room, out, room, C.byref(count), C.byref(next_after),
                  C.byref(gap))
        events = [CacheEvent(int(e.seq), EventKind(e.kind), bytes(e.key)[:e.key_len])
                  for e in out[:count.value]]
        return CacheEventBatch(events, int(next_after.value), bool(gap.value))

    def __repr__(self) -> str:
        return f"NodeCache({self.name!r})"


def _pool_name(pool: Any) -> bytes:
    """A pool argument (a name, or anything with a ``name``) as the C call's."""
    return _lib.text(pool if isinstance(pool, str) else getattr(pool, "name", pool), "pool name")


class CacheCalls:
    """The node cache of a Client (mixed in)."""

    def node_cache(self, name: str) -> NodeCache:
        """The node cache `name` (a pool created with ``node_cache``), for
        its calls; nothing is asked of the daemon until the first."""
        return NodeCache(self, name)
