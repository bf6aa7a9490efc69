"""Pools, groups, slots and pages: the scheduler's calls.

:class:`PoolCalls` is mixed into :class:`kvhost.Client`. Its names follow
sglang's HostKVCache where it has one (``alloc``, ``free``,
``available_size``, ``get_page_buffer_meta``, ``get_data_page``,
``set_from_flat_data_page``); ``read_pages`` / ``write_pages`` move many
pages in one stream. Pools and groups come back as dicts, the
protobuf JSON mapping of kvhost.v1.Pool / PoolGroup with snake_case keys and
every field present, except that 64-bit integers are ints (kvhost._json).

A group's name works wherever a pool's does for slots and pages: it acts on
the group's anchor pool.

Errors are the daemon's, as exceptions: a pool that does not exist is
NotFound naming it, a malformed spec InvalidArgument naming the field, an
alloc beyond the free slots ResourceExhausted, a double free
FailedPrecondition.
"""

from __future__ import annotations

import ctypes as C
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union, cast

from . import _arrays, _json, _lib
from .errors import FailedPrecondition, PermissionDenied, StatusCode, raise_for

#: A spec: a mapping (sent as JSON) or JSON text.
Spec = Union[Mapping[str, Any], str, bytes]
#: Slot indices: a list or numpy array of int64 (see alloc).
Indices = Any

#: How long adopt_pool waits for a pool that another client is still
#: creating (populating many GiB of host memory takes seconds to minutes).
ADOPT_WAIT_S = 300.0
_ADOPT_POLL_S = 0.05

#: First guess for a page's bytes, before a pool's size is known; a bigger
#: page costs one retry, and the size is remembered per pool after that.
_PAGE_GUESS = 64 << 10


def _name(name: str, what: str = "pool") -> bytes:
    return _lib.text(name, f"{what} name")


class PoolCalls:
    """Pool, group, slot and page calls of a Client (mixed in)."""

    def _init_pool_calls(self) -> None:
        # Page sizes seen, per pool name: get_data_page's first buffer.
        self._page_bytes: Dict[str, int] = {}
        self._page_lock = threading.Lock()

    def _handle(self) -> C.c_void_p:  # provided by Client
        raise NotImplementedError

    # --- pools --------------------------------------------------------------

    def create_pool(self, name: str, spec: Spec) -> Dict[str, Any]:
        """Creates pool `name` from a kvhost.v1.PoolSpec and returns the pool.

        `spec` is a dict (snake_case or lowerCamelCase keys), e.g.
        ``{"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16",
        "page_size": 4, "layer_num": 3, "head_num": 2, "head_dim": 8,
        "size_tokens": 64}``, or the same as JSON text.

        Raises InvalidArgument (a malformed spec, naming the field),
        AlreadyExists, ResourceExhausted (not enough host memory).
        """
        _lib.call(_lib.lib().kvhost_pool_create, self._handle(), _name(name),
                  _json.dumps(spec, "spec"))
        return self.get_pool(name)

    def get_pool(self, name: str) -> Dict[str, Any]:
        """kvhost.v1.Pool as a dict: spec, size_tokens, available_tokens,
        components, region_paths, state... NotFound naming `name`."""
        text = _lib.call_out(_lib.lib().kvhost_pool_get_json, self._handle(), _name(name))
        return cast(Dict[str, Any], _json.loads(text))

    def list_pools(self) -> List[Dict[str, Any]]:
        """Every pool, as get_pool gives each."""
        listed = _json.loads(_lib.call_out(_lib.lib().kvhost_pool_list_json, self._handle()))
        return list(listed.get("pools", []))

    def delete_pool(self, name: str) -> int:
        """Deletes pool `name`; returns the host bytes it gave back."""
        released = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_pool_delete, self._handle(), _name(name), C.byref(released))
        self._forget_page_bytes(name)
        return int(released.value)

    def available_size(self, pool: str) -> int:
        """Token slots of `pool` not allocated now (HostKVCache.available_size)."""
        return int(self.get_pool(pool)["available_tokens"])

    def pool(self, name: str) -> "Pool":
        """A Pool view of `name`: these calls with the name bound."""
        return Pool(self, name)

    # --- groups -------------------------------------------------------------

    def create_group(self, name: str, spec: Spec) -> Dict[str, Any]:
        """Creates group `name` and returns it.

        `spec` is a kvhost.v1.CreatePoolGroupRequest without its name:
        ``{"layer_num": L, "entries": [{"name": "kv", "pool": "attn",
        "layer_map": [...], "anchor": True}, ...]}``. NotFound for an entry's
        pool that does not exist.
        """
        _lib.call(_lib.lib().kvhost_group_create, self._handle(), _name(name, "group"),
                  _json.dumps(spec, "spec"))
        return self.get_group(name)

    def get_group(self, name: str) -> Dict[str, Any]:
        """kvhost.v1.PoolGroup as a dict. NotFound naming `name`."""
        text = _lib.call_out(_lib.lib().kvhost_group_get_json, self._handle(),
                             _name(name, "group"))
        return cast(Dict[str, Any], _json.loads(text))

    def delete_group(self, name: str) -> None:
        """Deletes group `name` (its pools stay)."""
        _lib.call(_lib.lib().kvhost_group_delete, self._handle(), _name(name, "group"))

    # --- slots --------------------------------------------------------------

    def claim_pool(self, name: str, instance_id: str) -> Dict[str, Any]:
        """Makes sglang instance `instance_id` the one owner of pool `name`
        (PoolService.ClaimPool), within this client's worker session.

        Returns {"generation", "reclaimed_tokens", "renewed"}: a takeover
        (no live holder: the previous scheduler exited, was killed, or
        kvhostd restarted) bumps the generation and frees every allocated
        slot; the caller's own live claim is renewed and frees nothing.
        Raises FailedPrecondition naming the holder when another live
        session holds the pool (a second owner is refused), or when the
        client has no session; Unavailable while transfers still use the
        pool's slots (retry). While held, other sessions' alloc and free
        of the pool are refused; the claim ends with this client's session.
        """
        generation, reclaimed, renewed = C.c_uint64(0), C.c_uint64(0), C.c_int32(0)
        _lib.call(_lib.lib().kvhost_pool_claim, self._handle(), _name(name),
                  _lib.text(instance_id, "instance id"), C.byref(generation), C.byref(reclaimed),
                  C.byref(renewed))
        return {"generation": int(generation.value), "reclaimed_tokens": int(reclaimed.value),
                "renewed": bool(renewed.value)}

    def alloc(self, pool: str, num_tokens: int, *, numpy: Optional[bool] = None) -> Indices:
        """Allocates `num_tokens` slots (whole pages) of `pool`.

        Returns their indices as a numpy int64 array when numpy is installed
        (or numpy=True), else a list of ints (or numpy=False). Raises
        InvalidArgument for a count that is not whole pages,
        ResourceExhausted when the pool has fewer free slots.
        """
        as_numpy = _arrays.want_numpy(numpy)
        n = int(num_tokens)
        if n < 0:
            raise ValueError(f"num_tokens {n} is negative")
        out = (C.c_int64 * max(n, 1))()
        count = C.c_size_t(0)
        _lib.call(_lib.lib().kvhost_alloc, self._handle(), _name(pool), n, out, n,
                  C.byref(count))
        return _arrays.int64_result(out, int(count.value), as_numpy)

    def alloc_batch(self, pool: str, num_tokens: Sequence[int], *,
                    numpy: Optional[bool] = None) -> List[Indices]:
        """Allocates several runs of `pool` in one call, all or nothing: run i
        is num_tokens[i] slots (whole pages), as a scheduler does for many
        requests at once. Returns one Indices per run (as alloc's); a single
        free of them all gives them back. Raises InvalidArgument for a count
        that is not whole pages, ResourceExhausted when the pool has fewer
        free slots than the sum (then nothing is allocated).
        """
        as_numpy = _arrays.want_numpy(numpy)
        sizes = [int(n) for n in num_tokens]
        for i, n in enumerate(sizes):
            if n < 0:
                raise ValueError(f"num_tokens[{i}] = {n} is negative")
        total = sum(sizes)
        wanted = (C.c_uint64 * max(len(sizes), 1))(*sizes)
        out = (C.c_int64 * max(total, 1))()
        count = C.c_size_t(0)
        _lib.call(_lib.lib().kvhost_alloc_batch, self._handle(), _name(pool), wanted,
                  len(sizes), out, total, C.byref(count))
        runs: List[Indices] = []
        start = 0
        for n in sizes:
            runs.append(_arrays.int64_result(out, n, as_numpy, start=start))
            start += n
        return runs

    def free(self, pool: str, indices: Indices) -> int:
        """Frees whole pages of slots, all or nothing; returns the slots freed.

        FailedPrecondition for a slot that is not allocated (nothing freed).
        """
        ptr, n, keep = _arrays.int64_arg(indices)
        freed = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_free, self._handle(), _name(pool), ptr, n, C.byref(freed))
        del keep
        return int(freed.value)

    # --- pages --------------------------------------------------------------

    def get_page_buffer_meta(self, pool: str, indices: Indices) -> Dict[str, Any]:
        """kvhost.v1.PageBufferMeta of whole pages' slots, as a dict: where
        each page's bytes lie in the pool's region files (for zero-copy
        storage backends). InvalidArgument unless len(indices) is whole pages.
        """
        ptr, n, keep = _arrays.int64_arg(indices)
        text = _lib.call_out(_lib.lib().kvhost_page_buffer_meta_json, self._handle(),
                             _name(pool), ptr, n)
        del keep
        return cast(Dict[str, Any], _json.loads(text))

    def page_shape(self, pool: str) -> Dict[str, Any]:
        """kvhost.v1.PageShape as a dict: the flat page's parts (component,
        dims, dtype, bytes) and its bytes, as kvhostd lays the pool out."""
        text = _lib.call_out(_lib.lib().kvhost_page_shape_json, self._handle(), _name(pool))
        return cast(Dict[str, Any], _json.loads(text))

    def stride_alignment(self, pool: str, alignment: int = 0) -> Dict[str, Any]:
        """kvhost.v1.StrideAlignment as a dict: ``aligned``, whether every
        component's page blocks start on `alignment` bytes (a power of two;
        0: 4096; never for LAYER_FIRST), and each component's page stride."""
        text = _lib.call_out(_lib.lib().kvhost_stride_alignment_json, self._handle(),
                             _name(pool), int(alignment))
        return cast(Dict[str, Any], _json.loads(text))

    def contiguous_buffer_infos(self, pool: str) -> Dict[str, Any]:
        """kvhost.v1.ContiguousBufferInfos as a dict: one contiguous range
        per layer and component of a LAYER_FIRST pool (region_index, offset,
        length, item_bytes) and the region files."""
        text = _lib.call_out(_lib.lib().kvhost_contiguous_buffer_infos_json, self._handle(),
                             _name(pool))
        return cast(Dict[str, Any], _json.loads(text))

    def _forget_page_bytes(self, pool: str) -> None:
        with self._page_lock:
            self._page_bytes.pop(pool, None)

    def get_data_page(self, pool: str, index: int, out: Any = None) -> Union[bytes, int]:
        """The flat bytes of the page whose first slot is `index`.

        Without `out`, returns them as bytes. With `out` (a writable buffer:
        bytearray, numpy array, memoryview), writes them there and returns
        their count; OutOfRange when `out` is smaller than the page.
        """
        lib, client, name = _lib.lib(), self._handle(), _name(pool)
        if out is not None:
            ptr, length, keep = _arrays.writable(out)
            size = C.c_size_t(0)
            _lib.call(lib.kvhost_get_data_page, client, name, int(index), ptr, length,
                      C.byref(size))
            del keep
            return int(size.value)
        with self._page_lock:
            guess = self._page_bytes.get(pool, _PAGE_GUESS)
        for _ in range(2):
            buf = C.create_string_buffer(guess)
            size = C.c_size_t(0)
            rc, msg = _lib.call_status(lib.kvhost_get_data_page, client, name, int(index), buf,
                                       guess, C.byref(size))
            if rc == 0:
                with self._page_lock:
                    self._page_bytes[pool] = int(size.value)
                return buf.raw[: size.value]
            if rc == _lib._OUT_OF_RANGE and size.value > guess:
                guess = int(size.value)
                continue
            raise_for(rc, msg)
        raise_for(_lib._OUT_OF_RANGE, f"page of pool '{pool}' kept growing")
        raise AssertionError("unreachable")

    def set_from_flat_data_page(self, pool: str, index: int, data: Any) -> None:
        """Writes one flat page (exactly the page's bytes) at slot `index`.

        `data` is bytes or any buffer (bytearray, memoryview, numpy array);
        InvalidArgument when its size is not the page's.
        """
        ptr, length, keep = _arrays.readable(data)
        _lib.call(_lib.lib().kvhost_set_from_flat_data_page, self._handle(), _name(pool),
                  int(index), ptr, length)
        del keep

    def read_pages(self, pool: str, indices: Indices, *, out: Any = None,
                   numpy: bool = False, chunk_bytes: int = 0) -> Union[List[bytes], Any, int]:
        """Many flat pages in one stream (ReadPages): the pages whose first
        slots are `indices` (no page twice), in that order.

        Returns a list of bytes, one per page; with numpy=True one uint8
        array of shape (len(indices), page_bytes). With `out` (a writable
        buffer: bytearray, numpy array), writes the pages there back to back
        and returns their byte count; OutOfRange, before anything is read,
        when `out` is smaller. `chunk_bytes` bounds the stream's chunks (0:
        the daemon's 4 MiB). FailedPrecondition for a page that is not
        allocated, InvalidArgument for one that is not a page start.
        """
        lib, client, name = _lib.lib(), self._handle(), _name(pool)
        ptr, n, keep = _arrays.int64_arg(indices)
        chunk = int(chunk_bytes)
        if out is not None:
            dst, length, keep_out = _arrays.writable(out)
            size = C.c_size_t(0)
            _lib.call(lib.kvhost_read_pages, client, name, ptr, n, chunk, dst, length,
                      C.byref(size))
            del keep, keep_out
            return int(size.value)
        if numpy:
            np = _arrays.numpy()
            if np is None:
                raise ImportError("numpy=True, but numpy is not installed")
        # A page size seen before sizes the buffer; else the ABI is asked
        # (a short buffer is refused before any page is read).
        with self._page_lock:
            guess = self._page_bytes.get(pool, 0) * n
        for _ in range(3):
            buf = C.create_string_buffer(max(guess, 1))
            size = C.c_size_t(0)
            rc, msg = _lib.call_status(lib.kvhost_read_pages, client, name, ptr, n, chunk, buf,
                                       guess, C.byref(size))
            if rc == 0:
                break
            if rc == _lib._OUT_OF_RANGE and size.value > guess:
                guess = int(size.value)
                continue
            raise_for(rc, msg)
        else:
            raise_for(_lib._OUT_OF_RANGE, f"pages of pool '{pool}' kept growing")
        del keep
        total = int(size.value)
        page = total // n if n else 0
        if n:
            with self._page_lock:
                self._page_bytes[pool] = page
        if numpy:
            return np.frombuffer(buf.raw[:total], dtype=np.uint8).reshape(n, page).copy()
        raw = buf.raw
        return [raw[i * page:(i + 1) * page] for i in range(n)]

    def write_pages(self, pool: str, indices: Indices, pages: Any, *,
                    chunk_bytes: int = 0) -> int:
        """Many flat pages in one stream (WritePages): page i to the page
        whose first slot is indices[i]; returns the pages written.

        `pages` is a sequence of one buffer per page (bytes, bytearray,
        numpy arrays), or one buffer holding them back to back (bytes, a
        numpy array of shape (len(indices), page_bytes)). Its size must be
        exactly len(indices) pages: InvalidArgument with both sizes, before
        anything is sent. The daemon checks each page as it arrives
        (allocated, a page start); on such a refusal the pages before it
        stay written, and the message says how many.
        """
        ptr, n, keep = _arrays.int64_arg(indices)
        if isinstance(pages, (list, tuple)):
            if len(pages) != n:
                raise ValueError(f"{n} indices but {len(pages)} pages")
            data: Any = b"".join(_arrays.to_bytes(page, f"pages[{i}]")
                                 for i, page in enumerate(pages))
        else:
            data = pages
        src, length, keep_data = _arrays.readable(data, "pages")
        written = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_write_pages, self._handle(), _name(pool), ptr, n, src, length,
                  int(chunk_bytes), C.byref(written))
        del keep, keep_data
        return int(written.value)


class Pool:
    """One pool by name, with sglang HostKVCache's calls bound to it.

    ``client.pool("p").alloc(64)`` is ``client.alloc("p", 64)``. Holds no
    handle and makes no call until used; the pool need not exist yet.
    """

    def __init__(self, client: PoolCalls, name: str) -> None:
        self.client = client
        self.name = name

    def info(self) -> Dict[str, Any]:
        """kvhost.v1.Pool as a dict (Client.get_pool)."""
        return self.client.get_pool(self.name)

    def delete(self) -> int:
        """Deletes the pool; the host bytes it gave back."""
        return self.client.delete_pool(self.name)

    def available_size(self) -> int:
        """Token slots not allocated now."""
        return self.client.available_size(self.name)

    def alloc(self, num_tokens: int, *, numpy: Optional[bool] = None) -> Indices:
        """Allocates whole pages of slots (Client.alloc)."""
        return self.client.alloc(self.name, num_tokens, numpy=numpy)

    def alloc_batch(self, num_tokens: Sequence[int], *,
                    numpy: Optional[bool] = None) -> List[Indices]:
        """Several runs in one call, all or nothing (Client.alloc_batch)."""
        return self.client.alloc_batch(self.name, num_tokens, numpy=numpy)

    def free(self, indices: Indices) -> int:
        """Frees whole pages of slots; the slots freed."""
        return self.client.free(self.name, indices)

    def get_page_buffer_meta(self, indices: Indices) -> Dict[str, Any]:
        """Where whole pages' bytes lie (Client.get_page_buffer_meta)."""
        return self.client.get_page_buffer_meta(self.name, indices)

    def get_data_page(self, index: int, out: Any = None) -> Union[bytes, int]:
        """One flat page's bytes (Client.get_data_page)."""
        return self.client.get_data_page(self.name, index, out)

    def set_from_flat_data_page(self, index: int, data: Any) -> None:
        """Writes one flat page (Client.set_from_flat_data_page)."""
        self.client.set_from_flat_data_page(self.name, index, data)

    def read_pages(self, indices: Indices, **kw: Any) -> Union[List[bytes], Any, int]:
        """Many flat pages in one stream (Client.read_pages)."""
        return self.client.read_pages(self.name, indices, **kw)

    def write_pages(self, indices: Indices, pages: Any, **kw: Any) -> int:
        """Many flat pages in one stream (Client.write_pages)."""
        return self.client.write_pages(self.name, indices, pages, **kw)

    def __repr__(self) -> str:
        return f"kvhost.Pool({self.name!r})"


# --- adopting a pool or group that exists ----------------------------------


def _refuse(what: str, name: str, why: str) -> PermissionDenied:
    return PermissionDenied(
        StatusCode.PERMISSION_DENIED,
        f"{what} '{name}' already exists and {why}: refusing to adopt it (another local user "
        f"may have created it to read or write this client's KV; delete it, or give every "
        f"client that shares it the same owner token: Client(owner_token=...) or "
        f"KVHOST_OWNER_TOKEN)")


def _ready_pool(client: PoolCalls, name: str, wait: float) -> Dict[str, Any]:
    """GetPool of `name` once it is READY (another rank may be creating it)."""
    deadline = time.monotonic() + wait
    while True:
        info = client.get_pool(name)
        if info.get("state") != "CREATING":
            return info
        if time.monotonic() >= deadline:
            raise FailedPrecondition(StatusCode.FAILED_PRECONDITION,
                                     f"pool '{name}' is still being created after {wait:g} s: "
                                     f"not adopted")
        time.sleep(_ADOPT_POLL_S)


def adopt_pool(client: PoolCalls, name: str, *, wait: float = ADOPT_WAIT_S) -> Dict[str, Any]:
    """Pool `name`, which exists already (CreatePool said AlreadyExists), as
    get_pool gives it, if this client may use it as its own: the one rule of
    every helper that "creates or reuses" a pool (kvhost.sglang's pools).

    A pool is adopted only when it is owner-protected and the client's
    owner token opens it: a pool squatted under the name (no token, or
    another one) would let its creator read and write every page put in it,
    and delete or replace it at will. The proof is one GetPool reply, so no
    pool can be swapped in between: owner_protected, and its region files
    named (GetPool names a protected pool's files only to its token holder).
    A pool with no region files (LOGICAL: slots only, no bytes) is proved
    by a token-gated call that must succeed (GetPageBufferMeta of one page)
    followed by a GetPool that still says protected. A pool still CREATING is waited for,
    up to `wait` seconds. The token is only ever sent as the client's own.

    Raises PermissionDenied naming the pool and the risk when the proof
    fails, FailedPrecondition when it stays CREATING, NotFound when it went.
    """
    info = _ready_pool(client, name, wait)
    if not info.get("owner_protected"):
        raise _refuse("pool", name, "is not protected by an owner token")
    if info.get("region_paths"):
        return info
    if info.get("spec", {}).get("kind") != "LOGICAL":
        raise _refuse("pool", name, "is not protected by this client's owner token")
    try:  # one page's slots (they need not be allocated): OK only with the token
        client.get_page_buffer_meta(name, list(range(int(info["spec"]["page_size"]))))
    except PermissionDenied:
        raise _refuse("pool", name, "is not protected by this client's owner token") from None
    info = _ready_pool(client, name, wait)
    if not info.get("owner_protected"):
        raise _refuse("pool", name, "is not protected by an owner token")
    return info


def adopt_group(client: PoolCalls, name: str, *, wait: float = ADOPT_WAIT_S) -> Dict[str, Any]:
    """Group `name`, which exists already, as get_group gives it, if every
    entry's pool passes adopt_pool: a group names its pools for life (a pool
    in a group cannot be deleted) and creating one that names a protected
    pool needs that pool's token, so a group of pools that are this
    client's was made by a holder of its token. PermissionDenied otherwise.
    """
    info = client.get_group(name)
    for entry in info.get("entries", []):
        try:
            adopt_pool(client, entry["pool"], wait=wait)
        except PermissionDenied:
            raise _refuse("group", name, f"its entry '{entry['name']}' (pool '{entry['pool']}') "
                          f"is not protected by this client's owner token") from None
    return info
