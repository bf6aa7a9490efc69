#!/usr/bin/env python3
"""The node cache from Python (kvhost.NodeCache over kvhost_cache_*) against
a host-backend kvhostd, as engine instances use it.

Two instances (clients with the cache's owner token and worker sessions,
each with its shm device pool attached to the cache's pool) share a prefix:
one stores keys from its device rows, the other finds them, pins them and
restores them byte-exact into other rows (also per layer); a second store
skips what is present; evict spares the pinned; stats and events (resumed
by next_after) say what happened. Refusals (a key too long, too many keys,
a key twice, a wrong owner token, a restore of a key not present, a pinning
lookup without a worker session, an unknown pin, a pool that is not a node
cache) raise the daemon's code with a message naming the value, and change
nothing. Pages stored from and restored into an index-addressed pool's slots
(store_from_pool / restore_to_pool, copied inside kvhostd) come back
byte-exact through a LAYER_FIRST pool; their refusals name the value. Run by tests/pytest_run.py (ctest), or by pytest from a built
checkout.
"""
import kvhost
import kvhost_testing as pkg  # its client and raises

CACHE_SPEC = dict(pkg.SPEC, node_cache=True)  # 16 pages of 4 tokens, 32-byte rows
PAGE_SIZE = 4
ROW_BYTES = pkg.ROW_BYTES
DEVICE_TOKENS = 32  # 8 device pages
TOKEN = "model-token"


def raises(cls, fn, *args, naming=None, **kw):
    return pkg.raises(cls, fn, *args, naming=naming, **kw)


def page_data(seed, comp, layer):
    return bytes((seed * 31 + comp * 7 + layer * 3 + b) % 256
                 for b in range(PAGE_SIZE * ROW_BYTES))


def fill(dev, page, seed):
    for ci in range(len(dev.components)):
        for layer in range(dev.layers):
            view = dev.layer_view(ci, layer)
            start = page * PAGE_SIZE * ROW_BYTES
            view[start:start + PAGE_SIZE * ROW_BYTES] = page_data(seed, ci, layer)


def holds(dev, page, seed):
    for ci in range(len(dev.components)):
        for layer in range(dev.layers):
            start = page * PAGE_SIZE * ROW_BYTES
            got = bytes(dev.layer_view(ci, layer)[start:start + PAGE_SIZE * ROW_BYTES])
            if got != page_data(seed, ci, layer):
                return False
    return True


def rows(first_page, pages):
    return list(range(first_page * PAGE_SIZE, (first_page + pages) * PAGE_SIZE))


class Instance:
    """An engine instance: a worker client of the cache's token, its shm
    device pool and the attachment of it to the cache's pool."""

    def __init__(self, daemon, layer_progress=False):
        self.client = pkg.client(daemon, session=True, owner_token=TOKEN)
        self.device = self.client.shm_device_pool("cache", DEVICE_TOKENS, daemon.shm)
        self.att = self.client.attach_shm("cache", self.device, layer_progress=layer_progress)
        self.cache = self.client.node_cache("cache")

    def close(self):
        self.att.__exit__(None, None, None)
        self.device.close()
        self.client.close()


def make_cache(daemon):
    admin = pkg.client(daemon, owner_token=TOKEN)
    admin.create_pool("cache", CACHE_SPEC)
    return admin


def test_two_instances_share_a_prefix_byte_exact(daemon):
    admin = make_cache(daemon)
    a, b = Instance(daemon), Instance(daemon)
    try:
        keys = [b"block-0", "block-1", b"\x00\xffblock-2"]  # str keys go as UTF-8
        found = a.cache.lookup(keys)
        assert found == kvhost.LookupResult(0, [kvhost.KeyState.ABSENT] * 3, 0), found
        for p in range(3):
            fill(a.device, p, 10 + p)
        stored = a.cache.store(a.att, keys, rows(0, 3))
        assert stored.states == [kvhost.KeyState.ABSENT] * 3 and stored.evicted == 0, stored
        assert isinstance(stored.ticket, kvhost.Ticket), stored
        assert stored.ticket.wait(30)["done"] is True
        again = a.cache.store(a.att, keys, rows(0, 3))
        assert again == kvhost.StoreResult([kvhost.KeyState.PRESENT] * 3, None, 0), again

        # b finds the prefix, pins it and restores it into its pages 4..6.
        found = b.cache.lookup(keys + [b"never"], pin=True)
        assert found.prefix == 3 and found.pin_id != 0, found
        assert found.states == [kvhost.KeyState.PRESENT] * 3 + [kvhost.KeyState.ABSENT], found
        ticket = b.cache.restore(b.att, keys, rows(4, 3))
        assert ticket.wait(30)["done"] is True
        for p in range(3):
            assert holds(b.device, 4 + p, 10 + p), f"b's page {4 + p} after the restore"

        # Pinned: kept; released: evicted.
        assert a.cache.evict([keys[1]]) == [kvhost.EvictOutcome.BUSY]
        b.cache.release_pin(found.pin_id)
        raises(kvhost.NotFound, b.cache.release_pin, found.pin_id,
               naming=f"no pin {found.pin_id}")
        assert a.cache.evict([keys[1], b"never"]) == [kvhost.EvictOutcome.EVICTED,
                                                       kvhost.EvictOutcome.ABSENT]
        assert b.cache.lookup(keys).prefix == 1

        # Hits: b's lookup 3, its restore 3, the last lookup 2; misses: a's
        # lookup 3, b's 1, the last 1.
        stats = admin.node_cache("cache").stats()
        assert stats == kvhost.CacheStats(page_num=16, free_pages=14, published=2, writing=0,
                                          pinned=0, hits=8, misses=5, stored=3, skipped=3,
                                          evicted=1, aborted=0), stats

        # Events: three stored, one evicted; one at a time by next_after.
        want = [(kvhost.EventKind.STORED, b"block-0"), (kvhost.EventKind.STORED, b"block-1"),
                (kvhost.EventKind.STORED, b"\x00\xffblock-2"),
                (kvhost.EventKind.EVICTED, b"block-1")]
        batch = admin.node_cache("cache").events()
        assert [(e.kind, e.key) for e in batch.events] == want and not batch.gap, batch
        assert batch.next_after == batch.events[-1].seq
        seen, after = [], 0
        while True:
            one = a.cache.events(after_seq=after, max_events=1)
            if not one.events:
                break
            assert len(one.events) == 1 and not one.gap, one
            seen.append(one.events[0])
            after = one.next_after
        assert seen == batch.events
    finally:
        a.close()
        b.close()
        admin.close()


def test_restore_per_layer(daemon):
    admin = make_cache(daemon)
    a = Instance(daemon, layer_progress=True)
    try:
        fill(a.device, 0, 7)
        a.cache.store(a.att, [b"k"], rows(0, 1)).ticket.wait(30)
        ticket = a.cache.restore(a.att, [b"k"], rows(5, 1), per_layer=True)
        assert isinstance(ticket, kvhost.LoadTicket) and ticket.event_set >= 0, ticket
        for layer in range(a.device.layers):
            ticket.wait_layer(layer, timeout=30)
        ticket.wait(30)
        assert holds(a.device, 5, 7)
    finally:
        a.close()
        admin.close()


def test_refusals_are_named_and_change_nothing(daemon):
    admin = make_cache(daemon)
    admin.create_pool("plain", pkg.SPEC)
    a = Instance(daemon)
    stranger = pkg.client(daemon, session=True, owner_token="other-token")
    try:
        cache = a.cache
        before = cache.stats()
        fill(a.device, 0, 1)
        raises(kvhost.InvalidArgument, cache.store, a.att, [b"ok", b"k" * 257], rows(0, 2),
               naming="key 1 has 257 bytes, over the limit of 256")
        raises(kvhost.InvalidArgument, cache.lookup, [f"k{i}" for i in range(4097)],
               naming="4097 keys, over the limit of 4096")
        raises(kvhost.InvalidArgument, cache.evict, [b"x", b"x"],
               naming="key 1 repeats an earlier key")
        raises(kvhost.InvalidArgument, cache.store, a.att, [b"ok"], rows(0, 2),
               naming="8 device rows for 1 keys; want 4")
        raises(kvhost.PermissionDenied, stranger.node_cache("cache").lookup, [b"ok"],
               naming="pool 'cache' is owner-protected: the token given does not match")
        raises(kvhost.PermissionDenied, stranger.node_cache("cache").stats,
               naming="owner-protected")
        raises(kvhost.FailedPrecondition, admin.node_cache("cache").lookup, [b"ok"], pin=True,
               naming="needs a worker session")
        raises(kvhost.NotFound, cache.release_pin, 12345, naming="no pin 12345")
        raises(kvhost.FailedPrecondition, admin.node_cache("plain").stats,
               naming="pool 'plain' is not a node cache")
        raises(kvhost.NotFound, admin.node_cache("nope").stats, naming="nope")
        raises(kvhost.InvalidArgument, admin.node_cache, "ca\0che", naming="cache name")
        raises(ValueError, cache.events, max_events=-1, naming="negative")
        assert cache.stats() == before
        assert cache.events() == kvhost.CacheEventBatch([], 0, False)
        # A restore of a key not present: refused by name, and it changes
        # nothing, its lookup's miss included.
        raises(kvhost.FailedPrecondition, cache.restore, a.att, [b"absent"], rows(0, 1),
               naming="cache 'cache': key 0")
        assert cache.stats() == before
        assert cache.events().events == []
    finally:
        stranger.close()
        a.close()
        admin.close()


def test_pages_move_through_a_pool_of_another_layout_byte_exact(daemon):
    admin = make_cache(daemon)
    admin.create_pool("lf", dict(pkg.SPEC, layout="LAYER_FIRST", size_tokens=32))
    slots = list(admin.alloc("lf", 2 * PAGE_SIZE))
    a = Instance(daemon)
    try:
        for p in range(2):
            fill(a.device, p, 70 + p)
        assert a.cache.store(a.att, [b"d0", b"d1"], rows(0, 2)).ticket.wait(30)["done"]
        ticket = a.cache.restore_to_pool("lf", slots, [b"d0", b"d1"])
        status = ticket.wait(30)
        assert status["done"] is True and status["bytes"] == 2 * PAGE_SIZE * ROW_BYTES * 2 * 3, \
            status
        stored = a.cache.store_from_pool("lf", slots, [b"p0", b"p1"])
        assert stored.states == [kvhost.KeyState.ABSENT] * 2, stored
        assert stored.ticket.wait(30)["done"] is True
        assert a.cache.store_from_pool("lf", slots, [b"p0", b"p1"]).ticket is None
        assert a.cache.restore(a.att, [b"p0", b"p1"], rows(4, 2)).wait(30)["done"] is True
        for p in range(2):
            assert holds(a.device, 4 + p, 70 + p), f"page {4 + p} after the trip through 'lf'"

        before = admin.node_cache("cache").stats()
        raises(kvhost.InvalidArgument, a.cache.store_from_pool, "lf", slots[:PAGE_SIZE],
               [b"x0", b"x1"], naming="4 slots for 2 keys; want 8")
        raises(kvhost.FailedPrecondition, a.cache.store_from_pool, "lf",
               list(range(7 * PAGE_SIZE, 8 * PAGE_SIZE)), [b"x0"], naming="'lf'")
        raises(kvhost.NotFound, a.cache.restore_to_pool, "nope", slots[:PAGE_SIZE], [b"p0"],
               naming="nope")
        raises(kvhost.FailedPrecondition, a.cache.restore_to_pool, "lf", slots[:PAGE_SIZE],
               [b"never"], naming="key 0 is not present")
        assert admin.node_cache("cache").stats().published == before.published
        assert admin.node_cache("cache").stats().pinned == 0
    finally:
        a.close()
        admin.close()
