#!/usr/bin/env python3
"""The kvhost Python package (python/kvhost) against a real kvhostd.

Each check gets a fresh kvhostd (host backend, a private socket and shm
dir) and drives the package the way a scheduler and a worker would: every
call of the ABI through its Python name; errors as exceptions with the
right code and a message naming the bad value (a bad pool name is NotFound
naming it, a bad spec InvalidArgument); a byte-exact backup and load
through shm device buffers, through numpy when it is installed and through
memoryviews always; a pool group attached with one shm device pool per
entry and moved with pool_transfers, byte for byte; many pages read and
written in one stream (ReadPages / WritePages), and their refusals; the
CUDA group attach's answers without a GPU; per-layer waits;
context managers that detach and close; a session loss reported after a daemon restart. It also checks that
the package imports without the library and then fails naming every place
it looked, that its ctypes signatures cover the header, and that its
64-bit JSON field list matches the .proto files. No GPU and no torch needed.
Run by tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import kvhost
import kvhost.errors  # noqa: F401 (the tests reach into the modules too)
from kvhost_testing import ROW_BYTES, SPEC, client, pattern, raises


def have_numpy():
    try:
        import numpy  # noqa: F401
        return True
    except ImportError:
        return False


# --- checks without a daemon ---------------------------------------------


def test_library(lib_path):
    assert kvhost.abi_version() == kvhost.ABI_VERSION == 1
    assert kvhost.built_with_cuda() in (True, False)
    assert os.path.samefile(kvhost.library_path(), lib_path), kvhost.library_path()
    assert kvhost.code_name(5) == "NOT_FOUND" and kvhost.code_name(17) == "UNKNOWN_CODE"
    for code in kvhost.StatusCode:  # our names are the library's names
        assert kvhost.code_name(code) == code.name, code
    err = kvhost.errors.error_for(5, "pool 'x' not found")
    assert isinstance(err, kvhost.NotFound) and isinstance(err, kvhost.KvhostError)
    assert err.code == 5 and err.code is kvhost.StatusCode.NOT_FOUND and err.message
    odd = kvhost.errors.error_for(42, "odd")
    assert type(odd) is kvhost.KvhostError and odd.code == 42 and odd.code_name == "UNKNOWN_CODE"
    import pickle
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is kvhost.NotFound and back.message == err.message


def test_signatures_cover_the_header(source_dir):
    header = open(os.path.join(source_dir, "client/include/kvhost/kvhost_c.h")).read()
    declared = set(re.findall(r"KVHOST_C_API[^;(]*?\b(kvhost_\w+)\s*\(", header))
    bound = set(kvhost._lib.SIGNATURES)
    assert declared == bound, (f"header only: {sorted(declared - bound)}; "
                               f"package only: {sorted(bound - declared)}")


def test_default_address_is_the_headers(source_dir):
    """kvhost.DEFAULT_ADDRESS is kvhost/defaults.h's, which kvhostd's
    --listen default and the C++ client read."""
    header = open(os.path.join(source_dir, "client/include/kvhost/defaults.h")).read()
    found = re.findall(r'#define\s+KVHOST_DEFAULT_ADDRESS\s+"([^"]+)"', header)
    assert found == [kvhost.DEFAULT_ADDRESS], (found, kvhost.DEFAULT_ADDRESS)


def test_int64_fields_match_the_protos(source_dir):
    wide, other, enums = set(), {}, set()
    proto_dir = os.path.join(source_dir, "proto/kvhost/v1")
    for name in os.listdir(proto_dir):
        text = open(os.path.join(proto_dir, name)).read()
        enums |= set(re.findall(r"^\s*enum\s+(\w+)", text, re.M))
        for t, field in re.findall(r"^\s*(?:repeated\s+|optional\s+)?([\w.]+)\s+(\w+)\s*=\s*\d+",
                                   text, re.M):
            if t in ("int64", "uint64", "sint64", "fixed64", "sfixed64"):
                wide.add(field)
            else:
                other.setdefault(field, set()).add(t)
    stringish = {f for f, ts in other.items() if ts & ({"string", "bytes"} | enums)}
    want = wide - stringish
    got = set(kvhost._json.INT64_FIELDS)
    assert got == want, f"missing {sorted(want - got)}; extra {sorted(got - want)}"
    assert kvhost._json.loads('{"id":"7","available_tokens":"64","host_indices":["1","2"],'
                              '"layers":[{"offset":"3"}]}') == \
        {"id": "7", "available_tokens": 64, "host_indices": [1, 2], "layers": [{"offset": 3}]}


def test_ticket_wait_in_slices():
    """Ticket.wait asks in one-second slices; poll tells a slice's end from
    a transfer that failed with DEADLINE_EXCEEDED (stubbed ABI)."""
    lib, real = kvhost._lib, kvhost._lib.call_out
    stub_client = type("StubClient", (), {"_handle": lambda self: None})()
    calls = []

    def running_then_done(fn, *args, **kw):
        calls.append(fn.__name__)
        if fn.__name__ == "kvhost_transfer_wait" and calls.count("kvhost_transfer_wait") < 3:
            assert args[2] <= 1000, f"a slice of {args[2]} ms"
            raise kvhost.DeadlineExceeded(4, "slice")
        return '{"done": true, "ticket_id": "9"}' if fn.__name__ == "kvhost_transfer_wait" \
            else "{}"

    def failed_with_deadline(fn, *args, **kw):
        calls.append(fn.__name__)
        raise kvhost.DeadlineExceeded(4, "the event wait timed out")

    try:
        lib.call_out = running_then_done
        assert kvhost.Ticket(stub_client, 9).wait(30) == {"done": True, "ticket_id": 9}
        assert calls.count("kvhost_transfer_wait") == 3 and \
            calls.count("kvhost_transfer_poll") == 2, calls
        calls.clear()
        lib.call_out = failed_with_deadline
        start = time.monotonic()
        raises(kvhost.DeadlineExceeded, kvhost.Ticket(stub_client, 9).wait, 30,
               naming="event wait")
        assert time.monotonic() - start < 5 and len(calls) == 2, calls
    finally:
        lib.call_out = real


def test_without_the_library(lib_path, source_dir):
    """A copy of the package outside the checkout, no library anywhere."""
    tmp = tempfile.mkdtemp(prefix="kvhost-py-nolib-")
    try:
        shutil.copytree(os.path.join(source_dir, "python", "kvhost"), os.path.join(tmp, "kvhost"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.so*"))
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVHOST_LIBRARY", "KVHOST_BUILD_DIR", "LD_LIBRARY_PATH",
                            "PYTHONPATH")}
        script = ("import kvhost\n"
                  "try:\n"
                  "    kvhost.Client('unix:///nonexistent.sock')\n"
                  "except kvhost.LibraryError as e:\n"
                  "    print('TRIED', len(e.tried)); print(e)\n"
                  "else:\n"
                  "    print('LOADED', kvhost.library_path())\n")
        out = subprocess.run([sys.executable, "-c", script], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        if "LOADED" in text:  # installed system-wide: then the loader must be what found it
            print(f"  (a system copy exists: {text.strip()}; skipped the not-found half)")
        else:
            assert "libkvhost_c.so not found" in text, text
            assert os.path.join(tmp, "kvhost", "libkvhost_c.so.1") in text, text
            assert "libkvhost_c.so.1 (" in text and "KVHOST_LIBRARY" in text, text
        # An explicit $KVHOST_LIBRARY that is wrong: only it, named.
        env["KVHOST_LIBRARY"] = "/nonexistent/libkvhost_c.so.1"
        out = subprocess.run([sys.executable, "-c", script], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "TRIED 1" in out.stdout and "/nonexistent/libkvhost_c.so.1 (no such file)" in \
            out.stdout and "only it was tried" in out.stdout, out.stdout
        # A directory in $KVHOST_LIBRARY: the soname inside it.
        env["KVHOST_LIBRARY"] = os.path.dirname(lib_path)
        out = subprocess.run([sys.executable, "-c", script], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=60)
        assert "LOADED" in out.stdout, out.stdout + out.stderr
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- checks against a daemon -------------------------------------------------


def test_client_options_and_connect(daemon):
    with kvhost.Client(daemon.address, timeout=10, session=False, worker_name="py-test",
                       reconnect=2.5) as c:
        c.wait_ready(20)
        status = c.daemon_status()
        assert status["backend"] == "host", status
        assert c.list_pools() == []
        assert "open" in repr(c)
    assert c.closed and "closed" in repr(c)
    raises(ValueError, c.list_pools, naming="closed")
    c.close()  # idempotent
    # A socket path is a unix address.
    with kvhost.Client(daemon.socket, session=False, wait_ready=20) as plain:
        assert plain.list_pools() == []
    raises(kvhost.InvalidArgument, kvhost.Client, "", session=False)
    raises(kvhost.InvalidArgument, kvhost.Client, daemon.address, timeout=-1, naming="-1000")
    raises(ValueError, kvhost.Client, daemon.address, reconnect=False, naming="session=False")
    kvhost.Client(daemon.address, session=False, reconnect=False).close()
    with kvhost.Client("unix:///nonexistent/kvhost.sock", timeout=0.5, session=False) as gone:
        e = raises(kvhost.KvhostError, gone.list_pools)
        assert isinstance(e, (kvhost.Unavailable, kvhost.DeadlineExceeded)), e
        raises(kvhost.DeadlineExceeded, gone.wait_ready, 0.2)


def test_pools(daemon):
    with client(daemon) as c:
        raises(kvhost.InvalidArgument, c.create_pool, "p", "{not json", naming="spec_json")
        raises(kvhost.InvalidArgument, c.create_pool, "p", {"kind": "MHA", "bogus_field": 1},
               naming="bogus_field")
        raises(kvhost.InvalidArgument, c.create_pool, "p", {"kind": "MHA"})
        raises(TypeError, c.create_pool, "p", 42, naming="spec")
        pool = c.create_pool("p", SPEC)
        assert pool["name"] == "p" and pool["available_tokens"] == 64, pool
        assert pool["size_tokens"] == 64 and pool["spec"]["kind"] == "MHA", pool
        assert [x["name"] for x in pool["components"]] == ["k", "v"], pool["components"]
        raises(kvhost.AlreadyExists, c.create_pool, "p", SPEC, naming="'p'")
        c.create_pool("q", '{"kind":"MLA","layout":"PAGE_FIRST","dtype":"BF16","pageSize":4,'
                           '"layerNum":2,"kvLoraRank":12,"qkRopeHeadDim":4,"sizeTokens":32}')
        raises(kvhost.NotFound, c.get_pool, "nope", naming="nope")
        assert sorted(p["name"] for p in c.list_pools()) == ["p", "q"]
        assert c.available_size("p") == 64
        raises(kvhost.NotFound, c.delete_pool, "nope", naming="nope")
        assert c.delete_pool("p") > 0
        assert c.delete_pool("q") > 0
        raises(kvhost.NotFound, c.get_pool, "p", naming="'p'")


def test_page_layout_calls(daemon):
    """page_shape, stride_alignment and contiguous_buffer_infos: kvhostd's
    answers (the package computes none of them), and their refusals."""
    page = 4 * 3 * 2 * 8 * 2  # tokens x layers x heads x dim x bf16, per component
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        shape = c.page_shape("p")
        assert [part["component"] for part in shape["parts"]] == ["k", "v"], shape
        assert shape["bytes"] == 2 * page == sum(part["bytes"] for part in shape["parts"])
        slots = c.alloc("p", 4, numpy=False)
        assert len(c.get_data_page("p", slots[0])) == shape["bytes"]
        assert c.stride_alignment("p", 128) == {"aligned": True, "page_strides": [page, page]}
        assert c.stride_alignment("p")["aligned"] is False  # 4096: a 384-byte page stride
        raises(kvhost.InvalidArgument, c.stride_alignment, "p", 3, naming="3")
        raises(kvhost.FailedPrecondition, c.contiguous_buffer_infos, "p", naming="LAYER_FIRST")
        layer_first = dict(SPEC, layout="LAYER_FIRST")
        c.create_pool("lf", layer_first)
        assert c.stride_alignment("lf", 128)["aligned"] is False
        infos = c.contiguous_buffer_infos("lf")
        assert len(infos["region_paths"]) >= 1, infos
        got = sorted((i["component"], i["layer"], i["length"], i["item_bytes"])
                     for i in infos["infos"])
        per_layer = 64 * 2 * 8 * 2  # a layer's rows of a component: tokens x heads x dim x bf16
        assert got == [(comp, layer, per_layer, 4 * 2 * 8 * 2) for comp in ("k", "v")
                       for layer in range(3)], got
        for call in (c.page_shape, c.stride_alignment, c.contiguous_buffer_infos):
            raises(kvhost.NotFound, call, "nope", naming="nope")


def test_groups(daemon):
    with client(daemon) as c:
        c.create_pool("attn", SPEC)
        raises(kvhost.InvalidArgument, c.create_group, "g", "[1,2]", naming="group_json")
        raises(kvhost.NotFound, c.create_group, "g",
               {"layer_num": 3, "entries": [{"name": "kv", "pool": "nope"}]}, naming="nope")
        group = c.create_group("g", {"layer_num": 3, "entries": [
            {"name": "kv", "pool": "attn", "anchor": True}]})
        assert group["name"] == "g" and group["entries"][0]["pool"] == "attn", group
        assert c.get_group("g") == group
        raises(kvhost.NotFound, c.get_group, "nope", naming="nope")
        slots = c.alloc("g", 4, numpy=False)  # a group allocates from its anchor
        assert c.free("g", slots) == 4
        c.delete_group("g")
        raises(kvhost.NotFound, c.delete_group, "g", naming="g")


def test_alloc_free_pages(daemon):
    import array
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        raises(kvhost.NotFound, c.alloc, "nope", 8, naming="nope")
        raises(kvhost.InvalidArgument, c.alloc, "p", 3)
        raises(kvhost.ResourceExhausted, c.alloc, "p", 128, naming="'p'")
        slots = c.alloc("p", 8, numpy=False)
        assert isinstance(slots, list) and len(slots) == 8, slots
        assert slots[0] % 4 == 0 and slots[1] == slots[0] + 1 and slots[4] % 4 == 0, slots
        assert c.available_size("p") == 56
        more = c.alloc("p", 8, numpy=have_numpy())
        if have_numpy():
            import numpy as np
            assert isinstance(more, np.ndarray) and more.dtype == np.int64, more
            raises(TypeError, c.free, "p", more.astype(np.float64), naming="integers")
        else:
            raises(ImportError, c.alloc, "p", 4, numpy=True, naming="numpy")
        meta = c.get_page_buffer_meta("p", slots)
        assert isinstance(meta, dict) and meta, meta
        raises(kvhost.InvalidArgument, c.get_page_buffer_meta, "p", slots[:3])
        raises(kvhost.NotFound, c.get_page_buffer_meta, "nope", slots, naming="nope")

        page = bytes((i * 7 + 3) % 256 for i in range(len(c.get_data_page("p", slots[0]))))
        size = len(page)
        assert size == 4 * 3 * 2 * ROW_BYTES, size  # page_size * layers * (k, v) * row
        c.set_from_flat_data_page("p", slots[4], page)
        assert c.get_data_page("p", slots[4]) == page
        c.set_from_flat_data_page("p", slots[0], memoryview(bytearray(page[::-1])))
        out = bytearray(size)
        assert c.get_data_page("p", slots[0], out=out) == size and bytes(out) == page[::-1]
        raises(kvhost.OutOfRange, c.get_data_page, "p", slots[0], out=bytearray(size - 1))
        raises(kvhost.InvalidArgument, c.set_from_flat_data_page, "p", slots[4], page[:-1])
        raises(TypeError, c.set_from_flat_data_page, "p", slots[4], 12, naming="buffer")
        raises(kvhost.NotFound, c.get_data_page, "nope", slots[0], naming="nope")
        if have_numpy():
            import numpy as np
            arr = np.frombuffer(page, dtype=np.uint16).copy()
            c.set_from_flat_data_page("p", slots[4], arr)
            back = np.zeros(size // 2, dtype=np.uint16)
            c.get_data_page("p", slots[4], out=back)
            assert (back == arr).all()

        raises(TypeError, c.free, "p", [1.5], naming="indices")
        assert c.free("p", array.array("q", slots)) == 8
        raises(kvhost.FailedPrecondition, c.free, "p", slots)
        raises(kvhost.NotFound, c.free, "nope", slots, naming="nope")
        assert c.free("p", range(int(more[0]), int(more[0]) + 8)) == 8
        assert c.available_size("p") == 64
        # The HostKVCache-shaped view of one pool.
        p = c.pool("p")
        assert repr(p) == "kvhost.Pool('p')" and p.info()["name"] == "p"
        got = p.alloc(4, numpy=False)
        assert p.available_size() == 60 and p.get_page_buffer_meta(got)
        p.set_from_flat_data_page(got[0], page)
        assert p.get_data_page(got[0]) == page
        assert p.get_data_page(got[0], bytearray(size)) == size
        assert p.free(got) == 4 and p.delete() > 0
        raises(kvhost.NotFound, p.info, naming="'p'")


def round_trip(c, daemon, views_numpy):
    """Backup rows 0..7 of every layer buffer, load them into rows 8..15."""
    host = c.alloc("p", 8, numpy=False)
    with c.shm_device_pool("p", 16, daemon.shm) as dev:
        assert [x.name for x in dev.components] == ["k", "v"] and dev.layers == 3, dev
        assert dev.component("v") == kvhost.Component("v", 16, ROW_BYTES, 1), dev.components
        assert dev.nbytes == 2 * 3 * 16 * ROW_BYTES
        raises(KeyError, dev.component, "latent", naming="latent")
        raises(kvhost.InvalidArgument, dev.layer_view, 0, 3, naming="layer 3")
        for ci, comp in enumerate(("k", "v")):
            for layer, view in enumerate(dev.views(comp, numpy=views_numpy)):
                for row in range(16):
                    data = pattern(ci, layer, row) if row < 8 else bytes(ROW_BYTES)
                    if views_numpy:
                        view[row] = list(data)
                    else:
                        view[row * ROW_BYTES:(row + 1) * ROW_BYTES] = data
        with c.attach_shm("p", dev, layer_progress=True) as att:
            assert att.id and att.info["pool"] == "p" and att.info["backend"] == "host", att.info
            assert c.get_pool("p")["attachments"] == 1
            t = att.backup(host, list(range(8)), wait=True)
            assert t.done and t.poll() and t.id > 0, t
            t = att.load(host, range(8, 16))
            # status=False: only whether it finished, no TransferStatus kept.
            deadline = time.monotonic() + 30
            while not t.poll(status=False):
                assert time.monotonic() < deadline, "load not done in 30 s"
                time.sleep(0.001)
            assert t.status is None and t.done, t.status
            t = att.load(host, range(8, 16))
            status = t.wait(30)
            assert status["done"] is True and t.done, status
            for ci in range(2):
                for layer in range(3):
                    got = dev.layer_view(ci, layer)
                    assert len(got) == 16 * ROW_BYTES
                    for row in range(8):
                        at = (8 + row) * ROW_BYTES
                        assert bytes(got[at:at + ROW_BYTES]) == pattern(ci, layer, row), \
                            f"component {ci} layer {layer} row {8 + row} differs"
            # Per-layer waits on the layer counters.
            lt = att.load(host, range(8), per_layer=True)
            assert isinstance(lt, kvhost.LoadTicket) and lt.event_set >= 0, lt
            stream = type("Stream", (), {"cuda_stream": 0})()  # ignored without events
            for layer in range(3):
                lt.wait_layer(layer, stream if layer else None, timeout=10)
            lt.wait(30)
            raises(kvhost.DeadlineExceeded, lt.wait_layer, 3, timeout=0.05)
            raises(ValueError, att.load, host, range(8), per_layer=True, wait=True)
            # A backup per layer takes a set as a load does; its last layer
            # recorded is the whole backup (the ticket says done after).
            bt = att.backup(host, list(range(8)), per_layer=True)
            assert isinstance(bt, kvhost.LoadTicket) and bt.event_set >= 0, bt
            assert bt.event_set != lt.event_set or bt.layer_base >= lt.layer_base + 3, (bt, lt)
            bt.wait_layer(2, stream, timeout=10)
            assert bt.wait(30)["done"] is True
            raises(ValueError, att.backup, host, range(8), per_layer=True, wait=True)
            # Refusals, with the daemon's codes.
            raises(kvhost.FailedPrecondition, att.backup, host, range(8), event=bytes(64))
            # A torch.cuda.Event stands in: its ipc_handle() bytes are sent.
            torch_like = type("Event", (), {"ipc_handle": lambda self: bytes(64)})()
            raises(kvhost.FailedPrecondition, att.backup, host, range(8), event=torch_like)
            # A load's ready fence likewise; it needs per_layer=True.
            raises(kvhost.FailedPrecondition, att.load, host, range(8), per_layer=True,
                   event=bytes(64))
            raises(ValueError, att.load, host, range(8), event=bytes(64), naming="per_layer")
            raises(kvhost.InvalidArgument, att.load, host, range(7))
            raises(TypeError, att.backup, host, range(8), event=1.5, naming="event")
            raises(kvhost.NotFound, kvhost.Ticket(c, 987654321).wait, 1)
            raises(kvhost.NotFound, kvhost.Ticket(c, 987654321).poll)
            assert kvhost.Ticket(c, t.id).wait(0)["done"] is True  # a look at a done one
        # Leaving the block detached it and freed the handle.
        assert att.closed and c.get_pool("p")["attachments"] == 0
        raises(ValueError, att.load, host, range(8), naming="closed")
    assert dev.closed
    c.free("p", host)


# A hybrid group: an MHA pool (the anchor) on model layers 0 and 2, a MAMBA
# state pool on 1 and 3; every device layer mapped, so a round trip moves
# every byte of the rows named.
ATTN_SPEC = dict(SPEC, layer_num=2)
SSM_SPEC = {"kind": "MAMBA", "layout": "PAGE_FIRST_DIRECT", "dtype": "BF16", "page_size": 1,
            "layer_num": 2, "size_tokens": 16,
            "mamba": {"temporal": {"dims": [2, 3]}, "temporal_dtype": "FP32",
                      "conv": [{"dims": [5]}]}}
HYBRID = {"layer_num": 4, "entries": [
    {"name": "kv", "pool": "attn", "layer_map": [0, -1, 1, -1], "anchor": True},
    {"name": "ssm", "pool": "ssm", "layer_map": [-1, 0, -1, 1]}]}


def fill_rows(dev, seed):
    """Every row of `dev` gets bytes made from (seed, component, layer, row)."""
    for ci, comp in enumerate(dev.components):
        for layer in range(dev.layers):
            view = dev.layer_view(ci, layer)
            for row in range(comp.rows):
                at = row * comp.row_bytes
                view[at:at + comp.row_bytes] = bytes(
                    (1 + (seed * 17 + ci * 131 + layer * 31 + row * 7 + b) % 251)
                    for b in range(comp.row_bytes))


def device_image(dev):
    return [bytes(dev.layer_view(ci, layer)) for ci in range(len(dev.components))
            for layer in range(dev.layers)]


def rows_match(dst, src, dst_rows, src_rows):
    """Row dst_rows[i] of dst is row src_rows[i] of src; other rows zero."""
    for ci, comp in enumerate(dst.components):
        for layer in range(dst.layers):
            got, want = dst.layer_view(ci, layer), src.layer_view(ci, layer)
            moved = dict(zip(dst_rows, src_rows))
            for row in range(comp.rows):
                at, n = row * comp.row_bytes, comp.row_bytes
                expect = (bytes(want[moved[row] * n:(moved[row] + 1) * n]) if row in moved
                          else bytes(n))
                assert bytes(got[at:at + n]) == expect, \
                    f"component {comp.name} layer {layer} row {row} differs"


def test_group_attach_and_pool_transfers(daemon):
    import ctypes  # noqa: PLC0415
    # kvhost_pool_transfer's layout, as tests/c_api_header_test.c pins it.
    assert ctypes.sizeof(kvhost._lib.PoolTransferStruct) == 5 * ctypes.sizeof(ctypes.c_void_p)
    with client(daemon) as c:
        c.create_pool("attn", ATTN_SPEC)
        c.create_pool("ssm", SSM_SPEC)
        c.create_group("hybrid", HYBRID)
        kv_host = c.alloc("hybrid", 8, numpy=False)  # the anchor's slots
        ssm_host = c.alloc("ssm", 3, numpy=False)
        kv_rows, ssm_rows = [3, 4, 5, 6, 9, 10, 11, 0], [5, 1, 6]
        kv_rows2, ssm_rows2 = [15, 14, 13, 12, 1, 2, 7, 8], [0, 7, 2]
        with c.shm_device_pool("attn", 16, daemon.shm) as kv, \
                c.shm_device_pool("ssm", 8, daemon.shm) as ssm, \
                c.shm_device_pool("attn", 16, daemon.shm) as kv2, \
                c.shm_device_pool("ssm", 8, daemon.shm) as ssm2:
            fill_rows(kv, 1)
            fill_rows(ssm, 2)
            raises(kvhost.NotFound, c.attach_group_shm, "nope", {"kv": kv, "ssm": ssm},
                   naming="nope")
            raises(kvhost.InvalidArgument, c.attach_group_shm, "hybrid",
                   {"kv": kv, "mamba": ssm}, naming="mamba")
            raises(kvhost.InvalidArgument, c.attach_group_shm, "hybrid", {"kv": kv},
                   naming="ssm")
            raises(ValueError, c.attach_group_shm, "hybrid", {})
            assert c.get_group("hybrid")["attachments"] == 0
            with c.attach_group_shm("hybrid", {"kv": kv, "ssm": ssm}) as att:
                assert att.group == "hybrid" and att.pool == "attn", att.info
                assert c.get_group("hybrid")["attachments"] == 1
                before = [c.get_data_page("attn", s) for s in kv_host[::4]] + \
                    [c.get_data_page("ssm", s) for s in ssm_host]
                raises(kvhost.InvalidArgument, att.backup, kv_host, kv_rows, wait=True,
                       pool_transfers={"mamba": (ssm_host, ssm_rows)}, naming="mamba")
                raises(kvhost.InvalidArgument, att.backup, kv_host, kv_rows, wait=True,
                       pool_transfers={"kv": (ssm_host, ssm_rows)}, naming="kv")
                raises(TypeError, att.backup, kv_host, kv_rows,
                       pool_transfers={"ssm": ssm_host}, naming="ssm")
                after = [c.get_data_page("attn", s) for s in kv_host[::4]] + \
                    [c.get_data_page("ssm", s) for s in ssm_host]
                assert before == after, "a refused backup changed host bytes"
                t = att.backup(kv_host, kv_rows, wait=True,
                               pool_transfers={"ssm": (ssm_host, ssm_rows)})
                assert t.done and t.id > 0, t
            assert c.get_group("hybrid")["attachments"] == 0
            with c.attach_group_shm("hybrid", {"kv": kv2, "ssm": ssm2},
                                    layer_progress=True) as att2:
                image = device_image(kv2) + device_image(ssm2)
                raises(kvhost.InvalidArgument, att2.load, kv_host, kv_rows2,
                       pool_transfers={"nope": (ssm_host, ssm_rows2)}, naming="nope")
                raises(kvhost.InvalidArgument, att2.load, kv_host, kv_rows2,
                       pool_transfers={"ssm": (ssm_host, ssm_rows2[:2])})
                assert device_image(kv2) + device_image(ssm2) == image, \
                    "a refused load changed device bytes"
                att2.load(kv_host, kv_rows2, pool_transfers={"ssm": (ssm_host, ssm_rows2)}).wait(30)
                rows_match(kv2, kv, kv_rows2, kv_rows)
                rows_match(ssm2, ssm, ssm_rows2, ssm_rows)
                # Per layer, over the group's model layers.
                lt = att2.load(kv_host, kv_rows2, per_layer=True,
                               pool_transfers={"ssm": (ssm_host, ssm_rows2)})
                assert isinstance(lt, kvhost.LoadTicket), lt
                lt.wait(30)
                rows_match(ssm2, ssm, ssm_rows2, ssm_rows)
                # A group backup per layer: a set, and its last model layer
                # recorded once every entry's rows are copied.
                bt = att2.backup(kv_host, kv_rows2, per_layer=True,
                                 pool_transfers={"ssm": (ssm_host, ssm_rows2)})
                assert isinstance(bt, kvhost.LoadTicket) and bt.event_set >= 0, bt
                bt.wait_layer(3, timeout=10)  # the group has 4 model layers
                assert bt.wait(30)["done"] is True
                raises(kvhost.InvalidArgument, att2.backup, kv_host, kv_rows2, per_layer=True,
                       pool_transfers={"nope": (ssm_host, ssm_rows2)}, naming="nope")


def test_page_streams(daemon):
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        slots = c.alloc("p", 8, numpy=False)
        starts = [slots[4], slots[0]]  # the order given is the order kept
        size = 4 * 3 * 2 * ROW_BYTES
        pages = [bytes((1 + (i * 37 + b * 5) % 251) for b in range(size)) for i in range(2)]
        assert c.write_pages("p", starts, pages, chunk_bytes=100) == 2
        assert c.read_pages("p", starts, chunk_bytes=7) == pages
        assert c.get_data_page("p", starts[1]) == pages[1]
        # One buffer back to back, both ways; a short one refused, untouched.
        assert c.write_pages("p", starts, b"".join(reversed(pages))) == 2
        out = bytearray(2 * size)
        assert c.read_pages("p", starts, out=out) == 2 * size
        assert bytes(out) == pages[1] + pages[0]
        short = bytearray(b"\xab" * (2 * size - 1))
        raises(kvhost.OutOfRange, c.read_pages, "p", starts, out=short, naming=str(2 * size))
        assert short == bytearray(b"\xab" * (2 * size - 1)), "a short buffer was written"
        # A write of the wrong size: refused before anything is sent.
        raises(kvhost.InvalidArgument, c.write_pages, "p", starts, [pages[0], pages[1][:-1]],
               naming=str(2 * size - 1))
        raises(ValueError, c.write_pages, "p", starts, [pages[0]], naming="2 indices")
        raises(TypeError, c.write_pages, "p", starts, [pages[0], 7], naming="pages[1]")
        assert c.read_pages("p", starts) == [pages[1], pages[0]], "a refused write wrote"
        # The daemon's refusals: every index of a read before the first page.
        raises(kvhost.FailedPrecondition, c.read_pages, "p", [starts[0], 60], naming="60")
        raises(kvhost.InvalidArgument, c.read_pages, "p", [starts[0]] * 2, naming="twice")
        raises(kvhost.InvalidArgument, c.read_pages, "p", [starts[0] + 1])
        raises(kvhost.NotFound, c.read_pages, "nope", starts, naming="nope")
        raises(kvhost.NotFound, c.write_pages, "nope", starts, pages, naming="nope")
        assert c.read_pages("p", []) == [] and c.write_pages("p", [], []) == 0
        # Mid-write, the stream's contract: the pages before the refusal stay.
        raises(kvhost.FailedPrecondition, c.write_pages, "p", [starts[0], 60], pages,
               naming="1 page written before this error stay written")
        assert c.get_data_page("p", starts[0]) == pages[0]
        p = c.pool("p")
        assert p.read_pages([starts[1]]) == [pages[0]] and p.write_pages([starts[1]], pages[1]) == 1
        if have_numpy():
            import numpy as np
            arr = c.read_pages("p", starts, numpy=True)
            assert arr.shape == (2, size) and arr.dtype == np.uint8 and arr.tobytes() == \
                pages[0] + pages[1]
            assert c.write_pages("p", starts, arr[::-1].copy()) == 2
            assert c.read_pages("p", starts) == [pages[1], pages[0]]
        else:
            raises(ImportError, c.read_pages, "p", starts, numpy=True, naming="numpy")
        # A kind without flat pages: the daemon's FailedPrecondition.
        c.create_pool("asym", dict(SPEC, kind="MHA_ASYMMETRIC", v_head_dim=4))
        raises(kvhost.FailedPrecondition, c.read_pages, "asym", [0], naming="asym")


def test_cuda_group_calls(daemon):
    import ctypes  # noqa: PLC0415
    assert ctypes.sizeof(kvhost._lib.CudaGroupEntryStruct) == 64  # c_api_header_test pins it
    with client(daemon) as c:
        c.create_pool("attn", ATTN_SPEC)
        c.create_pool("ssm", SSM_SPEC)
        c.create_group("hybrid", HYBRID)
        kv = kvhost.CudaGroupEntry({"k": [0x1000, 0x2000], "v": [0x3000, 0x4000]}, 16,
                                   {"k": 16 * ROW_BYTES, "v": 16 * ROW_BYTES})
        ssm = {"layers": {"temporal": [0x5000, 0x6000], "conv0": [0x7000, 0x8000]},
               "device_size_tokens": 8, "layer_bytes": {"temporal": 8 * 24, "conv0": 8 * 10 - 1}}
        entries = {"kv": kv, "ssm": ssm}
        if not kvhost.built_with_cuda():
            raises(kvhost.Unimplemented, c.attach_group_cuda, "hybrid", entries,
                   naming="without CUDA")
        else:
            raises(kvhost.InvalidArgument, c.attach_group_cuda, "hybrid", entries,
                   naming="entry 'ssm' component 'conv0'")
            raises(kvhost.NotFound, c.attach_group_cuda, "nope", entries, naming="nope")
            ssm["layer_bytes"] = {"temporal": 8 * 24, "conv0": 8 * 10}
            raises(kvhost.InvalidArgument, c.attach_group_cuda, "hybrid",
                   {"kv": kv, "mamba": ssm}, naming="mamba")
            e = raises(kvhost.KvhostError, c.attach_group_cuda, "hybrid", entries)
            assert isinstance(e, (kvhost.FailedPrecondition, kvhost.InvalidArgument)), e
        raises(ValueError, c.attach_group_cuda, "hybrid", {})
        raises(ValueError, c.attach_group_cuda, "hybrid",
               {"kv": kvhost.CudaGroupEntry({"k": [1, 2], "v": [3]}, 16)}, naming="entry 'kv'")
        raises(ValueError, c.attach_group_cuda, "hybrid",
               {"kv": kvhost.CudaGroupEntry({"k": [1], "v": [2]}, 16, {"k": 1})}, naming="v")
        raises(TypeError, c.attach_group_cuda, "hybrid", {"kv": {"rows": 16}})
        try:
            import torch  # noqa: F401
        except ImportError:
            raises(ImportError, c.attach_group_tensors, "hybrid", {}, naming="PyTorch")
            check_attach_group_tensors_with_a_stand_in_torch(c)
        assert c.get_group("hybrid")["attachments"] == 0


def check_attach_group_tensors_with_a_stand_in_torch(c):
    """attach_group_tensors' sizes per entry (rows from each entry's first
    tensor and its pool, bytes from numel) reach the ABI's size check."""
    import types
    sys.modules["torch"] = types.ModuleType("torch")
    try:
        kv = {"k": [FakeTensor(16, 0x1000), FakeTensor(16, 0x2000)],
              "v": [FakeTensor(16, 0x3000), FakeTensor(15, 0x4000)]}  # a row short
        ssm = {"temporal": [FakeTensor(8, 0x5000)] * 2, "conv0": [FakeTensor(8, 0x6000)] * 2}
        raises(ValueError, c.attach_group_tensors, "hybrid",
               {"kv": kv, "ssm": {"temporal": [FakeTensor(8, 1, cuda=False)]}},
               naming="entry 'ssm' component 'temporal' layer 0: not a CUDA tensor")
        raises(ValueError, c.attach_group_tensors, "hybrid", {"kv": kv, "ssm": ssm},
               layer_ranges={"mamba": (0, 2)}, naming="mamba")
        if kvhost.built_with_cuda():
            raises(kvhost.InvalidArgument, c.attach_group_tensors, "hybrid",
                   {"kv": kv, "ssm": ssm}, naming="entry 'kv' component 'v'")
        else:
            raises(kvhost.Unimplemented, c.attach_group_tensors, "hybrid", {"kv": kv, "ssm": ssm})
    finally:
        del sys.modules["torch"]


def test_shm_backup_load_memoryview(daemon):
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        round_trip(c, daemon, views_numpy=False)


def test_shm_backup_load_numpy(daemon):
    if not have_numpy():
        print("  (numpy not installed: the memoryview round trip covers it)")
        return
    import numpy as np
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        round_trip(c, daemon, views_numpy=True)
        with c.shm_device_pool("p", 16, daemon.shm) as dev:
            k0 = dev.layer_array("k", 0, dtype=np.uint16)
            assert k0.shape == (16, ROW_BYTES // 2) and k0.dtype == np.uint16
            raises(ValueError, dev.layer_array, "k", 0, dtype=np.dtype("V7"), naming="whole")
            host = c.alloc("p", 8)  # numpy indices, straight to the ABI
            k0[:8] = np.arange(8 * ROW_BYTES // 2, dtype=np.uint16).reshape(8, -1)
            with c.attach_shm("p", dev) as att:
                att.backup(host, np.arange(8), wait=True)
                att.load(host, np.arange(8, 16, dtype=np.int32)).wait(30)
            assert (k0[8:] == k0[:8]).all()


def test_handles_and_context_managers(daemon):
    c = client(daemon)
    c.create_pool("p", SPEC)
    dev = c.shm_device_pool("p", 8)  # the daemon's shm dir, from its status
    att = c.attach_shm("p", dev)
    plain = c.attach_shm("p", dev, tp_rank=0, load_only=False)
    raises(kvhost.FailedPrecondition, plain.load_events, naming="layer_progress")
    plain.detach()
    assert plain.detached and not plain.closed
    raises(kvhost.NotFound, plain.detach)
    plain.close()
    plain.close()
    raises(kvhost.NotFound, c.attach_shm, "nope", dev, naming="nope")
    # Closing the client releases what it made, newest first. A sessionless
    # attachment stays on the daemon until detached.
    c.close()
    assert att.closed and dev.closed, (att, dev)
    with client(daemon) as again:
        assert again.get_pool("p")["attachments"] == 1
    # A closed attachment's with-block exit is fine.
    with client(daemon) as c2:
        with c2.shm_device_pool("p", 8, daemon.shm) as dev2:
            a2 = c2.attach_shm("p", dev2)
            with a2:
                a2.detach()
            assert a2.closed


def test_cuda_calls(daemon):
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        fake = {"k": [0x1000, 0x2000, 0x3000], "v": [0x4000, 0x5000, 0x6000]}
        with c.shm_device_pool("p", 16, daemon.shm) as dev, c.attach_shm("p", dev) as shm_att:
            if not kvhost.built_with_cuda():
                raises(kvhost.Unimplemented, c.attach_cuda, "p", fake, 16, naming="without CUDA")
                raises(kvhost.Unimplemented, kvhost.cuda_export_event, 0)
                raises(kvhost.Unimplemented, shm_att.worker_copier)
            else:
                raises(kvhost.InvalidArgument, c.attach_cuda, "p", fake, 16,
                       layer_bytes={"k": 16 * ROW_BYTES, "v": 16 * ROW_BYTES - 1},
                       naming="component 'v'")
                raises(kvhost.NotFound, c.attach_cuda, "nope", fake, 16,
                       layer_bytes={"k": 1, "v": 1}, naming="nope")
                e = raises(kvhost.KvhostError, c.attach_cuda, "p", fake, 16)
                assert isinstance(e, (kvhost.FailedPrecondition, kvhost.InvalidArgument)), e
                e = raises(kvhost.KvhostError, kvhost.cuda_export_event, 0)
                assert isinstance(e, (kvhost.FailedPrecondition, kvhost.InvalidArgument)), e
                raises(kvhost.FailedPrecondition, shm_att.worker_copier,
                       naming="kvhost_attach_cuda")
        raises(ValueError, c.attach_cuda, "p", {"k": [1, 2], "v": [3]}, 16, naming="same")
        raises(ValueError, c.attach_cuda, "p", fake, 16, layer_bytes={"k": 1}, naming="v")
        try:
            import torch  # noqa: F401
        except ImportError:
            raises(ImportError, c.attach_tensors, "p", [], [], naming="PyTorch")
            check_attach_tensors_with_a_stand_in_torch(c)
    assert kvhost.transfer.stream_arg(None) is None
    assert kvhost.transfer.stream_arg(type("S", (), {"cuda_stream": 1234})()) == 1234
    raises(TypeError, kvhost.transfer.stream_arg, "s", naming="stream")


class FakeTensor:
    """What attach_tensors reads of a torch tensor: a (rows, heads, dim) BF16."""

    def __init__(self, rows, ptr, cuda=True):
        self.shape, self.ptr, self.is_cuda, self.device = (rows, 2, 8), ptr, cuda, "fake"

    def is_contiguous(self):
        return True

    def numel(self):
        return self.shape[0] * 16

    def element_size(self):
        return 2

    def data_ptr(self):
        return self.ptr


def check_attach_tensors_with_a_stand_in_torch(c):
    """attach_tensors' sizes (rows from shape[0], bytes from numel) reach the
    ABI's size check, with a module standing in for torch."""
    import types
    sys.modules["torch"] = types.ModuleType("torch")
    try:
        k = [FakeTensor(16, 0x1000 * (i + 1)) for i in range(3)]
        v = [FakeTensor(16, 0x9000 * (i + 1)) for i in range(2)] + [FakeTensor(15, 0x20000)]
        raises(ValueError, c.attach_tensors, "p", [FakeTensor(16, 1, cuda=False)] * 3, v,
               naming="not a CUDA tensor")
        raises(ValueError, c.attach_tensors, "p", k, v, components={"k": k}, naming="not both")
        if kvhost.built_with_cuda():
            # v's last layer is a row short: 480 bytes, 512 needed.
            raises(kvhost.InvalidArgument, c.attach_tensors, "p", k, v, naming="component 'v'")
        else:
            raises(kvhost.Unimplemented, c.attach_tensors, "p", k, v)
    finally:
        del sys.modules["torch"]


def test_session_loss_after_a_restart(daemon):
    with kvhost.Client(daemon.address, timeout=10, session=True, wait_ready=20) as c:
        assert c.session_losses() == kvhost.SessionLosses(0, "")
        c.create_pool("p", SPEC)
        dev = c.shm_device_pool("p", 8, daemon.shm)
        att = c.attach_shm("p", dev)
        c.open_session(10)
        state = c.session_state()
        assert state.open and state.session_id and state.reconnects == 0, state
        daemon.restart()
        deadline = time.monotonic() + 20
        while c.session_losses().count == 0:
            assert time.monotonic() < deadline, "no session loss reported after a restart"
            time.sleep(0.05)
        losses = c.session_losses()
        assert losses.count == 1, losses
        assert "restarted" in losses.last and "1 attachment(s) lost" in losses.last, losses
        assert att.id in losses.last or "attachment" in losses.last, losses
        assert c.session_state().reconnects >= 1
        # Its attachment went with the old daemon; leaving the block is fine.
        raises(kvhost.NotFound, att.detach)
        with att:
            pass
        dev.close()


def test_readme_quickstart(daemon, source_dir):
    """The Python quickstart of python/README.md and of the top README (the
    same code), as written, against this daemon, twice in a row: it leaves
    no pool behind, so a second run starts as the first did."""
    codes = []
    for readme in (os.path.join("python", "README.md"), "README.md"):
        text = open(os.path.join(source_dir, readme)).read()
        code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
        assert len(code.strip().splitlines()) <= 15, readme + ": the quickstart grew past 15 lines"
        assert kvhost.DEFAULT_ADDRESS in code, readme
        codes.append(code)
    assert codes[0] == codes[1], "README.md's Python quickstart differs from python/README.md's"
    code = compile(codes[0].replace(kvhost.DEFAULT_ADDRESS, daemon.address), "README.md", "exec")
    for _ in range(2):
        scope = {"__name__": "quickstart"}
        exec(code, scope)
        assert len(scope["slots"]) == 8, scope["slots"]
        with client(daemon) as c:
            assert c.list_pools() == [] and c.daemon_status()["attachments"] == 0
