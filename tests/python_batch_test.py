#!/usr/bin/env python3
"""The batched calls from Python (kvhost.Client.alloc_batch,
kvhost.Attachment.alloc_backup over kvhost_alloc_batch / kvhost_alloc_backup)
against a real kvhostd (host backend).

alloc_batch returns one run per count, whole pages, no slot twice, and one
free gives them all back; a count that is not whole pages, a sum over the
free slots and an unknown pool are refused with the daemon's code and leave
the pool as it was. alloc_backup allocates the host slots and backs the
device rows up into them in one call (a load of those slots brings the bytes
back); a count that is not whole pages or an event on the host backend is
refused and leaves nothing allocated; a group's attachment is refused.
Run by tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""

import kvhost
import kvhost_testing as pkg  # its client, raises and pattern

SPEC = {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16", "page_size": 4,
        "layer_num": 3, "head_num": 2, "head_dim": 8, "size_tokens": 64}
ROW_BYTES = 2 * 8 * 2  # head_num * head_dim * sizeof(bf16)


def raises(cls, fn, *args, naming=None, **kw):
    return pkg.raises(cls, fn, *args, naming=naming, **kw)


def test_alloc_batch(daemon):
    with pkg.client(daemon) as c:
        c.create_pool("p", SPEC)
        runs = c.alloc_batch("p", [8, 4, 12], numpy=False)
        assert [len(r) for r in runs] == [8, 4, 12], runs
        flat = [s for r in runs for s in r]
        assert len(set(flat)) == 24, runs
        for r in runs:  # each run is whole pages, page by page in order
            for i in range(0, len(r), 4):
                assert r[i] % 4 == 0 and r[i:i + 4] == list(range(r[i], r[i] + 4)), r
        assert c.available_size("p") == 40
        # Refusals change nothing.
        raises(kvhost.InvalidArgument, c.alloc_batch, "p", [8, 3], naming="3")
        raises(kvhost.ResourceExhausted, c.alloc_batch, "p", [32, 16], naming="'p'")
        raises(kvhost.NotFound, c.alloc_batch, "nope", [4], naming="nope")
        raises(kvhost.InvalidArgument, c.alloc_batch, "p", [], naming="empty")
        raises(ValueError, c.alloc_batch, "p", [4, -4], naming="-4")
        assert c.available_size("p") == 40
        # One free gives every run back; the pool's own handle does the same.
        assert c.free("p", flat) == 24 and c.available_size("p") == 64
        pool = c.pool("p")
        again = pool.alloc_batch([4, 4])
        assert sorted(int(s) for r in again for s in r) == sorted(set(int(s) for r in again
                                                                  for s in r))
        assert pool.free([s for r in again for s in r]) == 8
        # A large batch: 16 runs of one page.
        many = c.alloc_batch("p", [4] * 16, numpy=False)
        assert len({s for r in many for s in r}) == 64 and c.available_size("p") == 0
        raises(kvhost.ResourceExhausted, c.alloc_batch, "p", [4])
        assert c.free("p", [s for r in many for s in r]) == 64


def fill(dev):
    """Rows 0..7 of every layer and component get a pattern, 8..15 zeros."""
    for ci, comp in enumerate(("k", "v")):
        for layer, view in enumerate(dev.views(comp, numpy=False)):
            for row in range(16):
                data = pkg.pattern(ci, layer, row) if row < 8 else bytes(ROW_BYTES)
                view[row * ROW_BYTES:(row + 1) * ROW_BYTES] = data


def test_alloc_backup(daemon):
    with pkg.client(daemon) as c:
        c.create_pool("p", SPEC)
        with c.shm_device_pool("p", 16, daemon.shm) as dev:
            fill(dev)
            with c.attach_shm("p", dev) as att:
                host, ticket = att.alloc_backup(range(8), wait=True, numpy=False)
                assert len(host) == 8 and len(set(host)) == 8 and ticket.done, (host, ticket)
                assert c.available_size("p") == 56
                att.load(host, range(8, 16), wait=True)
                for ci in range(2):
                    for layer in range(3):
                        got = dev.layer_view(ci, layer)
                        for row in range(8):
                            at = (8 + row) * ROW_BYTES
                            assert bytes(got[at:at + ROW_BYTES]) == pkg.pattern(ci, layer, row), \
                                f"component {ci} layer {layer} row {8 + row} differs"
                # Without a wait: the ticket completes.
                more, t = att.alloc_backup(range(4))
                assert len(more) == 4 and t.wait(30)["done"] is True, t
                assert c.available_size("p") == 52
                # Refused calls leave nothing allocated.
                raises(kvhost.InvalidArgument, att.alloc_backup, range(3))
                raises(kvhost.FailedPrecondition, att.alloc_backup, range(4), event=bytes(64))
                raises(kvhost.InvalidArgument, att.alloc_backup, [0, 1, 2, 99], naming="99")
                raises(kvhost.ResourceExhausted, att.alloc_backup, list(range(16)) * 4)
                assert c.available_size("p") == 52
                assert c.free("p", list(host) + list(more)) == 12


def test_alloc_backup_refuses_a_group(daemon):
    with pkg.client(daemon) as c:
        c.create_pool("a", SPEC)
        c.create_group("g", {"layer_num": 3, "entries": [
            {"name": "kv", "pool": "a", "anchor": True}]})
        with c.shm_device_pool("a", 16, daemon.shm) as da:
            with c.attach_group_shm("g", {"kv": da}) as att:
                raises(kvhost.InvalidArgument, att.alloc_backup, range(4), naming="'g'")
        assert c.available_size("a") == 64
