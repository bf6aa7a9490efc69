"""vLLM 0.33's ``OffloadingManager`` (vllm/v1/kv_offload/base.py) over
kvhostd's node cache: runs in vLLM's scheduler, driven by
OffloadingConnectorScheduler (.../kv_connector/v1/offloading/scheduler.py).

vLLM's own CPU manager (cpu/manager.py) keeps the map of which chunk is in
which host slot; here kvhostd's node cache is that map, shared by every
instance on the node and kept across restarts, so this manager keeps only
what is its own: the chunks it is storing (HIT_PENDING until
complete_store), the pins of its loads, and the read position in the
cache's event log.

  lookup(key)        one Lookup of the chunk's keys: HIT when every shard's
                     blocks are present, HIT_PENDING while one is written,
                     else MISS (also when kvhostd cannot be asked: a miss is
                     always safe)
  prepare_load(keys) pins them (Lookup with pin) until complete_load, so no
                     eviction takes them before the workers' restores
  touch(keys)        a Lookup: kvhostd's LRU order is refreshed by it
  prepare_store(keys) the chunks not present nor being stored; evicted_keys
                     are the chunks the cache's event log says were evicted
                     since the last read (kvhostd evicts, at the workers'
                     stores); None when kvhostd cannot be asked
  complete_store     ends the pending state (the workers' stores published
                     the pages, or, failed, published nothing)
  take_events        the cache's log of this namespace's chunks, stored (by
                     any instance: each is a hit here too) or evicted
  reset_cache        evicts the chunks this manager stored (other instances'
                     stay: the cache is shared); drops its pins
  shutdown           releases its pins and closes its session
"""

from __future__ import annotations

import logging
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadingEvent,
                                     OffloadingManager, PrepareStoreOutput,
                                     RequestOffloadingContext)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..cache import EventKind, KeyState, NodeCache
from ..client import Client
from ..errors import KvhostError
from .keys import CacheNamespace, unique
from .load_store_spec import KvhostLoadStoreSpec
from .settings import Settings

logger = logging.getLogger(__name__)


def _batches(items: Sequence[bytes], size: int = NodeCache.MAX_KEYS) -> Iterator[Sequence[bytes]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class KvhostOffloadingManager(OffloadingManager):  # type: ignore[misc]  # vLLM's: Any to mypy
    """The scheduler's view of kvhostd's node cache for one vLLM instance."""

    def __init__(self, settings: Settings, namespace: CacheNamespace, cache_name: str,
                 enable_events: bool, worker_name: str) -> None:
        self._settings = settings
        self._namespace = namespace
        self._cache_name = cache_name
        self._worker_name = worker_name
        self._enable_events = enable_events
        self._client: Optional[Client] = None
        #: Chunks prepared for storing, not completed yet.
        self._storing: Set[bytes] = set()
        #: Chunks this manager stored (what reset_cache evicts).
        self._stored: Set[bytes] = set()
        #: The pins of each load, by its chunks.
        self._pins: Dict[FrozenSet[bytes], List[List[int]]] = {}
        self._log_after: Optional[int] = None
        self._evicted: List[bytes] = []
        self._events: List[OffloadingEvent] = []

    def _node_cache(self) -> NodeCache:
        """The cache, through this manager's session (connected on first use)."""
        if self._client is None:
            s = self._settings
            self._client = Client(s.address, timeout=s.timeout_s, session=True,
                                  owner_token=s.owner_token, worker_name=self._worker_name)
        return self._client.node_cache(self._cache_name)

    def _states(self, chunks: Sequence[bytes]) -> List[List[KeyState]]:
        """Each chunk's key states (raises KvhostError)."""
        per = self._namespace.shards * self._namespace.blocks_per_chunk
        keys = [k for c in chunks for k in self._namespace.chunk_keys(c)]
        states: List[KeyState] = []
        cache = self._node_cache()
        for part in _batches(keys):
            states += cache.lookup(part).states
        return [states[i * per:(i + 1) * per] for i in range(len(chunks))]

    def lookup(self, key: bytes, req_context: Any) -> Any:
        if key in self._storing:
            return LookupResult.HIT_PENDING
        try:
            (states,) = self._states([key])
        except KvhostError as e:
            logger.warning("kvhost.vllm: lookup in cache %r: %s", self._cache_name, e)
            return LookupResult.MISS
        if all(s == KeyState.PRESENT for s in states):
            return LookupResult.HIT
        if any(s == KeyState.ABSENT for s in states):
            return LookupResult.MISS
        return LookupResult.HIT_PENDING

    def get_load_source(self, key: bytes, req_context: Any) -> Any:
        return CacheHitSource.HOST  # kvhostd's host memory

    def prepare_load(self, keys: Iterable[bytes], req_context: Any) -> KvhostLoadStoreSpec:
        chunks = list(keys)
        node_keys = [k for c in chunks for k in self._namespace.chunk_keys(c)]
        pins: List[int] = []
        try:
            cache = self._node_cache()
            for part in _batches(node_keys):
                found = cache.lookup(part, pin=True)
                if found.pin_id:
                    pins.append(found.pin_id)
                if found.prefix < len(part):
                    # Evicted since lookup() by another instance's store: the
                    # workers' restores will fail and report it.
                    logger.warning("kvhost.vllm: %d of %d keys to load are gone from cache %r",
                                   len(part) - found.prefix, len(part), self._cache_name)
        except KvhostError as e:
            logger.warning("kvhost.vllm: pinning a load in cache %r: %s", self._cache_name, e)
        self._pins.setdefault(frozenset(chunks), []).append(pins)
        return KvhostLoadStoreSpec(chunks)

    def touch(self, keys: Iterable[bytes], req_context: Any) -> None:
        try:
            self._states(unique(list(keys)))
        except KvhostError as e:
            logger.warning("kvhost.vllm: touch in cache %r: %s", self._cache_name, e)

    def complete_load(self, keys: Iterable[bytes], req_context: Any) -> None:
        held = self._pins.get(frozenset(keys))
        if not held:
            return
        self._release(held.pop())
        if not held:
            del self._pins[frozenset(keys)]

    def _release(self, pins: List[int]) -> None:
        if self._client is None:
            return
        cache = self._client.node_cache(self._cache_name)
        for pin in pins:
            try:
                cache.release_pin(pin)
            except KvhostError as e:  # the session was lost, and its pins with it
                logger.info("kvhost.vllm: releasing pin %d: %s", pin, e)

    def prepare_store(self, keys: Iterable[bytes], req_context: Any) -> Any:
        offered = [k for k in unique(list(keys)) if k not in self._storing]
        try:
            states = self._states(offered)
            self._read_log()
        except KvhostError as e:
            logger.warning("kvhost.vllm: cannot store in cache %r: %s", self._cache_name, e)
            return None
        to_store = [k for k, st in zip(offered, states)
                    if any(s == KeyState.ABSENT for s in st)]
        self._storing.update(to_store)
        evicted, self._evicted = self._evicted, []
        return PrepareStoreOutput(keys_to_store=to_store,
                                  store_spec=KvhostLoadStoreSpec(to_store), evicted_keys=evicted)

    def complete_store(self, keys: Iterable[bytes], req_context: Any,
                       success: bool = True) -> None:
        for key in keys:
            self._storing.discard(key)
            if success:
                self._stored.add(key)

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()

    def _read_log(self) -> None:
        """Reads the cache's event log since the last read: this namespace's
        evicted chunks (for prepare_store) and, with events on, stored and
        evicted chunks (for take_events). The first read only finds the end."""
        cache = self._node_cache()
        first = self._log_after is None
        while True:
            batch = cache.events(after_seq=self._log_after or 0)
            self._log_after = batch.next_after
            if batch.gap and not first:
                logger.warning("kvhost.vllm: cache %r's event log dropped events",
                               self._cache_name)
            if not first:
                self._collect(batch.events)
            if len(batch.events) < NodeCache.MAX_EVENTS:
                return

    def _collect(self, events: Sequence[Any]) -> None:
        by_kind: Dict[EventKind, List[bytes]] = {EventKind.STORED: [], EventKind.EVICTED: []}
        for e in events:
            if self._namespace.owns(e.key):
                by_kind[e.kind].append(self._namespace.offload_key(e.key))
        evicted = unique(by_kind[EventKind.EVICTED])
        self._evicted = unique(self._evicted + evicted)
        self._stored.difference_update(evicted)
        if not self._enable_events:
            return
        for kind, removed in ((EventKind.STORED, False), (EventKind.EVICTED, True)):
            if by_kind[kind]:
                self._events.append(OffloadingEvent(keys=unique(by_kind[kind]), medium=Medium.CPU,
                                                    removed=removed, locality=Locality.LOCAL))

    def take_events(self) -> Iterable[Any]:
        if not self._enable_events:
            return ()
        try:
            self._read_log()
        except KvhostError as e:
            logger.warning("kvhost.vllm: reading cache %r's events: %s", self._cache_name, e)
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        stored = sorted(self._stored)
        self._stored.clear()
        self._storing.clear()
        for held in self._pins.values():
            for pins in held:
                self._release(pins)
        self._pins.clear()
        if not stored:
            return
        keys = [k for c in stored for k in self._namespace.chunk_keys(c)]
        try:
            cache = self._node_cache()
            for part in _batches(keys):
                cache.evict(part)
        except KvhostError as e:
            logger.warning("kvhost.vllm: reset of cache %r: %s", self._cache_name, e)

    def shutdown(self) -> None:
        for held in self._pins.values():
            for pins in held:
                self._release(pins)
        self._pins.clear()
        if self._client is not None:
            self._client.close()
            self._client = None

    def _pending(self) -> Tuple[int, int]:
        """(chunks being stored, loads pinned): for tests."""
        return len(self._storing), sum(len(h) for h in self._pins.values())
