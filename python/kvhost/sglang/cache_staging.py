"""A host pool's pages in and out of a kvhostd node cache, through a
shared-memory staging attachment: the data path of
kvhost.sglang.storage_backend (sglang's HiCacheStorage on the node cache).

The node cache stores a key's page from ``page_size`` rows of a device pool
attached to the cache's pool, and restores into such rows
(kvhost.NodeCache). sglang's host pool is not such a device pool: its
memory is sglang's pinned buffer, or (kvhost.sglang's pools) a kvhostd pool
of its own. So a :class:`CacheStaging` owns a small device pool in shared
memory (kvhost.ShmDevicePool, ``staging_pages`` pages) attached to the
cache's pool within its client's worker session, and moves each page once
in this process: a store copies the host pages into staging rows and has
kvhostd store them under their keys; a restore has kvhostd load the keys'
pages into staging rows and copies them into the host pages only once the
load has ended well, so a failed restore leaves the host pool as it was.

Page format: the cache's pages are device rows, a layout of their own, so
a page stored from a host pool of one layout restores into another's. Each
host page is read through sglang's ``get_data_page(index, flat=False)`` (a
view: sglang's pools slice their buffer, kvhost's map kvhostd's page) and
seen as ``(components, layers, page_size, heads, dim)`` (MHA: K then V;
MLA: one latent component of one head) by :func:`canonical`; the staging
buffer has that shape over all its rows. MHA in ``layer_first``,
``page_first``, ``page_first_direct``, ``page_head`` and MLA in the first
three; other kinds and layouts are refused at construction, naming them.

The cache is created when absent (``node_cache``, the host pool's shape,
the client's owner token) and adopted when present only if that token
protects it and its shape is the host pool's (kvhost.pools.adopt_pool;
ValueError naming the field that differs). Thread safety: one lock
serialises the calls that use the staging rows; lookups take none.
Needs torch and a kvhostd on the host backend (shared-memory device pools;
ValueError naming the backend otherwise).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from .._arrays import raw_view
from ..cache import KeyState, NodeCache
from ..errors import AlreadyExists, DeadlineExceeded
from ..pools import adopt_pool
from .host_pool import HostKVCache
from .spec import dtype_enum

#: sglang's layouts each kind's pages are staged from.
LAYOUTS = {"MHA": ("layer_first", "page_first", "page_first_direct", "page_head"),
           "MLA": ("layer_first", "page_first", "page_first_direct")}
#: The cache pool's own layout: its pages are device rows to every caller,
#: so any page-major layout serves; kvhostd has it for both kinds.
CACHE_LAYOUT = "PAGE_FIRST"


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


class CacheStaging:
    """One node cache, its staging attachment and the host pool it serves.

    Args:
      client: a kvhost.Client with a worker session and the cache's owner
        token; it must outlive this object.
      cache: the cache's pool name.
      host: the sglang host pool (sglang's or kvhost.sglang's) whose pages
        move.
      staging_pages: pages the staging rows hold (a call of more moves them
        in turns).
      cache_size_tokens: the cache's size when this call creates it.
      timeout: seconds to wait for a store or restore.
    Raises ValueError for a host pool it cannot stage (naming why) or a
    cache of another shape or a kvhostd whose backend is not the host
    backend, and the daemon's errors (PermissionDenied for a cache another
    token protects).
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
        self._device: Any = None
        self._att: Any = None
        self._running: Any = None
        self._size_tokens, self.pages = int(cache_size_tokens), int(staging_pages)
        self._open_cache(self._size_tokens)
        self._attach(self.pages)

    def reopen(self) -> None:
        """After the client's session was lost (kvhostd restarted: the
        cache and the staging attachment are gone): the cache made again
        (empty) or adopted, and new staging rows attached."""
        with self._lock:
            self.close()
            self._running = None
            self._open_cache(self._size_tokens)
            self._attach(self.pages)

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

    def _attach(self, pages: int) -> None:
        P, shape = self.shape.page_size, self.shape
        backend = self.client.daemon_status().get("backend")
        if backend != "host":
            raise ValueError(f"node cache '{self.name}': kvhostd at {self.client.address} runs "
                             f"the {backend} backend; the staging rows are a shared-memory "
                             f"device pool, which only --backend=host has (the cuda backend's "
                             f"staging is not built yet)")
        self._device = self.client.shm_device_pool(self.name, pages * P)
        try:
            self._att = self.client.attach_shm(self.name, self._device)
            self.rows = self._staging_tensor(pages * P)
        except BaseException:
            self.close()
            raise
        self._page_bytes = int(shape.components * shape.layer_num * P * shape.heads * shape.dim
                               * self.rows.element_size())

    def _staging_tensor(self, rows: int) -> Any:
        """The staging rows as one ``(components, layers, rows, heads, dim)``
        tensor of the host dtype: kvhost.ShmDevicePool lays each
        component's layers out back to back, components one after another
        (checked here against every buffer's address)."""
        torch, dev, s = self._torch, self._device, self.shape
        row_bytes = s.heads * s.dim * torch.empty((), dtype=s.dtype).element_size()
        comps = [c.name for c in dev.components]
        layer_bytes = rows * row_bytes
        base = dev.layer_address(comps[0], 0)
        for ci, comp in enumerate(comps):
            c = dev.component(comp)
            if (c.rows, c.row_bytes, c.row_tokens) != (rows, row_bytes, 1) or dev.layers != \
                    s.layer_num:
                raise ValueError(f"node cache '{self.name}': staging component {comp!r} has "
                                 f"{c.rows} rows of {c.row_bytes} bytes over {dev.layers} "
                                 f"layers, not {rows} of {row_bytes} over {s.layer_num}")
            for layer in range(dev.layers):
                want = base + (ci * dev.layers + layer) * layer_bytes
                if dev.layer_address(comp, layer) != want:
                    raise ValueError(f"node cache '{self.name}': staging buffer {comp!r} "
                                     f"layer {layer} is not where the layout puts it")
        flat = torch.frombuffer(raw_view(base, len(comps) * dev.layers * layer_bytes, dev),
                                dtype=torch.uint8).view(s.dtype)
        return flat.view(len(comps), dev.layers, rows, s.heads, s.dim)

    def _slot(self, i: int) -> Any:
        P = self.shape.page_size
        return self.rows[:, :, i * P:(i + 1) * P]

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

    def store(self, keys: Sequence[str], sources: Sequence[Any]) -> Outcome:
        """Stores each key's page from `sources` (sglang-shaped page tensors,
        or flat ones), in turns of `pages` keys. Per key True once stored,
        or present or being stored by another caller already. A turn the
        daemon refuses, or whose copy fails, publishes none of its keys:
        they and the keys after them are False, and the error is returned
        (earlier turns stay stored)."""
        done: List[bool] = []
        for i in range(0, len(keys), self.pages):
            try:
                done += self._store_turn(keys[i:i + self.pages], sources[i:i + self.pages])
            except Exception as e:  # noqa: BLE001 (reported per key, with the error)
                return Outcome(done + [False] * (len(keys) - len(done)), e)
        return Outcome(done, None)

    def _store_turn(self, keys: Sequence[str], sources: Sequence[Any]) -> List[bool]:
        with self._lock:
            self._settle()
            for j, page in enumerate(sources):
                self._slot(j).copy_(canonical(page, self.shape))
            P = self.shape.page_size
            result = self.cache.store(self._att, list(keys), list(range(len(keys) * P)))
            if result.ticket is not None:
                self._wait(result.ticket)
        return [True] * len(keys)

    def restore(self, keys: Sequence[str], targets: Sequence[Any]) -> Outcome:
        """Restores the longest published prefix of `keys` into `targets`
        (per key a writable sglang-shaped page view, or a callable taking
        the canonical page to write it some other way), in turns. Per key
        True once restored; the first False ends the prefix. A target is
        written only after its turn's load ended well; the error that
        stopped it is returned (None for a plain miss)."""
        done: List[bool] = []
        for i in range(0, len(keys), self.pages):
            turn = keys[i:i + self.pages]
            try:
                got = self._restore_turn(turn, targets[i:i + self.pages])
            except Exception as e:  # noqa: BLE001
                return Outcome(done + [False] * (len(keys) - len(done)), e)
            done += [True] * got
            if got < len(turn):
                break
        return Outcome(done + [False] * (len(keys) - len(done)), None)

    def _restore_turn(self, keys: Sequence[str], targets: Sequence[Any]) -> int:
        with self._lock:
            self._settle()
            found = self.cache.lookup(list(keys), pin=True)
            k = found.prefix
            if k == 0:
                return 0
            P = self.shape.page_size
            try:
                self._wait(self.cache.restore(self._att, list(keys[:k]), list(range(k * P))))
            finally:
                self.cache.release_pin(found.pin_id)
            for j in range(k):
                target = targets[j]
                if callable(target):
                    target(self._slot(j))
                else:
                    canonical(target, self.shape).copy_(self._slot(j))
        return k

    def _wait(self, ticket: Any) -> None:
        """Waits for a transfer of the staging rows. One that outlives the
        wait is kept: it may still read or write the rows, so the next
        turn waits for it first (_settle)."""
        try:
            ticket.wait(self.timeout)
        except DeadlineExceeded:
            self._running = ticket
            raise

    def _settle(self) -> None:
        """Waits for a transfer an earlier turn gave up on (its own error
        does not matter now; DeadlineExceeded again if it still runs)."""
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
        """Detaches and unmaps the staging rows (idempotent); the cache and
        its pages stay."""
        att, dev, self._att, self._device = self._att, self._device, None, None
        if att is not None:
            att.__exit__(None, None, None)
        if dev is not None:
            self.rows = None
            dev.close()
