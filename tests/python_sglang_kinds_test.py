#!/usr/bin/env python3
"""kvhost.sglang's other seed pools (kvhost/sglang/kinds.py, groups.py) against a real
kvhostd on the host backend.

Each kind goes through the seeds' HiCache call sequence, in every layout
kvhostd has for it: allocate host slots (in the followed pool for K-only,
the DSA indexer and V4 state), write device rows back to them
(backup_from_device_all_layer from a shm device pool), save the flat pages
(get_data_page, the same bytes as read_pages and as the pages
get_page_buffer_meta points at), evict (free) and restore them into other
slots (set_from_flat_data_page / write_pages), and load them back layer by
layer into other device rows (load_to_device_per_layer), byte for byte.
Pool groups (HostPoolGroup of PoolEntry) do the same with pool_transfers:
a hybrid MHA + Mamba group and a V4 group (logical anchor, paged and state
entries). The errors: the seeds' own (NotImplementedError for what a kind
cannot do, naming why; ValueError for a layout the seed refuses) before
anything is sent, and the daemon's as kvhost exceptions with their gRPC
code. No GPU, numpy or torch needed (tensors=False).
Run by tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""
import ctypes
from types import SimpleNamespace

import kvhost
import kvhost.sglang as sglang


PS, LAYERS, SIZE, ROWS, MOVED = 4, 2, 64, 16, 8


def client(daemon, owner_token=None):
    return kvhost.Client(daemon.address, session=False, timeout=10, wait_ready=20,
                         owner_token=owner_token)


def raises(cls, fn, *args, naming=None, code=None, **kw):
    try:
        fn(*args, **kw)
    except cls as e:
        assert naming is None or naming in str(e), f"{str(e)!r} does not name {naming!r}"
        assert code is None or e.code.name == code, (e.code, code)
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {cls.__name__}")


def common(c, layout, **kw):
    kw.setdefault("layer_num", LAYERS)
    return dict(client=c, layout=layout, tensors=False, **kw)


def fill(dev, seed):
    """Rows of [0, MOVED) tokens of every component and layer get a pattern
    (a page-row component: its MOVED / page rows), the rest zero."""
    for ci, comp in enumerate(dev.components):
        moved = MOVED // comp.row_tokens
        for layer in range(dev.layers):
            view = dev.layer_view(ci, layer)
            for r in range(comp.rows):
                view[r * comp.row_bytes:(r + 1) * comp.row_bytes] = (
                    bytes(1 + (seed * 17 + ci * 131 + layer * 31 + r * 7 + b) % 251
                          for b in range(comp.row_bytes)) if r < moved else bytes(comp.row_bytes))


def moved_back(dev, what):
    """Device rows of tokens [MOVED, 2 MOVED) hold what rows [0, MOVED) held."""
    for ci, comp in enumerate(dev.components):
        n, rb = MOVED // comp.row_tokens, comp.row_bytes
        for layer in range(dev.layers):
            view = dev.layer_view(ci, layer)
            assert bytes(view[n * rb:2 * n * rb]) == bytes(view[:n * rb]), \
                f"{what}: component {comp.name} layer {layer} differs after the round trip"


def hicache_cycle(c, pool, slots_pool, what, meta_order=None):
    """The seeds' call sequence on `pool`, whose slots `slots_pool` allocates
    (itself, or the pool it follows). Returns nothing; asserts every byte."""
    dev = c.shm_device_pool(pool.name, ROWS)
    try:
        fill(dev, len(what))
        host = list(slots_pool.alloc(MOVED))
        ps = slots_pool.page_size
        pool.backup_from_device_all_layer(dev, host, list(range(MOVED)), "direct")
        starts = host[::ps]
        # L3 write-back: the flat pages; read_pages and the meta pointers agree.
        saved = [pool.get_data_page(s) for s in starts]
        assert all(len(p) == pool.bytes_per_page for p in saved), what
        assert len(pool.get_dummy_flat_data_page()) == pool.bytes_per_page, what
        assert c.read_pages(pool.name, starts) == saved, what
        if meta_order is not None:
            ptrs, sizes = pool.get_page_buffer_meta(host)
            segs = [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]
            per = len(segs) // len(starts)
            for i in range(len(starts)):
                assert b"".join(meta_order(segs[i * per:(i + 1) * per])) == saved[i], \
                    f"{what}: the meta of page {starts[i]} is not its flat page"
        # Evict to L3, prefetch into other slots, load back per layer.
        again = list(slots_pool.alloc(MOVED))
        slots_pool.free(host)
        raises(kvhost.FailedPrecondition, pool.get_data_page, starts[0],
               code="FAILED_PRECONDITION")
        new_starts = again[::ps]
        pool.set_from_flat_data_page(new_starts[0], saved[0])
        assert c.write_pages(pool.name, new_starts[1:], saved[1:]) == len(saved) - 1
        for layer in range(dev.layers):
            pool.load_to_device_per_layer(dev, again, list(range(MOVED, 2 * MOVED)), layer,
                                          "kernel")
        moved_back(dev, what)
        slots_pool.free(again)
        pool.close()
    finally:
        dev.close()


def same(segs):
    return segs


def test_k_only(daemon):
    with client(daemon) as c:
        mha = sglang.MHATokenToKVPoolHost("mha", head_num=2, head_dim=8, page_size=PS,
                                          host_size_tokens=SIZE, **common(c, "page_first"))
        for layout in ("layer_first", "page_first", "page_first_direct"):
            name = f"konly-{layout}"
            k = sglang.MHATokenToKOnlyPoolHost(name, mha, head_num=1, head_dim=16,
                                               **common(c, layout))
            assert k.size == SIZE and k.page_size == PS and k.info["follows"] == "mha"
            assert k.get_size_per_token() == k.get_ksize_per_token() == 16 * LAYERS * 2
            assert k.page_shape() == {"layer_first": (LAYERS, PS, 1, 16),
                                      "page_first": (PS, LAYERS, 1, 16),
                                      "page_first_direct": (1, LAYERS, PS, 1, 16)}[layout]
            assert len(k.get_hybrid_pool_buffer()[0]) == SIZE * 16 * LAYERS * 2
            hicache_cycle(c, k, mha, name, None if layout == "layer_first" else same)
            raises(NotImplementedError, k.alloc, PS, naming="'mha'")
            raises(NotImplementedError, k.free, [0, 1, 2, 3], naming="follows")
            assert k.available_size() == mha.available_size() == SIZE
            k.clear()
            if layout == "layer_first":  # the seed's ValueError; the daemon's code
                slots = mha.alloc(PS)
                raises(kvhost.FailedPrecondition, k.get_page_buffer_meta, slots,
                       code="FAILED_PRECONDITION")
                mha.free(slots)
        raises(ValueError, sglang.MHATokenToKOnlyPoolHost, "x", mha, head_num=1, head_dim=16,
               host_size_tokens=8, **common(c, "page_first"), naming="host_size_tokens")
        raises(kvhost.InvalidArgument, sglang.MHATokenToKOnlyPoolHost, "x", mha, head_num=0,
               head_dim=16, **common(c, "page_first"), naming="head_num")


def test_asymmetric(daemon):
    with client(daemon) as c:
        for layout in ("page_first", "page_first_direct"):
            name = f"asym-{layout}"
            a = sglang.AsymmetricMHATokenToKVPoolHost(name, head_num=2, head_dim=8, v_head_dim=4,
                                                      page_size=PS, host_size_tokens=SIZE,
                                                      **common(c, layout))
            assert a.get_size_per_token() == (8 + 4) * 2 * LAYERS * 2
            assert a.get_ksize_per_token() == 8 * 2 * LAYERS * 2
            for call, args in ((a.get_data_page, (0,)), (a.get_dummy_flat_data_page, ()),
                               (a.set_from_flat_data_page, (0, b"")),
                               (a.get_split_heads_page_buffer_meta, ([0], 2))):
                raises(NotImplementedError, call, *args, naming="head_dim != v_head_dim")
            dev = c.shm_device_pool(name, ROWS)
            fill(dev, 3)
            host = list(a.alloc(MOVED))
            a.backup_from_device_all_layer(dev, host, list(range(MOVED)), "direct")
            # Zero copy is the way to its pages: per page [k, v], the rows of the page.
            ptrs, sizes = a.get_page_buffer_meta(host)
            assert len(ptrs) == 2 * (MOVED // PS) and sizes[:2] == [
                LAYERS * PS * 2 * 8 * 2, LAYERS * PS * 2 * 4 * 2], sizes
            raises(kvhost.FailedPrecondition, c.read_pages, name, host[::PS], naming=name)
            for layer in range(LAYERS):
                a.load_to_device_per_layer(dev, host, list(range(MOVED, 2 * MOVED)), layer)
            moved_back(dev, name)
            a.close()
            dev.close()
        raises(kvhost.InvalidArgument, sglang.AsymmetricMHATokenToKVPoolHost, "x", head_num=2,
               head_dim=8, v_head_dim=4, page_size=PS, host_size_tokens=SIZE,
               **common(c, "layer_first"), naming="head_dim != v_head_dim")
        raises(kvhost.InvalidArgument, sglang.AsymmetricMHATokenToKVPoolHost, "x", head_num=2,
               head_dim=8, v_head_dim=8, page_size=PS, host_size_tokens=SIZE,
               **common(c, "page_first"), naming="v_head_dim")
        assert sglang.get_mha_host_pool_cls(SimpleNamespace(head_dim=8, v_head_dim=4)) is \
            sglang.AsymmetricMHATokenToKVPoolHost
        assert sglang.get_mha_host_pool_cls(SimpleNamespace(head_dim=8, v_head_dim=8)) is \
            sglang.MHATokenToKVPoolHost


def test_dsa(daemon):
    with client(daemon) as c:
        d = sglang.DSATokenToKVPoolHost("dsa", kv_lora_rank=12, qk_rope_head_dim=4,
                                        index_head_dim=16, index_quant_block_size=8,
                                        page_size=PS, host_size_tokens=SIZE,
                                        **common(c, "layer_first"))
        assert d.index_k_row_bytes == 16 + 16 // 8 * 4
        assert d.get_size_per_token() == (16 * 2 + d.index_k_row_bytes) * LAYERS
        assert len(d.get_hybrid_pool_buffer()) == 2
        # Meta: per layer the latent then the index-K; the flat page: every
        # layer's latent, then every layer's index-K.
        hicache_cycle(c, d, d, "dsa", lambda segs: segs[0::2] + segs[1::2])
        raises(NotImplementedError, d.get_data_page, 0, flat=False, naming="two blocks")
        host = list(d.alloc(MOVED))
        with c.shm_device_pool("dsa", ROWS) as dev:
            raises(kvhost.InvalidArgument, d.backup_from_device_all_layer, dev, host[:2],
                   [0, 1], code="INVALID_ARGUMENT")
        d.free(host)
        d.close()
        for bad in ({"layout": "page_first"}, {"quant_method": "per_token_head"}):
            raises(NotImplementedError, sglang.DSATokenToKVPoolHost, "x", kv_lora_rank=12,
                   qk_rope_head_dim=4, index_k_row_bytes=24, page_size=PS,
                   host_size_tokens=SIZE, client=c, tensors=False, layer_num=LAYERS, **bad,
                   naming="DSA KVStore")
        assert [p["name"] for p in c.list_pools()] == ["dsa"], "a refused DSA made a pool"
        r = sglang.DSATokenToKVPoolHost("dsa-rows", kv_lora_rank=12, qk_rope_head_dim=4,
                                        index_k_row_bytes=20, page_size=PS,
                                        host_size_tokens=SIZE, **common(c, "layer_first"))
        assert r.index_k_row_bytes == 20
        r.close()


def test_dsa_indexer(daemon):
    with client(daemon) as c:
        mla = sglang.MLATokenToKVPoolHost("mla", kv_lora_rank=12, qk_rope_head_dim=4,
                                          page_size=PS, host_size_tokens=SIZE,
                                          **common(c, "layer_first"))
        for layout in ("layer_first", "page_first", "page_first_direct"):
            name = f"indexer-{layout}"
            ix = sglang.DSAIndexerPoolHost(name, mla, index_head_dim=16,
                                           index_quant_block_size=8, **common(c, layout))
            assert ix.indexer_page_stride_size == PS * 24
            assert ix.bytes_per_page == LAYERS * PS * 24
            assert ix.page_shape() == ((LAYERS, 1, PS * 24) if layout == "layer_first"
                                       else (1, LAYERS, 1, PS * 24))
            hicache_cycle(c, ix, mla, name, None if layout == "layer_first" else same)
            raises(NotImplementedError, ix.alloc, PS, naming="'mla'")
            host = list(mla.alloc(PS))
            with c.shm_device_pool(name, ROWS) as dev:  # whole pages only
                raises(kvhost.InvalidArgument, ix.backup_from_device_all_layer, dev, host[:2],
                       [0, 1], code="INVALID_ARGUMENT")
            mla.free(host)
            ix.close()
        raises(kvhost.InvalidArgument, sglang.DSAIndexerPoolHost, "x", mla, index_head_dim=16,
               index_quant_block_size=5, **common(c, "page_first"), naming="multiple")


def test_mamba(daemon):
    # An owner token: the second scheduler below adopts the pool.
    with client(daemon, "sched") as c:
        m = sglang.MambaPoolHost("mamba", num_mamba_layers=LAYERS, temporal_state_shape=(2, 3),
                                 conv_state_shapes=[(5,), (3, 2)], conv_dtype="bfloat16",
                                 temporal_dtype="float32", host_size_tokens=32, client=c,
                                 tensors=False)
        per_layer = 2 * 3 * 4 + 5 * 2 + 3 * 2 * 2
        assert m.page_size == 1 and m.get_size_per_token() == per_layer * LAYERS
        assert m.get_ksize_per_token() == m.get_size_per_token()
        assert m.page_shape() == (per_layer * LAYERS,)
        assert [len(b) for b in m.get_hybrid_pool_buffer()] == \
            [32 * LAYERS * 24, 32 * LAYERS * 10, 32 * LAYERS * 12]
        hicache_cycle(c, m, m, "mamba", same)
        m.close()
        raises(ValueError, sglang.MambaPoolHost, "x", num_mamba_layers=LAYERS,
               temporal_state_shape=(2, 3), conv_state_shapes=[(5,)], layout="page_first",
               host_size_tokens=32, client=c, tensors=False, naming="page_first_direct")
        raises(kvhost.InvalidArgument, sglang.MambaPoolHost, "x", num_mamba_layers=LAYERS,
               temporal_state_shape=(2, 3), conv_state_shapes=[(5,)] * 8,
               host_size_tokens=32, client=c, tensors=False, code="INVALID_ARGUMENT")
        # A second scheduler opens it with the same states, not with others.
        again = sglang.MambaPoolHost("mamba", num_mamba_layers=LAYERS,
                                     temporal_state_shape=(2, 3),
                                     conv_state_shapes=[(5,), (3, 2)], host_size_tokens=32,
                                     client=c, tensors=False)
        again.close()
        raises(ValueError, sglang.MambaPoolHost, "mamba", num_mamba_layers=LAYERS,
               temporal_state_shape=(2, 4), conv_state_shapes=[(5,), (3, 2)],
               host_size_tokens=32, client=c, tensors=False, naming="mamba")


def test_logical_and_v4(daemon):
    with client(daemon) as c:
        lg = sglang.LogicalHostPool("logical", SIZE, PS, client=c, tensors=False)
        assert lg.size == SIZE and lg.get_size_per_token() == lg.get_ksize_per_token() == 0
        slots = list(lg.alloc(MOVED))
        assert lg.get_data_page(slots[0]) == b"" and lg.get_dummy_flat_data_page() == bytearray()
        lg.set_from_flat_data_page(slots[0], b"")
        assert lg.get_page_buffer_meta(slots) is None
        lg.backup_from_device_all_layer(None, slots, list(range(MOVED)), "direct")
        lg.load_to_device_per_layer(None, slots, list(range(MOVED)), 0, "direct")
        # sglang's keyword, as the seed takes it (a packed MTP draft's layer)
        lg.load_to_device_per_layer(None, slots, list(range(MOVED)), 0, "direct", is_draft=True)
        raises(kvhost.InvalidArgument, lg.alloc, PS - 1, code="INVALID_ARGUMENT")
        raises(kvhost.FailedPrecondition, lg.get_data_page, SIZE - PS,
               code="FAILED_PRECONDITION")
        lg.free(slots)
        raises(kvhost.InvalidArgument, sglang.LogicalHostPool, "odd", SIZE + 1, PS, client=c,
               tensors=False, code="INVALID_ARGUMENT")
        for layout in ("layer_first", "page_first", "page_first_direct"):
            name = f"v4-{layout}"
            paged = sglang.DeepSeekV4PagedHostPool(name, item_bytes=40, num_host_pages=16,
                                                   slot_page_size=PS, **common(c, layout))
            assert paged.size == 16 * PS and paged.get_size_per_token() == 40
            assert paged.bytes_per_page == LAYERS * 40
            rounded = paged.alloc(PS + 1)  # whole slot pages, as the seed's
            assert len(rounded) == 2 * PS, rounded
            paged.free(rounded)
            hicache_cycle(c, paged, paged, name, same)
            state = sglang.DeepSeekV4StateHostPool(f"{name}-state", paged, ring_size=3,
                                                   state_slot_bytes=8, **common(c, layout))
            assert state.state_page_bytes == 24 and state.swa_page_size == PS
            hicache_cycle(c, state, paged, f"{name}-state", same)
            for call, args in ((state.alloc, (PS,)), (state.free, ([0],)),
                               (state.available_size, ())):
                raises(NotImplementedError, call, *args, naming="reuses SWA transfer indices")
            state.clear()
            if layout == "layer_first":
                ptrs, lens, items = paged.get_contiguous_buf_infos()
                assert lens == [16 * 40] * LAYERS and items == [40] * LAYERS
                host = list(paged.alloc(PS))
                page = bytes(range(LAYERS * 40))
                paged.set_from_flat_data_page(host[0], page)
                row = host[0] // PS
                assert b"".join(ctypes.string_at(p + row * 40, 40) for p in ptrs) == page
                paged.free(host)
                assert len(paged.get_hybrid_pool_buffer()) == LAYERS
            else:
                raises(NotImplementedError, paged.get_contiguous_buf_infos, naming="layer_first")
            # The V4 rule: None or empty indices move nothing; a mismatch is ValueError.
            with c.shm_device_pool(name, ROWS) as dev:
                paged.backup_from_device_all_layer(dev, None, None, "direct")
                paged.load_to_device_per_layer(dev, [], [], 0, "direct")
                paged.load_to_device_per_layer(dev, [], [], 0, "direct", is_draft=False)
                raises(ValueError, paged.backup_from_device_all_layer, dev, [0, 1, 2, 3],
                       [0, 1], naming="host=4, device=2")
                host = list(paged.alloc(PS))
                raises(kvhost.InvalidArgument, paged.backup_from_device_all_layer, dev,
                       host[:2], [0, 1], code="INVALID_ARGUMENT")
                paged.free(host)
            state.close()
            paged.close()
        sglang.DeepSeekV4StateHostPool("lg-state", lg, ring_size=2, state_slot_bytes=4,
                                       **common(c, "page_first")).close()


def test_groups(daemon):
    # An owner token: a group that exists is adopted only when its pools are
    # this client's (kvhost.pools.adopt_group).
    with client(daemon, "sched") as c:
        raises(ValueError, sglang.HostPoolGroup, [], naming="at least one")
        attn = sglang.MHATokenToKVPoolHost("attn", head_num=2, head_dim=8, page_size=PS,
                                           host_size_tokens=SIZE, **common(c, "page_first"))
        ssm = sglang.MambaPoolHost("ssm", num_mamba_layers=LAYERS, temporal_state_shape=(2, 3),
                                   conv_state_shapes=[(5,)], host_size_tokens=16, client=c,
                                   tensors=False)
        kv_dev, ssm_dev = c.shm_device_pool("attn", ROWS), c.shm_device_pool("ssm", ROWS)
        fill(kv_dev, 1)
        fill(ssm_dev, 2)
        group = sglang.HostPoolGroup([
            sglang.PoolEntry("kv", attn, kv_dev, {0: 0, 2: 1}.get, is_primary_index_anchor=True),
            sglang.PoolEntry("ssm", ssm, ssm_dev, {1: 0, 3: 1}.get)], name="hybrid",
            layer_num=4)
        assert group.get_pool("ssm") is ssm and group.page_size == PS and group.size == SIZE
        assert c.get_group("hybrid")["entries"][1]["layer_map"] == [-1, 0, -1, 1]
        kv_host = list(group.alloc(MOVED))
        ssm_host = list(ssm.alloc(MOVED))
        assert group.available_size() == SIZE - MOVED
        moves = [SimpleNamespace(name="ssm", host_indices=ssm_host,
                                 device_indices=list(range(MOVED))),
                 SimpleNamespace(name="skipped", host_indices=None, device_indices=None)]
        group.backup_from_device_all_layer(None, kv_host, list(range(MOVED)), "direct", moves)
        assert group.get_data_page(kv_host[0]) == attn.get_data_page(kv_host[0])
        back = [SimpleNamespace(name="ssm", host_indices=ssm_host,
                                device_indices=list(range(MOVED, 2 * MOVED)))]
        raises(kvhost.InvalidArgument, group.backup_from_device_all_layer, None, kv_host,
               list(range(MOVED)), "direct",
               [SimpleNamespace(name="mamba", host_indices=ssm_host,
                                device_indices=list(range(MOVED)))], naming="mamba")
        raises(RuntimeError, group.load_to_device_per_layer, None, kv_host,
               list(range(MOVED, 2 * MOVED)), 1, naming="layer 1")
        for layer in range(4):
            group.load_to_device_per_layer(None, kv_host, list(range(MOVED, 2 * MOVED)), layer,
                                           "kernel", back)
        moved_back(kv_dev, "group kv")
        moved_back(ssm_dev, "group ssm")
        # The cuda backend's path, its stream stood in for (the host backend
        # ignores it; a fence ring recording no event): the backup and the
        # load's last layer return with their tickets kept, not waited for.
        attn._cuda_stream = lambda att: SimpleNamespace(cuda_stream=0)
        group._transfers._fences = group._transfers._load_fences = SimpleNamespace(
            record=lambda stream: b"")
        group.backup_from_device_all_layer(None, kv_host, list(range(MOVED)), "direct", moves)
        assert len(group._transfers.kept) == 1, "the group's backup was waited for"
        for layer in range(4):
            group.load_to_device_per_layer(None, kv_host, list(range(MOVED, 2 * MOVED)), layer,
                                           "kernel", back)
        assert len(group._transfers.kept) >= 1, "the group's load was waited for"
        assert group._transfers.drain() is None
        moved_back(kv_dev, "group kv, no host waits")
        moved_back(ssm_dev, "group ssm, no host waits")
        del attn._cuda_stream
        # A second HostPoolGroup of the same entries uses the group; other ones are refused.
        sglang.HostPoolGroup(group.entries, name="hybrid", layer_num=4).close()
        raises(ValueError, sglang.HostPoolGroup, group.entries[::-1], name="hybrid",
               layer_num=4, naming="other entries")
        group.clear()
        ssm.clear()
        assert group.available_size() == SIZE and ssm.available_size() == 16
        group.close()
        kv_dev.close()
        ssm_dev.close()

        # V4: a logical anchor with a paged and a state entry, on one index space.
        lg = sglang.LogicalHostPool("full", SIZE, PS, client=c, tensors=False, device_size=ROWS)
        paged = sglang.DeepSeekV4PagedHostPool("c4", item_bytes=40, num_host_pages=16,
                                               slot_page_size=PS, **common(c, "page_first"))
        state = sglang.DeepSeekV4StateHostPool("c4-state", paged, ring_size=3,
                                               state_slot_bytes=8, **common(c, "page_first"))
        devs = {n: c.shm_device_pool(n, ROWS) for n in ("c4", "c4-state")}
        for i, d in enumerate(devs.values()):
            fill(d, 5 + i)
        v4 = sglang.HostPoolGroup([
            sglang.PoolEntry("full", lg, None, lambda layer: None, is_primary_index_anchor=True),
            sglang.PoolEntry("c4", paged, devs["c4"], lambda layer: layer),
            sglang.PoolEntry("c4-state", state, devs["c4-state"], lambda layer: layer)])
        assert v4.name == "full.group" and v4.layer_num == LAYERS
        full = list(v4.alloc(MOVED))
        rows = list(paged.alloc(MOVED))
        v4.backup_from_device_all_layer(None, full, list(range(MOVED)), "direct",
                                        {"c4": (rows, list(range(MOVED))),
                                         "c4-state": (rows, list(range(MOVED)))})
        for layer in range(LAYERS):
            v4.load_to_device_per_layer(
                None, full, list(range(MOVED, 2 * MOVED)), layer, "kernel",
                {"c4": (rows, list(range(MOVED, 2 * MOVED))),
                 "c4-state": (rows, list(range(MOVED, 2 * MOVED)))})
        for n, d in devs.items():
            moved_back(d, f"v4 group {n}")
        v4.close()
        for d in devs.values():
            d.close()
