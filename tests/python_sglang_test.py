#!/usr/bin/env python3
"""kvhost.sglang (HiCache's host pool over kvhostd) against a real kvhostd.

Each check gets a fresh kvhostd (host backend) and drives the call sequence
of sglang's HiCache on MHATokenToKVPoolHost and MLATokenToKVPoolHost, in
every layout kvhostd has for the kind: sizes and available_size
accounting; alloc (None when too few are free), free, re-alloc and clear;
pages written with set_from_flat_data_page and read back byte for byte by
get_data_page and through get_page_buffer_meta's pointers; the dummy flat
page's size; is_stride_page_aligned; a backup from a shm device pool and a
per-layer load back, byte for byte; and the errors (a bad layout name is a
ValueError naming it, the daemon's errors kvhost exceptions with their
gRPC code). No GPU, numpy or torch needed (tensors=False).
Run by tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""
import ctypes
import os
import sys
import time

import kvhost
import kvhost.sglang as sglang


PS, LAYERS, HEADS, DIM, LORA, ROPE, SIZE = 4, 3, 2, 8, 12, 4, 64
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")


def client(daemon):
    return kvhost.Client(daemon.address, session=False, timeout=10, wait_ready=20)


def raises(cls, fn, *args, naming=None, code=None, **kw):
    try:
        fn(*args, **kw)
    except cls as e:
        assert naming is None or naming in str(e), f"{str(e)!r} does not name {naming!r}"
        assert code is None or e.code.name == code, (e.code, code)
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {cls.__name__}")


def make(kind, c, name, layout, **kw):
    kw.setdefault("host_size_tokens", SIZE)
    common = dict(client=c, layout=layout, dtype="bfloat16", page_size=PS, layer_num=LAYERS,
                  tensors=False, **kw)
    if kind == "MHA":
        return sglang.MHATokenToKVPoolHost(name, head_num=HEADS, head_dim=DIM, **common)
    return sglang.MLATokenToKVPoolHost(name, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                                       **common)


def page_bytes(seed, n):
    return bytes((1 + (seed * 37 + b * 5) % 251) for b in range(n))


def per_token(kind):
    return (2 * HEADS * DIM if kind == "MHA" else LORA + ROPE) * LAYERS * 2  # bf16


def check_pages(kind, daemon):
    layouts = MHA_LAYOUTS if kind == "MHA" else MLA_LAYOUTS
    with client(daemon) as c:
        for layout in layouts:
            name = f"{kind.lower()}-{layout.replace('_', '-')}"
            with make(kind, c, name, layout) as pool:
                assert pool.size == SIZE and pool.page_num == SIZE // PS, pool
                assert pool.get_size_per_token() == per_token(kind), pool.get_size_per_token()
                page = pool.get_size_per_token() * PS
                dummy = pool.get_dummy_flat_data_page()
                assert len(dummy) == page and not any(dummy), len(dummy)
                assert pool.available_size() == SIZE
                slots = list(pool.alloc(8))
                assert len(slots) == 8 and pool.available_size() == SIZE - 8, slots
                assert pool.alloc(SIZE) is None, "alloc beyond the free slots is None"
                assert pool.available_size() == SIZE - 8
                assert list(pool.alloc(0)) == []
                starts = slots[::PS]
                for i, s in enumerate(starts):
                    pool.set_from_flat_data_page(s, page_bytes(i, page))
                for i, s in enumerate(starts):
                    assert pool.get_data_page(s) == page_bytes(i, page), (layout, s)
                # Zero-copy meta: real pointers to the same bytes, sglang's order
                # (layer_first: per layer K then V; page-major: K then V).
                ptrs, sizes = pool.get_page_buffer_meta(slots)
                segs = [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]
                per_page = len(segs) // len(starts)
                for i in range(len(starts)):
                    mine = segs[i * per_page:(i + 1) * per_page]
                    if layout == "layer_first" and kind == "MHA":
                        mine = mine[0::2] + mine[1::2]
                    assert b"".join(mine) == page_bytes(i, page), (layout, i)
                aligned = pool.is_stride_page_aligned(128)
                # kvhostd's answer (IsStridePageAligned): never layer_first;
                # page_unified's page block and head-group range are aligned
                # here as the page-major components are (the package's own
                # derivation used to say False for page_unified).
                assert aligned == (layout != "layer_first"), (layout, aligned)
                assert aligned == c.stride_alignment(pool.name, 128)["aligned"]
                assert not pool.is_stride_page_aligned(4096)  # a 384-byte page stride
                raises(ValueError, pool.get_data_page, starts[0], flat=False, naming="numpy")
                # Evict a page, re-alloc it; a second free is the daemon's error.
                assert pool.free(slots[:PS]) == PS and pool.available_size() == SIZE - PS
                raises(kvhost.FailedPrecondition, pool.free, slots[:PS], code="FAILED_PRECONDITION")
                raises(kvhost.FailedPrecondition, pool.get_data_page, starts[0])
                again = list(pool.alloc(PS))
                assert len(again) == PS and pool.available_size() == SIZE - 8, again
                raises(kvhost.InvalidArgument, pool.alloc, PS - 1, code="INVALID_ARGUMENT")
                raises(kvhost.InvalidArgument, pool.set_from_flat_data_page, again[0],
                       b"x" * (page - 1), code="INVALID_ARGUMENT")
                # Another scheduler's slots survive this one's clear().
                other = list(c.alloc(name, PS))
                pool.clear()
                assert pool.available_size() == SIZE - PS, pool.available_size()
                c.free(name, other)
                assert pool.available_size() == SIZE
            assert c.get_pool(name)["attachments"] == 0  # the pool stays after close()
            c.delete_pool(name)


def test_mha_pages(daemon):
    check_pages("MHA", daemon)


def test_mla_pages(daemon):
    check_pages("MLA", daemon)


def check_backup_load(kind, daemon):
    rows = 16
    with client(daemon) as c:
        pool = make(kind, c, "bl", "page_first")
        dev = c.shm_device_pool("bl", rows)
        comps = [comp.name for comp in dev.components]
        assert comps == (["k", "v"] if kind == "MHA" else ["latent"]), comps
        for ci, comp in enumerate(comps):
            rb = dev.component(comp).row_bytes
            for layer in range(LAYERS):
                view = dev.layer_view(comp, layer)
                for r in range(rows):
                    data = page_bytes(ci * 100 + layer * 10 + r, rb) if r < 8 else bytes(rb)
                    view[r * rb:(r + 1) * rb] = data
        host = pool.alloc(8)
        raises(ValueError, pool.backup_from_device_all_layer, dev, host, range(8), "bogus",
               naming="bogus")
        pool.backup_from_device_all_layer(dev, host, list(range(8)), "kernel")
        assert c.get_pool("bl")["attachments"] == 1  # attached once, kept
        raises(RuntimeError, pool.load_to_device_per_layer, dev, host, range(8, 16), 1,
               "kernel", naming="layer 1")
        for layer in range(LAYERS):
            pool.load_to_device_per_layer(dev, host, list(range(8, 16)), layer, "kernel")
            for ci, comp in enumerate(comps):
                rb = dev.component(comp).row_bytes
                got = dev.layer_view(comp, layer)
                for r in range(8):
                    at = (8 + r) * rb
                    assert bytes(got[at:at + rb]) == page_bytes(ci * 100 + layer * 10 + r, rb), \
                        f"{kind} {comp} layer {layer} row {8 + r} differs"
        # The ticket is done after the last layer: a new layer 0 starts afresh.
        raises(RuntimeError, pool.load_to_device_per_layer, dev, host, range(8, 16), 2,
               "direct")
        # An attachment given directly works too; host bytes went to the page.
        with c.attach_shm("bl", dev) as att:
            pool.backup_from_device_all_layer(att, host, list(range(8, 16)), "direct")
        raises(kvhost.InvalidArgument, pool.backup_from_device_all_layer, dev, host,
               list(range(7)), code="INVALID_ARGUMENT")
        pool.close()
        assert c.get_pool("bl")["attachments"] == 0
        dev.close()


def test_mha_backup_load(daemon):
    check_backup_load("MHA", daemon)


def test_mla_backup_load(daemon):
    check_backup_load("MLA", daemon)


class _Stream:
    """A stand-in for torch's current stream (the host backend ignores it)."""

    cuda_stream = 0


class _NoFence:
    """A ready-fence ring whose records name no event: the host backend
    refuses a real one, and its shared-memory rows need none."""

    def record(self, stream):
        return b""


def _device_file(dev):
    """The shared-memory file behind a ShmDevicePool, from /proc/self/maps,
    and the file offset of K's layer 1 (page-aligned: past it, every access
    faults once the file is cut there)."""
    at = dev.layer_address(0, 0)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= at < hi and len(fields) >= 6:
                cut = dev.layer_address(0, 1) - lo + int(fields[2], 16)
                assert cut % 4096 == 0, cut
                return fields[5], cut
    raise AssertionError("the device pool's file is not mapped")


def _until_failed(c, ticket_id):
    """Waits (through a Ticket of its own, leaving the pool's unpolled) until
    the daemon's ticket `ticket_id` has failed."""
    for _ in range(500):
        try:
            kvhost.Ticket(c, ticket_id).poll()
        except kvhost.KvhostError:
            return
        time.sleep(0.01)
    raise AssertionError(f"ticket {ticket_id} did not fail")


def test_transfers_not_waited_for(daemon):
    """The cuda backend's bookkeeping, run on the host backend by standing in
    for torch's stream: backups and the last layer of loads return with
    their tickets kept, not waited for; a backup that fails in the daemon
    raises the daemon's error from the pool's next transfer call (not lost),
    the calls after it go on; close() waits for what is left and raises a
    failure it finds."""

    class NoWait(sglang.MHATokenToKVPoolHost):
        def _cuda_stream(self, att):
            return _Stream()

    with client(daemon) as c:
        pool = NoWait("nw", client=c, layout="page_first", dtype="bfloat16", page_size=PS,
                      layer_num=LAYERS, head_num=HEADS, head_dim=DIM, host_size_tokens=SIZE,
                      tensors=False)
        pool._transfers._fences = pool._transfers._load_fences = _NoFence()
        dev = c.shm_device_pool("nw", 256)  # 8 KiB layers: whole pages
        rb = dev.component("k").row_bytes
        for ci in range(2):
            for layer in range(LAYERS):
                view = dev.layer_view(ci, layer)
                for r in range(8):
                    view[r * rb:(r + 1) * rb] = page_bytes(ci * 100 + layer * 10 + r, rb)
        host = pool.alloc(8)
        pool.backup_from_device_all_layer(dev, host, list(range(8)))
        assert len(pool._transfers.kept) == 1, "the backup was waited for"
        for layer in range(LAYERS):
            pool.load_to_device_per_layer(dev, host, list(range(8, 16)), layer)
        # The load's layer-0 call polled the backup (done: dropped); the load
        # itself is kept, not waited for.
        assert len(pool._transfers.kept) == 1, len(pool._transfers.kept)
        assert pool._transfers.kept.drain() is None
        for ci in range(2):
            for layer in range(LAYERS):
                got = dev.layer_view(ci, layer)
                for r in range(8):
                    assert bytes(got[(8 + r) * rb:(9 + r) * rb]) == \
                        page_bytes(ci * 100 + layer * 10 + r, rb), (ci, layer, r)
        # Cut the file after K of layer 0: the daemon fails the next backup
        # in its first layer, at V (SIGBUS caught); the call itself returns.
        path, cut = _device_file(dev)
        size = os.path.getsize(path)
        os.truncate(path, cut)
        pool.backup_from_device_all_layer(dev, host, list(range(8)))
        assert len(pool._transfers.kept) == 1, "the failing backup was not kept"
        _until_failed(c, pool._transfers.kept._kept[0][1].id)
        os.truncate(path, size)
        e = raises(kvhost.FailedPrecondition, pool.load_to_device_per_layer, dev, host,
                   list(range(8, 16)), 0, naming="truncated")
        assert "backup of 8 rows" in "".join(getattr(e, "__notes__", [])) or \
            sys.version_info < (3, 11), getattr(e, "__notes__", None)
        # Raised once: the next calls go on.
        for layer in range(LAYERS):
            pool.load_to_device_per_layer(dev, host, list(range(8, 16)), layer)
        pool.backup_from_device_all_layer(dev, host, list(range(8)))
        assert pool._transfers.kept.drain() is None
        # close() waits for a failed backup no call saw, and raises it.
        os.truncate(path, cut)
        pool.backup_from_device_all_layer(dev, host, list(range(8)))
        _until_failed(c, pool._transfers.kept._kept[0][1].id)
        raises(kvhost.FailedPrecondition, pool.close, naming="truncated")
        os.truncate(path, size)
        assert c.get_pool("nw")["attachments"] == 0, "close() stopped before detaching"
        dev.close()


def test_kept_tickets_retry():
    """KeptTickets.retrying: ResourceExhausted (every event set taken) waits
    for the oldest kept ticket and tries once more; with none kept, or a
    second refusal, the error is the caller's."""
    from kvhost.sglang.transfers import KeptTickets  # noqa: PLC0415

    class Done:
        id, waited = 1, 0

        def wait(self, timeout=None):
            Done.waited += 1

        def poll(self):
            return True

    def refusing(times):
        calls = []

        def submit():
            calls.append(1)
            if len(calls) <= times:
                raise kvhost.ResourceExhausted(8, "all 1 load event sets are in use")
            return "ticket"
        return submit, calls

    kept = KeptTickets()
    submit, calls = refusing(1)
    raises(kvhost.ResourceExhausted, kept.retrying, submit)  # nothing to wait for
    assert len(calls) == 1
    kept.keep("backup", Done())
    submit, calls = refusing(1)
    assert kept.retrying(submit) == "ticket" and len(calls) == 2 and Done.waited == 1
    assert len(kept) == 0
    kept.keep("backup", Done())
    submit, calls = refusing(2)
    raises(kvhost.ResourceExhausted, kept.retrying, submit)
    assert len(calls) == 2


def test_errors_and_sharing(daemon):
    with client(daemon) as c:
        raises(ValueError, make, "MLA", c, "x", "page_first_kv_split",
               naming="page_first_kv_split")
        raises(ValueError, make, "MHA", c, "x", "pagefirst", naming="pagefirst")
        raises(ValueError, sglang.MHATokenToKVPoolHost, "x", client=c, layout="page_first",
               dtype="int4", page_size=PS, layer_num=LAYERS, head_num=HEADS, head_dim=DIM,
               host_size_tokens=SIZE, naming="int4")
        assert c.list_pools() == [], "a refused layout or dtype made nothing"
        raises(kvhost.InvalidArgument, make, "MLA", c, "x", "page_head",
               code="INVALID_ARGUMENT")
        raises(kvhost.InvalidArgument, sglang.MHATokenToKVPoolHost, "x", client=c,
               layout="page_first", page_size=PS, layer_num=LAYERS, head_num=0, head_dim=DIM,
               host_size_tokens=SIZE, naming="head_num")
        # Sizing as sglang's: host_to_device_ratio times the device's tokens.
        ratio = make("MHA", c, "ratio", "page_first", host_size_tokens=0,
                     host_to_device_ratio=2.0, device_size=32)
        assert ratio.size == 64, ratio.size
        ratio.close()
        # host_size_gib is GiB (2**30 bytes), as kvhostd's sizes: 80 tokens'
        # bytes exactly (read as decimal GB, the same number made 76).
        gib = make("MHA", c, "gib", "page_first", host_size_tokens=0,
                   host_size_gib=per_token("MHA") * 80 / 2**30)
        assert gib.size == 80, gib.size
        gib.close()
        # sglang's --hicache-size is decimal GB, as sglang's own pools read
        # it: the plugin hands kvhost.sglang its GiB.
        import kvhost.sglang.plugin as plugin
        sized = plugin._sizes(0.0, 2.5, None, 0)
        assert round(sized["host_size_gib"] * 2**30) == 2_500_000_000, sized
        # A second scheduler (the same owner token) opens the same pool; a
        # different shape is refused. Without the token, adoption is refused
        # (tests/python_adoption_test.py).
        owner = kvhost.Client(daemon.address, session=False, timeout=10, owner_token="sched")
        first = make("MHA", owner, "shared", "page_first")
        second = make("MHA", owner, "shared", "page_first", host_size_tokens=8)
        assert second.size == first.size == SIZE
        a = first.alloc(8)
        assert second.available_size() == SIZE - 8 and second.alloc(SIZE - 8) is not None
        assert first.alloc(PS) is None
        raises(ValueError, make, "MHA", owner, "shared", "layer_first", naming="layout")
        raises(kvhost.PermissionDenied, make, "MHA", c, "shared", "page_first",
               naming="owner token")
        second.clear()
        first.free(a)
        assert first.available_size() == SIZE
        owner.close()
        # Its own client when none is given; the daemon's code on a bad name.
        own = sglang.MLATokenToKVPoolHost("own", address=daemon.address, layout="layer_first",
                                          page_size=PS, layer_num=LAYERS, kv_lora_rank=LORA,
                                          qk_rope_head_dim=ROPE, host_size_tokens=SIZE,
                                          tensors=False)
        assert own.available_size() == SIZE
        own.close()
        assert own.client.closed
        raises(kvhost.InvalidArgument, make, "MHA", c, "bad name!", "page_first",
               naming="bad name!")
