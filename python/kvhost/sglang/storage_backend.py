"""sglang's HiCache storage API (HiCacheStorage, the L3 tier behind its host
pool) on kvhostd's node cache: pages stored under sglang's page hashes are
shared by every sglang instance on the node that presents the cache's
owner token, and outlive the instances.

sglang loads it with no patch, through its ``dynamic`` storage backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "kvhost", "module_path": "kvhost.sglang.storage_backend",
        "class_name": "KvhostNodeCacheStorage", "kvhost_cache": "llama-cache"}'

(sglang's StorageBackendFactory imports the module and calls
``KvhostNodeCacheStorage(storage_config, kwargs)``; the cache controller then
calls ``register_mem_pool_host`` with its host pool, and, for a pool group,
``register_mem_host_pool_v2`` per entry.) Settings, all optional, in the
extra config (:data:`SETTINGS`; ValueError naming a bad or unknown one):

  kvhost_address           kvhostd's address ($KVHOST_ADDRESS, else the default socket)
  kvhost_cache             the cache's pool name ("sglang-cache"); a pool
                           group's other entries use "<cache>-<entry>"
  kvhost_owner_token_file  a file holding the cache's owner token
  kvhost_owner_token       the token itself ($KVHOST_OWNER_TOKEN); one of the
                           two is required: without a token the cache is not shared
  kvhost_cache_size_gib    the cache's size in GiB when this instance creates
                           it (default: as many tokens as the host pool)
  kvhost_staging_pages     pages of the staging pool, and of one turn of a
                           call (128, sglang's batch)
  kvhost_timeout_s         seconds to wait for a store or restore (60)

The backend sets sglang's own ``interface_v1`` in the extra config it is
given (unless set), so that the cache controller calls batch_get_v1 /
batch_set_v1 (its zero-copy path: host slots, no flat page copies); the
older batch_get / batch_set / get / set on flat pages work too.

Keys: sglang's page hash, then the rank suffix sglang's file backend uses
(``_<model>_<tp_rank>_<tp_size>`` for MHA, whose ranks hold different
heads; ``_<model>`` for MLA, whose ranks hold the same latent rows and whose
non-writer ranks do not store; ``_<pp_size>_<pp_rank>`` and
``_cp<rank>_<size>`` where those are parallel). A model name that would make
a key longer than the cache takes is replaced by its BLAKE2b digest.

Data path: kvhost.sglang.cache_staging. kvhostd copies pages between the
cache and a pool's slots itself (host memory to host memory, on either
backend): a kvhost.sglang host pool's slots straight (zero-copy in this
process); sglang's own host pool through a small staging pool mapped into
this process (one copy here per page).
Errors: construction and registration raise (a bad setting, a host pool it
cannot stage, a cache of another shape or token, kvhostd unreachable). The
data calls never raise: a kvhost error is logged with its code and message
and is the key's failure (batch_set_v1 / batch_get_v1 / v2: False from the
failed key on; batch_exists: the prefix before it; get: None; set: False),
and a failed call changes nothing (the daemon publishes no key of a
refused store; a staged restore writes the host pages only once its copy
ended well, a zero-copy one may have written part of a failed turn's). Not
supported: decode context parallelism, split heads (``tp_lcm_size``),
pool-group entries that are not MHA or MLA (refused at registration).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Set

import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo, PoolHitPolicy,
                                                  PoolName, PoolTransfer, PoolTransferResult)

from .._tokens import read_token_file
from ..cache import EvictOutcome, NodeCache
from ..client import DEFAULT_ADDRESS, Client
from .cache_staging import CacheStaging, Outcome
from .spec import GIB

_log = logging.getLogger("kvhost.sglang.storage")

#: The extra-config settings this backend reads, with their defaults (None:
#: from the environment or the host pool, as the module's header says).
SETTINGS: Dict[str, Any] = {
    "kvhost_address": None,
    "kvhost_cache": "sglang-cache",
    "kvhost_owner_token_file": None,
    "kvhost_owner_token": None,
    "kvhost_cache_size_gib": None,
    "kvhost_staging_pages": 128,
    "kvhost_timeout_s": 60.0,
}
#: sglang's own keys of a dynamic backend's extra config (and its other
#: storage options it pops before the backend sees them).
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
#: sglang's page hashes are SHA-256 in hex.
_HASH_CHARS = 64


def settings(extra_config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The backend's settings from sglang's extra config, with defaults;
    ValueError naming an unknown kvhost_* key or a bad value."""
    extra = dict(extra_config or {})
    unknown = sorted(k for k in extra if k.startswith("kvhost") and k not in SETTINGS)
    if unknown:
        raise ValueError(f"kvhost storage backend: unknown setting {unknown[0]!r} in "
                         f"--hicache-storage-backend-extra-config (it has "
                         f"{', '.join(SETTINGS)})")
    out = {k: extra.get(k, v) for k, v in SETTINGS.items()}
    if out["kvhost_address"] is None:
        out["kvhost_address"] = os.environ.get("KVHOST_ADDRESS", DEFAULT_ADDRESS)
    for key in ("kvhost_address", "kvhost_cache"):
        if not isinstance(out[key], str) or not out[key]:
            raise ValueError(f"kvhost storage backend: {key} {out[key]!r} is not a "
                             f"non-empty string")
    out["kvhost_owner_token"] = _owner_token(out)
    out["kvhost_staging_pages"] = _number(out, "kvhost_staging_pages", int, 1, 4096)
    out["kvhost_timeout_s"] = _number(out, "kvhost_timeout_s", float, 0.001, 86400.0)
    if out["kvhost_cache_size_gib"] is not None:
        out["kvhost_cache_size_gib"] = _number(out, "kvhost_cache_size_gib", float, 1e-6,
                                               1 << 20)
    return out


def _number(out: Dict[str, Any], key: str, kind: type, low: float, high: float) -> Any:
    value = out[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not float(value).is_integer()) or not low <= value <= high:
        raise ValueError(f"kvhost storage backend: {key} {value!r} is not "
                         f"{'an integer' if kind is int else 'a number'} in [{low:g}, {high:g}]")
    return kind(value)


def _owner_token(out: Dict[str, Any]) -> str:
    path, token = out["kvhost_owner_token_file"], out["kvhost_owner_token"]
    if path is not None and token is not None:
        raise ValueError("kvhost storage backend: give kvhost_owner_token_file or "
                         "kvhost_owner_token, not both")
    if path is not None:
        try:
            token = read_token_file(str(path))
        except ValueError as e:
            raise ValueError(f"kvhost storage backend: kvhost_owner_token_file {path!r}: "
                             f"{e}") from None
    if token is None:
        token = os.environ.get("KVHOST_OWNER_TOKEN") or None
    if not isinstance(token, str) or not token:
        raise ValueError("kvhost storage backend: no owner token (kvhost_owner_token_file, "
                         "kvhost_owner_token or $KVHOST_OWNER_TOKEN): the node cache is "
                         "shared by the instances that present its token")
    return token


def key_suffixes(config: HiCacheStorageConfig, limit: int) -> Dict[str, str]:
    """The suffixes of a rank's keys, as sglang's file backend makes them:
    "tp" (rank-sharded KV: MHA) and "mla" (rank-replicated KV). A model
    name that would make a key over `limit` bytes is its BLAKE2b digest."""
    if config.dcp_size > 1:
        raise ValueError(f"kvhost storage backend: decode context parallelism (dcp_size "
                         f"{config.dcp_size}) is not supported")
    if config.should_split_heads:
        raise ValueError("kvhost storage backend: split heads (tp_lcm_size "
                         f"{config.tp_lcm_size}) are not supported")
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    shard = f"_{config.pp_size}_{config.pp_rank}" if config.pp_size > 1 else ""
    if config.attn_cp_size > 1:
        shard += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"

    def make(name: str) -> Dict[str, str]:
        return {"tp": f"_{name}_{config.tp_rank}_{config.tp_size}{shard}",
                "mla": f"_{name}{shard}"}
    out = make(model)
    if _HASH_CHARS + max(len(s.encode()) for s in out.values()) > limit:
        out = make(hashlib.blake2b(model.encode(), digest_size=8).hexdigest())
    return out


class KvhostNodeCacheStorage(HiCacheStorage):  # type: ignore[misc]  # untyped sglang
    """sglang's HiCacheStorage over a kvhostd node cache (the module's
    header). Made by sglang's StorageBackendFactory ("dynamic") as
    ``KvhostNodeCacheStorage(storage_config, kwargs)``."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: Optional[Dict[str, Any]] = None) -> None:
        extra = storage_config.extra_config
        self.settings = settings(extra)
        if extra is not None:
            extra.setdefault("interface_v1", 1)  # sglang's switch to batch_*_v1
        self.config = storage_config
        self._suffix = key_suffixes(storage_config, NodeCache.MAX_KEY_BYTES)
        self.client = Client(self.settings["kvhost_address"], session=True,
                             owner_token=self.settings["kvhost_owner_token"])
        self._lanes: Dict[str, CacheStaging] = {}
        self._lock = threading.Lock()
        self._losses = self.client.session_losses().count
        #: Per pool, the keys this backend stored, oldest first, at most as
        #: many as its cache holds (clear() evicts them).
        self._stored: Dict[str, Dict[str, None]] = {}
        self._stored_lock = threading.Lock()
        self._metrics: Dict[str, List[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                                 "prefetch_bandwidth": [],
                                                 "backup_bandwidth": []}

    # --- registration ----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """sglang's host pool: opens the cache (creating it when absent)
        and its data path. Raises what CacheStaging raises."""
        super().register_mem_pool_host(mem_pool_host)
        self._lane(str(PoolName.KV), mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool group's entry: its own cache, "<cache>-<entry>"."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._lane(str(host_pool_name), host_pool)

    def _lane(self, pool: str, host: Any) -> CacheStaging:
        with self._lock:
            lane = self._lanes.get(pool)
            if lane is not None and lane.host is host:
                return lane
            if pool != str(PoolName.KV) and self._lanes.get(str(PoolName.KV)) is not None \
                    and self._lanes[str(PoolName.KV)].host is host:
                lane = self._lanes[str(PoolName.KV)]  # the anchor, named again
            else:
                lane = self._open(pool, host)
            self._lanes[pool] = lane
            return lane

    def _open(self, pool: str, host: Any) -> CacheStaging:
        s = self.settings
        name = s["kvhost_cache"] if pool == str(PoolName.KV) else f"{s['kvhost_cache']}-{pool}"
        gib = s["kvhost_cache_size_gib"]
        size = int(host.size) if gib is None else \
            max(int(gib * GIB) // max(int(host.get_size_per_token()), 1), 1)
        try:
            return CacheStaging(self.client, name, host, staging_pages=s["kvhost_staging_pages"],
                                cache_size_tokens=size, timeout=s["kvhost_timeout_s"])
        except ValueError as e:
            raise ValueError(f"kvhost storage backend, pool {pool!r}: {e}") from None

    def _lane_for(self, pool: Any) -> CacheStaging:
        self._revive()
        lane = self._lanes.get(str(pool))
        if lane is None:
            raise RuntimeError(f"kvhost storage backend: no host pool {str(pool)!r} "
                               f"registered (register_mem_pool_host / "
                               f"register_mem_host_pool_v2)")
        return lane

    def _revive(self) -> None:
        """Once the client's session was lost (kvhostd restarted), every
        cache is made again (empty) and its staging pool too;
        the calls in between failed, as their results said."""
        losses = self.client.session_losses().count
        if losses == self._losses:
            return
        with self._lock:
            if losses == self._losses:
                return
            _log.warning("kvhost storage backend: kvhostd session lost (%d); opening the "
                         "node caches again", losses)
            for lane in {id(v): v for v in self._lanes.values()}.values():
                lane.reopen()
            with self._stored_lock:
                self._stored.clear()
            self._losses = losses

    # --- keys ------------------------------------------------------------------

    def _keys(self, keys: List[str], lane: CacheStaging) -> List[str]:
        replicated = self.config.is_mla_model and lane.shape.kind == "MLA"
        suffix = self._suffix["mla" if replicated else "tp"]
        return [f"{k}{suffix}" for k in keys]

    def _failed(self, what: str, keys: List[str], error: BaseException) -> None:
        _log.error("kvhost storage backend: %s of %d pages (from %s) failed: %s", what,
                   len(keys), keys[0] if keys else "-", error)

    # --- the v1 calls (host slots) ---------------------------------------------

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many keys, from the first, are in the cache (0 on an error)."""
        try:
            lane = self._lane_for(PoolName.KV)
            return lane.prefix(self._keys(keys, lane))
        except Exception as e:  # noqa: BLE001 (a miss is the safe answer)
            self._failed("lookup", keys, e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._set(str(PoolName.KV), keys, host_indices)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._get(str(PoolName.KV), keys, host_indices)

    def _page_slots(self, lane: CacheStaging, keys: List[str], host_indices: Any) -> List[int]:
        P = lane.shape.page_size
        n = 0 if host_indices is None else int(host_indices.numel())
        if n != len(keys) * P:
            raise ValueError(f"{n} host indices for {len(keys)} pages of {P} tokens")
        return [int(i) for i in host_indices[::P].tolist()]

    def _set(self, pool: str, keys: List[str], host_indices: Any) -> List[bool]:
        if not keys:
            return []
        start = time.perf_counter()
        try:
            lane = self._lane_for(pool)
            slots = self._page_slots(lane, keys, host_indices)
            result = lane.store_slots(self._keys(keys, lane), slots)
        except Exception as e:  # noqa: BLE001 (the contract: False per key)
            result = Outcome([False] * len(keys), e)
        return self._stored_result(pool, "store", keys, result, start)

    def _get(self, pool: str, keys: List[str], host_indices: Any) -> List[bool]:
        if not keys:
            return []
        start = time.perf_counter()
        try:
            lane = self._lane_for(pool)
            slots = self._page_slots(lane, keys, host_indices)
            result = lane.restore_slots(self._keys(keys, lane), slots)
        except Exception as e:  # noqa: BLE001
            result = Outcome([False] * len(keys), e)
        if result.error is not None:
            self._failed("restore", keys, result.error)
        self._measure("prefetch", pool, sum(result.ok), start)
        return result.ok

    def _stored_result(self, pool: str, what: str, keys: List[str], result: Outcome,
                       start: float) -> List[bool]:
        if result.error is not None:
            self._failed(what, keys, result.error)
        lane = self._lanes.get(pool)
        if lane is not None:
            with self._stored_lock:
                stored = self._stored.setdefault(pool, {})
                for key, ok in zip(self._keys(keys, lane), result.ok):
                    if ok:
                        stored.pop(key, None)
                        stored[key] = None  # the newest last
                for key in list(itertools.islice(stored, max(len(stored) - lane.page_num, 0))):
                    del stored[key]  # more than the cache holds: long evicted
        self._measure("backup", pool, sum(result.ok), start)
        return result.ok

    def _measure(self, what: str, pool: str, pages: int, start: float) -> None:
        if not self.config.enable_storage_metrics or pages == 0:
            return
        lane = self._lanes.get(pool)
        seconds = max(time.perf_counter() - start, 1e-9)
        self._metrics[f"{what}_pgs"].append(pages)
        if lane is not None:
            self._metrics[f"{what}_bandwidth"].append(pages * lane.page_bytes / 1e9 / seconds)

    # --- the older calls (flat pages) ------------------------------------------

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Stores flat pages (sglang's get_data_page(flat=True)); True when
        every one is stored."""
        if not keys:
            return True
        start = time.perf_counter()
        try:
            lane = self._lane_for(PoolName.KV)
            if values is None or len(values) != len(keys):
                raise ValueError(f"{0 if values is None else len(values)} pages for "
                                 f"{len(keys)} keys")
            result = lane.store(self._keys(keys, lane), list(values))
        except Exception as e:  # noqa: BLE001
            result = Outcome([False] * len(keys), e)
        return all(self._stored_result(str(PoolName.KV), "store", keys, result, start))

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Restores into flat pages (sglang's get_dummy_flat_data_page()):
        each target, filled, or None from the first key not restored."""
        if not keys:
            return []
        try:
            lane = self._lane_for(PoolName.KV)
            if target_locations is None or len(target_locations) != len(keys):
                raise ValueError(f"{0 if target_locations is None else len(target_locations)}"
                                 f" target pages for {len(keys)} keys")
            result = lane.restore(self._keys(keys, lane), list(target_locations))
        except Exception as e:  # noqa: BLE001
            result = Outcome([False] * len(keys), e)
        if result.error is not None:
            self._failed("restore", keys, result.error)
        return [t if ok else None for t, ok in zip(target_locations or [None] * len(keys),
                                                   result.ok)]

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        if target_location is None:
            lane = self._lanes.get(str(PoolName.KV))
            if lane is None:
                return None
            target_location = lane.host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    # --- the v2 calls (pool groups) ------------------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None
                        ) -> PoolTransferResult:
        """The usable prefix over the KV pool and each transfer's pool, by
        its hit policy (ALL_PAGES, TRAILING_PAGES), as sglang's file backend
        decides it. 0 pages on an error (logged)."""
        try:
            kv = self.batch_exists(keys)
            hits: Dict[str, int] = {str(PoolName.KV): kv} if kv else {}
            restorable = set(range(1, kv + 1))
            for transfer in pool_transfers or []:
                if not restorable:
                    break
                lane = self._lane_for(transfer.name)
                have = lane.present(self._keys(keys[:kv], lane))
                pool_ok = _restorable(transfer, have, kv)
                boundary = max(pool_ok, default=0)
                if boundary:
                    hits[str(transfer.name)] = boundary
                restorable &= pool_ok
        except Exception as e:  # noqa: BLE001
            self._failed("lookup", keys, e)
            return PoolTransferResult(0, {}, [])
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> Dict[str, List[bool]]:
        return {str(t.name): self._set(str(t.name), list(t.keys or []), t.host_indices)
                for t in transfers}

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> Dict[str, List[bool]]:
        return {str(t.name): self._get(str(t.name), list(t.keys or []), t.host_indices)
                for t in transfers}

    # --- the rest ----------------------------------------------------------------

    def clear(self) -> bool:
        """Evicts the keys this backend stored (the cache is shared: other
        instances' pages stay; the newest as many as the cache holds).
        False when some were pinned or being written (kept), or on an
        error."""
        ok = True
        with self._stored_lock:
            stored = {pool: list(keys) for pool, keys in self._stored.items()}
        for pool, keys in stored.items():
            lane = self._lanes.get(pool)
            if lane is None:
                continue
            try:
                for i in range(0, len(keys), NodeCache.MAX_KEYS):
                    chunk = keys[i:i + NodeCache.MAX_KEYS]
                    outcomes = lane.cache.evict(chunk)
                    with self._stored_lock:
                        for key, outcome in zip(chunk, outcomes):
                            if outcome != EvictOutcome.BUSY:
                                self._stored.get(pool, {}).pop(key, None)
                    ok = ok and EvictOutcome.BUSY not in outcomes
            except Exception as e:  # noqa: BLE001
                self._failed("clear", keys, e)
                ok = False
        return ok

    def get_stats(self) -> Any:
        """sglang's StorageMetrics since the last call (with
        enable_storage_metrics), else None."""
        if not self.config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa
        metrics = StorageMetrics()
        for name, values in self._metrics.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def cache_stats(self) -> Any:
        """The KV cache's kvhost.CacheStats (the daemon's counters)."""
        return self._lane_for(PoolName.KV).cache.stats()

    def close(self) -> None:
        """Deletes the staging pools and closes the client (its session);
        the cache and its pages stay. sglang's controller calls it on detach."""
        lanes, self._lanes = list({id(v): v for v in self._lanes.values()}.values()), {}
        for lane in lanes:
            lane.close()
        self.client.close()


def _restorable(transfer: PoolTransfer, have: List[bool], kv: int) -> Set[int]:
    """The prefix lengths (1..kv) a pool's pages allow, by its hit policy."""
    if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
        first_missing = have.index(False) if False in have else kv
        return set(range(1, first_missing + 1))
    if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
        trailing = max(1, len(transfer.keys) if transfer.keys else 1)
        return {n for n in range(1, kv + 1) if all(have[max(0, n - trailing):n])}
    raise ValueError(f"kvhost storage backend: hit policy {transfer.hit_policy} of pool "
                     f"{transfer.name} is not supported")
