"""A host pool's pages in and out of a kvhostd node cache: the data path of
kvhost.sglang.storage_backend (sglang's HiCacheStorage on the node cache).

The node cache copies pages between itself and an index-addressed kvhostd
pool's slots inside kvhostd (kvhost.NodeCache.store_from_pool /
restore_to_pool: host memory to host memory, on either backend). So:

  zero-copy  where sglang's host pool is a kvhost.sglang pool (a kvhostd
             pool mapped into this process) whose client presents a token
             that opens the cache, its slots are the source and destination
             themselves, and this process copies nothing: the calls are made
             through the host pool's client, whose session holds the pool's
             claim (a restore writes the pool, which only the claiming
             session may: ClaimPool).
  staged     otherwise (sglang's own CPU host pool, or flat pages), each page
             is copied once in this process, into or out of the slots of a
             small staging pool (``staging_pages`` pages, a kvhost.sglang
             pool of the cache's shape made and claimed by this client and
             mapped into this process), and kvhostd copies between it and the
             cache. A restore writes its targets only once its copy ended
             well, so a failed restore leaves them as they were.
  :attr:`CacheStaging.staged_pages` counts the pages copied the staged way.

Page format: the cache's pages are rows, a layout of their own, so a page
stored from a host pool of one layout restores into another's. Each staged
page is read through sglang's ``get_data_page(index, flat=False)`` (a view:
sglang's pools slice their buffer, kvhost's map kvhostd's page) and seen as
``(components, layers, page_size, heads, dim)`` (MHA: K then V; MLA: one
latent component of one head) by :func:`canonical`. MHA in
``layer_first``, ``page_first``, ``page_first_direct``, ``page_head`` and
MLA in the first three; other kinds and layouts are refused at
construction, naming them.

The cache is created when absent (``node_cache``, the host pool's shape,
the client's owner token) and adopted when present only if that token
protects it and its shape is the host pool's (kvhost.pools.adopt_pool;
ValueError naming the field that differs). Thread safety: one lock
serialises the calls that use the staging slots; lookups and zero-copy
calls take none. Needs torch.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from ..cache import KeyState, NodeCache
from ..errors import AlreadyExists, DeadlineExceeded, NotFound, PermissionDenied
from ..pools import adopt_pool
from .host_pool import HostKVCache
from .kinds import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from .spec import dtype_enum

_log = logging.getLogger("kvhost.sglang.storage")

#: sglang's layouts each kind's pages are staged from.
LAYOUTS = {"MHA": ("layer_first", "page_first", "page_first_direct", "page_head"),
           "MLA": ("layer_first", "page_first", "page_first_direct")}
#: The cache pool's own layout: its pages are rows to every caller, so any
#: page-major layout serves; kvhostd has it for both kinds.
CACHE_LAYOUT = "PAGE_FIRST"
#: The staging pool's (sglang's name): a page is one block per component
#: in one region, so each staging page has a view in this process.
STAGING_LAYOUT = "page_first"
#: Tells this process's staging pools apart.
_STAGING_SERIAL = itertools.count(1)


class Outcome(NamedTuple):
    """A store's or restore's result: per key, and the error that ended it."""

    ok: List[bool]
    #: The kvhost error (or other failure) that stopped the call; None when
    #: every key was served, or a restore found only a prefix.
    error: Optional[BaseException]


class PageShape(NamedTuple):
    """What of a host pool decides its cache: the pool spec's shape fields
    and the canonical page ``(components, layers, page_size, heads, dim)``."""

    kind: str
    layout: str
    dtype: Any
    page_size: int
    layer_num: int
    heads: int
    dim: int
    #: The node cache's pool spec fields (kind, dtype, dims, page size).
    spec: Dict[str, Any]

    @property
    def components(self) -> int:
        return 2 if self.kind == "MHA" else 1


def page_shape(host: Any) -> PageShape:
    """The host pool's PageShape; ValueError naming what is not staged."""
    layout = str(getattr(host, "layout", ""))
    name = type(host).__name__
    if hasattr(host, "kv_lora_rank"):
        kind, heads = "MLA", 1
        dim = int(host.kv_lora_rank) + int(host.qk_rope_head_dim)
        if int(getattr(host, "kv_cache_dim", dim)) != dim:
            raise ValueError(f"{name}: MLA rows of {host.kv_cache_dim} elements (packed FP8 "
                             f"DSA rows) are not staged into a node cache, only "
                             f"kv_lora_rank + qk_rope_head_dim = {dim}")
        dims = {"kv_lora_rank": int(host.kv_lora_rank),
                "qk_rope_head_dim": int(host.qk_rope_head_dim)}
    elif hasattr(host, "head_num") and hasattr(host, "head_dim"):
        kind, heads, dim = "MHA", int(host.head_num), int(host.head_dim)
        if int(getattr(host, "v_head_dim", dim) or dim) != dim:
            raise ValueError(f"{name}: V width {host.v_head_dim} != K width {dim} "
                             f"(asymmetric MHA) is not staged into a node cache")
        if int(getattr(host, "head_group_num", 1) or 1) != 1:
            raise ValueError(f"{name}: head_group_num {host.head_group_num} is not staged "
                             f"into a node cache")
        dims = {"head_num": heads, "head_dim": dim}
    else:
        raise ValueError(f"host pool {name} is neither MHA nor MLA: the kvhost node cache "
                         f"storage backend stages MHA and MLA pages only")
    if layout not in LAYOUTS[kind]:
        raise ValueError(f"{name}: layout {layout!r} is not staged into a node cache "
                         f"({kind} has {', '.join(LAYOUTS[kind])})")
    spec = {"kind": kind, "dtype": dtype_enum(host.dtype), "page_size": int(host.page_size),
            "layer_num": int(host.layer_num), **dims}
    shape = PageShape(kind, layout, host.dtype, int(host.page_size), int(host.layer_num), heads,
                      dim, spec)
    # A pool with these members but another page (MiniMax's K-only pool has
    # no V) is told apart by its flat page's size.
    want = shape.components * shape.layer_num * shape.page_size * heads * dim
    have = getattr(host.get_dummy_flat_data_page(), "numel", lambda: want)()
    if have != want:
        raise ValueError(f"{name}: a page of {have} elements, not the {want} of {kind} "
                         f"({shape.components} x {shape.layer_num} layers x "
                         f"{shape.page_size} tokens x {heads} x {dim}): not staged into a "
                         f"node cache")
    return shape


def canonical(page: Any, shape: PageShape) -> Any:
    """sglang's page tensor of `shape.layout` (get_data_page(flat=False)'s
    shape, or a flat page viewed so) as a ``(components, layers, page_size,
    heads, dim)`` view of the same memory: writes through it land in it."""
    c, L, P, H, D = shape.components, shape.layer_num, shape.page_size, shape.heads, \
        shape.dim
    lay = shape.layout
    if shape.kind == "MLA":  # sglang's MLA pages have no component dimension
        page = page.reshape({"layer_first": (L, P, 1, D), "page_first": (P, L, 1, D),
                             "page_first_direct": (L, P, 1, D)}[lay]).unsqueeze(0)
        return page if lay != "page_first" else page.permute(0, 2, 1, 3, 4)
    if lay == "layer_first":
        return page.reshape(c, L, P, H, D)
    if lay == "page_first":
        return page.reshape(c, P, L, H, D).permute(0, 2, 1, 3, 4)
    if lay == "page_first_direct":
        return page.reshape(c, L, P, H, D)
    return page.reshape(c, H, P, L, D).permute(0, 3, 2, 1, 4)  # page_head


def _host_page_view(host: Any, index: int) -> Optional[Any]:
    """A writable view of the host page at slot `index` in sglang's shape,
    or None where there is none (a kvhost pool whose page is not evenly
    spaced in one region: its get_data_page(flat=False) is a copy)."""
    if isinstance(host, HostKVCache):
        return host._page_view(int(index))
    return host.get_data_page(int(index), flat=False)  # sglang's: a slice of its buffer


def _token_slots(slots: Sequence[int], page_size: int) -> List[int]:
    """Every token slot of the pages starting at `slots`, in order."""
    return [s + t for s in slots for t in range(page_size)]


class CacheStaging:
    """One node cache, its data path and the host pool it serves.

    Args:
      client: a kvhost.Client with a worker session and the cache's owner
        token; it must outlive this object.
      cache: the cache's pool name.
      host: the sglang host pool (sglang's or kvhost.sglang's) whose pages
        move.
      staging_pages: pages the staging pool holds, and the pages of one
        turn either way (a call of more moves them in turns).
      cache_size_tokens: the cache's size when this call creates it.
      timeout: seconds to wait for a store or restore.
    Raises ValueError for a host pool it cannot serve (naming why) or a
    cache of another shape, and the daemon's errors (PermissionDenied for a
    cache another token protects).
    """

    def __init__(self, client: Any, cache: str, host: Any, *, staging_pages: int,
                 cache_size_tokens: int, timeout: float) -> None:
        import torch  # noqa: PLC0415 (sglang's dependency; kvhost's is optional)
        self._torch = torch
        self.shape = page_shape(host)
        self.host, self.client, self.timeout = host, client, float(timeout)
        self.name = cache
        self.cache = NodeCache(client, cache)
        self._lock = threading.Lock()
        self._staging: Any = None
        self._slots: List[int] = []
        self._views: List[Any] = []
        self._running: Any = None
        #: Pages copied in this process through the staging pool, so far.
        self.staged_pages = 0
        self._size_tokens, self.pages = int(cache_size_tokens), int(staging_pages)
        self._page_bytes = int(self.shape.components * self.shape.layer_num *
                               self.shape.page_size * self.shape.heads * self.shape.dim *
                               torch.empty((), dtype=self.shape.dtype).element_size())
        self._open_cache(self._size_tokens)
        #: The cache through the host pool's own client (zero-copy), or None.
        self.direct = self._direct_cache()
        if self.direct is None:
            with self._lock:
                self._open_staging()

    def reopen(self) -> None:
        """After the client's session was lost (kvhostd restarted: the
        cache and the staging pool are gone): the cache made again (empty)
        or adopted, and a new staging pool where one was used."""
        with self._lock:
            staged = self._staging is not None
            self._close_staging()
            self._running = None
            self._open_cache(self._size_tokens)
            if staged:
                self._open_staging()

    def _open_cache(self, size_tokens: int) -> None:
        spec = dict(self.shape.spec, layout=CACHE_LAYOUT, node_cache=True)
        try:
            info = self.client.create_pool(self.name, dict(spec, size_tokens=size_tokens))
        except AlreadyExists:
            info = adopt_pool(self.client, self.name)
            HostKVCache._check_same_shape(info["spec"], {k: v for k, v in spec.items()
                                                         if k != "layout"})
        #: Pages the cache holds (its first creator's size).
        self.page_num = int(info["page_num"])

    def _direct_cache(self) -> Optional[NodeCache]:
        """The cache through the host pool's client, where the host pool is
        a kvhost.sglang pool of this kvhostd whose client has a worker
        session and a token that opens the cache; else None (staged)."""
        host = self.host
        hc = getattr(host, "client", None)
        if not isinstance(host, HostKVCache) or not getattr(hc, "session", False) or \
                getattr(hc, "address", None) != self.client.address:
            return None
        direct = NodeCache(hc, self.name)
        try:
            direct.stats()
        except PermissionDenied:
            _log.warning("node cache '%s': host pool '%s' is a kvhost pool, but its client's "
                         "owner token does not open the cache; its pages are staged (one copy "
                         "in this process)", self.name, host.name)
            return None
        return direct

    def _open_staging(self) -> None:
        """The staging pool: made, claimed by this client, its slots
        allocated and each page viewed in this process. Called with the lock."""
        s = self.shape
        P, n = s.page_size, self.pages
        cls = MHATokenToKVPoolHost if s.kind == "MHA" else MLATokenToKVPoolHost
        dims = {k: v for k, v in s.spec.items() if k in ("head_num", "head_dim", "kv_lora_rank",
                                                          "qk_rope_head_dim")}
        name = f"{self.name}-staging-{os.getpid()}-{next(_STAGING_SERIAL)}"
        pool = cls(name, client=self.client, layout=STAGING_LAYOUT, dtype=s.dtype, page_size=P,
                   layer_num=s.layer_num, host_size_tokens=n * P, tensors=True, **dims)
        self._staging = pool
        try:
            got = pool.alloc(n * P)
            if got is None:
                raise ValueError(f"node cache '{self.name}': the staging pool '{name}' has no "
                                 f"{n} free pages")
            self._slots = [int(i) for i in got.tolist()[::P]]
            shape = s._replace(layout=STAGING_LAYOUT)
            for slot in self._slots:
                view = pool._page_view(slot)
                if view is None:
                    raise ValueError(f"node cache '{self.name}': staging pool '{name}' page "
                                     f"{slot // P} has no view in this process")
                self._views.append(canonical(view, shape))
        except BaseException:
            self._close_staging()
            raise

    def _close_staging(self) -> None:
        """Unmaps and deletes the staging pool (idempotent). With the lock."""
        pool, self._staging, self._views, self._slots = self._staging, None, [], []
        if pool is None:
            return
        pool.close()
        try:
            self.client.delete_pool(pool.name)
        except NotFound:
            pass  # kvhostd restarted: gone with it
        except Exception as e:  # noqa: BLE001 (the pages are freed with the daemon)
            _log.warning("node cache '%s': staging pool '%s' not deleted: %s", self.name,
                         pool.name, e)

    # --- calls ---------------------------------------------------------------

    def present(self, keys: Sequence[str]) -> List[bool]:
        """Per key, whether it is published in the cache now."""
        out: List[bool] = []
        for i in range(0, len(keys), NodeCache.MAX_KEYS):
            found = self.cache.lookup(keys[i:i + NodeCache.MAX_KEYS])
            out += [s == KeyState.PRESENT for s in found.states]
        return out

    def prefix(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, are published."""
        n = 0
        for i in range(0, len(keys), NodeCache.MAX_KEYS):
            chunk = keys[i:i + NodeCache.MAX_KEYS]
            got = self.cache.lookup(chunk).prefix
            n += got
            if got < len(chunk):
                break
        return n

    def store_slots(self, keys: Sequence[str], slots: Sequence[int]) -> Outcome:
        """Stores each key's page from the host pool's page starting at
        slot `slots[i]`: zero-copy where :attr:`direct`, else staged."""
        if self.direct is None:
            return self.store(keys, [self.host_source(s) for s in slots])
        return self._turns(keys, lambda i, turn: self._store_direct(turn, slots[i:i + len(turn)]),
                           prefix=False)

    def restore_slots(self, keys: Sequence[str], slots: Sequence[int]) -> Outcome:
        """Restores the longest published prefix of `keys` into the host
        pool's pages starting at `slots`: zero-copy where :attr:`direct`
        (a failed copy may have written part of them), else staged."""
        if self.direct is None:
            return self.restore(keys, [self.host_target(s) for s in slots])
        return self._turns(keys,
                           lambda i, turn: self._restore_direct(turn, slots[i:i + len(turn)]),
                           prefix=True)

    def store(self, keys: Sequence[str], sources: Sequence[Any]) -> Outcome:
        """Stores each key's page from `sources` (sglang-shaped page tensors,
        or flat ones) through the staging pool, in turns of `pages` keys.
        Per key True once stored, or present or being stored by another
        caller already. A turn the daemon refuses, or whose copy fails,
        publishes none of its keys: they and the keys after them are False,
        and the error is returned (earlier turns stay stored)."""
        return self._turns(keys, lambda i, turn: self._store_turn(turn, sources[i:i + len(turn)]),
                           prefix=False)

    def restore(self, keys: Sequence[str], targets: Sequence[Any]) -> Outcome:
        """Restores the longest published prefix of `keys` into `targets`
        (per key a writable sglang-shaped page view, or a callable taking
        the canonical page to write it some other way) through the staging
        pool, in turns. Per key True once restored; the first False ends
        the prefix. A target is written only after its turn's copy ended
        well; the error that stopped it is returned (None for a plain miss)."""
        return self._turns(keys,
                           lambda i, turn: self._restore_turn(turn, targets[i:i + len(turn)]),
                           prefix=True)

    def _turns(self, keys: Sequence[str], turn_fn: Any, prefix: bool) -> Outcome:
        """Runs `turn_fn(first, keys)` over turns of `pages` keys; each
        returns how many of its keys were served (a restore: its prefix)."""
        done: List[bool] = []
        for i in range(0, len(keys), self.pages):
            turn = keys[i:i + self.pages]
            try:
                got = turn_fn(i, turn)
            except Exception as e:  # noqa: BLE001 (reported per key, with the error)
                return Outcome(done + [False] * (len(keys) - len(done)), e)
            done += [True] * got
            if prefix and got < len(turn):
                break
        return Outcome(done + [False] * (len(keys) - len(done)), None)

    def _store_direct(self, keys: Sequence[str], slots: Sequence[int]) -> int:
        assert self.direct is not None
        result = self.direct.store_from_pool(self.host.name,
                                             _token_slots(slots, self.shape.page_size), list(keys))
        if result.ticket is not None:
            result.ticket.wait(self.timeout)
        return len(keys)

    def _restore_direct(self, keys: Sequence[str], slots: Sequence[int]) -> int:
        assert self.direct is not None
        found = self.direct.lookup(list(keys), pin=True)
        k = found.prefix
        if k == 0:
            return 0
        try:
            tokens = _token_slots(slots[:k], self.shape.page_size)
            self.direct.restore_to_pool(self.host.name, tokens, list(keys[:k])).wait(self.timeout)
        finally:
            self.direct.release_pin(found.pin_id)
        return k

    def _store_turn(self, keys: Sequence[str], sources: Sequence[Any]) -> int:
        with self._lock:
            self._settle()
            slots = self._staged(len(keys))
            for j, page in enumerate(sources):
                self._views[j].copy_(canonical(page, self.shape))
            self.staged_pages += len(sources)
            result = self.cache.store_from_pool(self._staging.name, slots, list(keys))
            if result.ticket is not None:
                self._wait(result.ticket)
        return len(keys)

    def _restore_turn(self, keys: Sequence[str], targets: Sequence[Any]) -> int:
        with self._lock:
            self._settle()
            slots = self._staged(len(keys))
            found = self.cache.lookup(list(keys), pin=True)
            k = found.prefix
            if k == 0:
                return 0
            try:
                self._wait(self.cache.restore_to_pool(self._staging.name,
                                                      slots[:k * self.shape.page_size],
                                                      list(keys[:k])))
            finally:
                self.cache.release_pin(found.pin_id)
            for j in range(k):
                target = targets[j]
                if callable(target):
                    target(self._views[j])
                else:
                    canonical(target, self.shape).copy_(self._views[j])
            self.staged_pages += k
        return k

    def _staged(self, pages: int) -> List[int]:
        """The token slots of the first `pages` staging pages (opened on
        first use: a zero-copy lane stages flat pages only). With the lock."""
        if self._staging is None:
            self._open_staging()
        return _token_slots(self._slots[:pages], self.shape.page_size)

    def _wait(self, ticket: Any) -> None:
        """Waits for a copy of the staging slots. One that outlives the
        wait is kept: it may still read or write them, so the next turn
        waits for it first (_settle)."""
        try:
            ticket.wait(self.timeout)
        except DeadlineExceeded:
            self._running = ticket
            raise

    def _settle(self) -> None:
        """Waits for a copy an earlier turn gave up on (its own error does
        not matter now; DeadlineExceeded again if it still runs)."""
        if self._running is not None:
            try:
                self._running.wait(self.timeout)  # DeadlineExceeded passes up
            except DeadlineExceeded:
                raise
            except Exception:  # noqa: BLE001 (the turn it belonged to reported it)
                pass
            self._running = None

    def host_target(self, index: int) -> Any:
        """restore's target for host slot `index`: the page's view, or a
        writer through set_from_flat_data_page where the pool has none."""
        view = _host_page_view(self.host, index)
        if view is not None:
            return view
        torch, host, shape = self._torch, self.host, self.shape

        def write(rows: Any) -> None:
            flat = torch.empty(rows.numel(), dtype=shape.dtype)
            canonical(flat, shape).copy_(rows)
            host.set_from_flat_data_page(int(index), flat)
        return write

    def host_source(self, index: int) -> Any:
        """store's source for host slot `index` (sglang's page, a view)."""
        return self.host.get_data_page(int(index), flat=False)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (every component and layer)."""
        return self._page_bytes

    def close(self) -> None:
        """Unmaps and deletes the staging pool (idempotent); the cache and
        its pages stay."""
        with self._lock:
            self._close_staging()
