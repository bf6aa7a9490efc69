"""The L3 tier from Python: pages of a pool stored in and fetched from a
cache shared by many nodes (kvhostd --l3-memcached), by the scheduler's page
keys, as sglang HiCache's storage backends do (batch_set / batch_get /
batch_exists).

:class:`StorageCalls` is mixed into :class:`kvhost.Client`. Keys are bytes
or str (UTF-8), 1 to 112 bytes each. A store or fetch returns a
:class:`PagesResult`: one :class:`PageOutcome` per page, in order, and the
count stored or hit; a miss is an outcome, never an exception. The
``start_*`` calls return a ticket at once, and :meth:`StorageCalls.l3_wait`
returns its results (again when asked again).

Errors are the daemon's: FailedPrecondition without an L3 tier (or for a
page not allocated), InvalidArgument for a bad key or index, NotFound for a
pool or ticket, PermissionDenied without the pool's owner token,
ResourceExhausted over the daemon's pages-in-flight bound. A refused call
stores or writes nothing.
"""

from __future__ import annotations

import ctypes as C
import enum
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from . import _arrays, _lib

#: A page key: bytes, or str sent as UTF-8.
Key = _arrays.Key


class PageOutcome(enum.IntEnum):
    """What became of one page (kvhost.v1.PageOutcome, KVHOST_PAGE_*)."""

    STORED = 1
    HIT = 2
    MISS = 3
    CORRUPT = 4
    SHAPE_MISMATCH = 5
    UNAVAILABLE = 6


class PagesResult(NamedTuple):
    """A store's or fetch's pages."""

    #: One per page, in the order given.
    outcomes: List[PageOutcome]
    #: Pages stored (a store) or hit (a fetch).
    good_pages: int


def _outcomes(arr: "C.Array[C.c_int32]", n: int) -> List[PageOutcome]:
    return [PageOutcome(arr[i]) for i in range(n)]


def _pool(name: str) -> bytes:
    return _lib.text(name, "pool name")


class StorageCalls:
    """L3 calls of a Client (mixed in)."""

    def _handle(self) -> C.c_void_p:  # provided by Client
        raise NotImplementedError

    def _page_args(self, indices: Any, keys: Sequence[Key]) -> Tuple[Any, ...]:
        ptr, n, keep = _arrays.int64_arg(indices)
        kptrs, klens, nk, kkeep = _arrays.keys_arg(keys)
        if n != nk:
            raise ValueError(f"{nk} keys for {n} indices; give one key per page")
        return ptr, kptrs, klens, n, (keep, kkeep)

    def l3_store(self, pool: str, indices: Any, keys: Sequence[Key]) -> PagesResult:
        """Writes the pages whose first slots are `indices` to L3 under `keys`
        (one per page); PageOutcome.STORED or UNAVAILABLE per page."""
        ptr, kptrs, klens, n, keep = self._page_args(indices, keys)
        out = (C.c_int32 * max(n, 1))()
        good = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_l3_store, self._handle(), _pool(pool), ptr, kptrs, klens, n,
                  out, C.byref(good))
        del keep
        return PagesResult(_outcomes(out, n), int(good.value))

    def l3_fetch(self, pool: str, keys: Sequence[Key], indices: Any) -> PagesResult:
        """Reads the pages stored under `keys` into the allocated pages whose
        first slots are `indices` (none twice); HIT, MISS, CORRUPT or
        SHAPE_MISMATCH per page. Only a HIT page is written."""
        ptr, kptrs, klens, n, keep = self._page_args(indices, keys)
        out = (C.c_int32 * max(n, 1))()
        good = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_l3_fetch, self._handle(), _pool(pool), kptrs, klens, ptr, n,
                  out, C.byref(good))
        del keep
        return PagesResult(_outcomes(out, n), int(good.value))

    def l3_exist(self, pool: str, keys: Sequence[Key]) -> int:
        """How many of `keys`, from the first, are stored in L3 in `pool`'s
        namespace (its owner token's; the public one for an unprotected pool)."""
        kptrs, klens, n, keep = _arrays.keys_arg(keys)
        prefix = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_l3_exist, self._handle(), _pool(pool), kptrs, klens, n,
                  C.byref(prefix))
        del keep
        return int(prefix.value)

    def _started(self, ticket: int, pages: int) -> int:
        # The pages of each ticket this client started: l3_wait's room.
        self.__dict__.setdefault("_l3_ticket_pages", {})[ticket] = pages
        return ticket

    def l3_start_store(self, pool: str, indices: Any, keys: Sequence[Key]) -> int:
        """l3_store detached: its ticket, at once (results from l3_wait)."""
        ptr, kptrs, klens, n, keep = self._page_args(indices, keys)
        ticket = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_l3_start_store, self._handle(), _pool(pool), ptr, kptrs,
                  klens, n, C.byref(ticket))
        del keep
        return self._started(int(ticket.value), n)

    def l3_start_fetch(self, pool: str, keys: Sequence[Key], indices: Any) -> int:
        """l3_fetch detached: its ticket, at once (results from l3_wait)."""
        ptr, kptrs, klens, n, keep = self._page_args(indices, keys)
        ticket = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_l3_start_fetch, self._handle(), _pool(pool), kptrs, klens,
                  ptr, n, C.byref(ticket))
        del keep
        return self._started(int(ticket.value), n)

    def l3_wait(self, pool: str, ticket: int, poll: bool = False,
                pages: Optional[int] = None) -> Optional[PagesResult]:
        """A detached call's results: blocks until its pages are done (the
        client's timeout), or with `poll` returns None while they are not.
        The ticket stays: a second wait returns the same. `pages`: room for
        that many outcomes; by default the count this client started the
        ticket with (65536 otherwise)."""
        started = self.__dict__.get("_l3_ticket_pages", {})
        room = pages if pages is not None else started.get(int(ticket), 1 << 16)
        out = (C.c_int32 * max(room, 1))()
        done = C.c_int32(0)
        count = C.c_size_t(0)
        good = C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_l3_wait, self._handle(), _pool(pool), int(ticket),
                  1 if poll else 0, C.byref(done), out, room, C.byref(count), C.byref(good))
        if not done.value:
            return None
        started.pop(int(ticket), None)
        return PagesResult(_outcomes(out, int(count.value)), int(good.value))
