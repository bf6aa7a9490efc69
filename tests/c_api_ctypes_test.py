#!/usr/bin/env python3
"""The C ABI from Python's ctypes, the way a Python package would use it.

Starts the built kvhostd (host backend, a private socket and shm dir), loads
libkvhost_c.so with ctypes, and runs a worker's round trip through it. It
makes a pool from a JSON spec, reads the pool back as JSON, and fills a shm
device pool through its layer pointers. It backs up and loads the rows and
compares them byte for byte. It checks the error contract as Python sees it:
codes, messages in a ctypes buffer, sizes asked with NULL, and the
kvhost_load_ticket struct. Needs no numpy.
  usage: c_api_ctypes_test.py KVHOSTD LIBKVHOST_C
"""
import ctypes as C
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

OK, INVALID_ARGUMENT, NOT_FOUND, OUT_OF_RANGE = 0, 3, 5, 11
SPEC = {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16", "page_size": 4,
        "layer_num": 3, "head_num": 2, "head_dim": 8, "size_tokens": 64}
ROW_BYTES = 2 * 8 * 2


class LoadTicket(C.Structure):
    _fields_ = [("ticket_id", C.c_uint64), ("event_set", C.c_int32),
                ("reserved", C.c_uint32), ("layer_base", C.c_uint64)]


def bind(lib):
    """Declares the calls used here; every one ends in (char* err, size_t err_len)."""
    vp, sz, u32, u64, i64 = C.c_void_p, C.c_size_t, C.c_uint32, C.c_uint64, C.c_int64
    cp, err = C.c_char_p, [C.c_char_p, C.c_size_t]
    p64, psz = C.POINTER(C.c_int64), C.POINTER(C.c_size_t)
    sigs = {
        "kvhost_abi_version": ([], C.c_int),
        "kvhost_code_name": ([C.c_int], cp),
        "kvhost_connect": ([cp, i64, C.c_int, C.POINTER(vp)] + err, C.c_int),
        "kvhost_client_wait_ready": ([vp, i64] + err, C.c_int),
        "kvhost_client_close": ([vp], None),
        "kvhost_pool_create": ([vp, cp, cp] + err, C.c_int),
        "kvhost_pool_get_json": ([vp, cp, C.c_void_p, sz, psz] + err, C.c_int),
        "kvhost_alloc": ([vp, cp, u64, p64, sz, psz] + err, C.c_int),
        "kvhost_shm_device_pool_create":
            ([vp, cp, u64, cp, u32, u32, C.POINTER(vp)] + err, C.c_int),
        "kvhost_shm_device_pool_destroy": ([vp], None),
        "kvhost_shm_device_pool_layer":
            ([vp, u32, u32, C.POINTER(vp), C.POINTER(u64)] + err, C.c_int),
        "kvhost_attach_shm": ([vp, cp, vp, cp, C.POINTER(vp)] + err, C.c_int),
        "kvhost_attachment_destroy": ([vp], None),
        "kvhost_backup": ([vp, vp, p64, sz, p64, sz, vp, sz, u32, i64, C.POINTER(u64)] + err,
                          C.c_int),
        "kvhost_load_with_events":
            ([vp, vp, p64, sz, p64, sz, C.POINTER(LoadTicket)] + err, C.c_int),
        "kvhost_transfer_wait": ([vp, u64, i64, C.c_void_p, sz, psz] + err, C.c_int),
    }
    for name, (args, res) in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    return lib


class Error(Exception):
    def __init__(self, code, name, message):
        super().__init__(f"{name}: {message}")
        self.code = code


def call(lib, fn, *args):
    """fn(*args, err, len): raises Error with the code's name and the message."""
    err = C.create_string_buffer(512)
    rc = fn(*args, err, len(err))
    if rc != OK:
        raise Error(rc, lib.kvhost_code_name(rc).decode(), err.value.decode())


def get_json(lib, fn, *args):
    """A JSON answer: its size first (NULL, 0), then the text."""
    needed = C.c_size_t(0)
    try:
        call(lib, fn, *args, None, 0, C.byref(needed))
        raise AssertionError("a NULL buffer was accepted")
    except Error as e:
        assert e.code == OUT_OF_RANGE, e
    buf = C.create_string_buffer(needed.value)
    call(lib, fn, *args, buf, len(buf), None)
    return json.loads(buf.value.decode())


def expect(code, lib, fn, *args, naming=None):
    try:
        call(lib, fn, *args)
    except Error as e:
        assert e.code == code, f"{e} (code {e.code}, want {code})"
        assert naming is None or naming in str(e), f"'{e}' does not name {naming!r}"
        return
    raise AssertionError(f"{fn.__name__} succeeded, want code {code}")


def run(lib, address, shm_dir):
    assert lib.kvhost_abi_version() == 1
    client = C.c_void_p()
    call(lib, lib.kvhost_connect, address.encode(), 10000, 0, C.byref(client))
    dev, att = C.c_void_p(), C.c_void_p()
    try:
        call(lib, lib.kvhost_client_wait_ready, client, 20000)
        call(lib, lib.kvhost_pool_create, client, b"p", json.dumps(SPEC).encode())
        expect(INVALID_ARGUMENT, lib, lib.kvhost_pool_create, client, b"x", b"{bad")
        expect(NOT_FOUND, lib, lib.kvhost_pool_get_json, client, b"nope", None, 0, None,
               naming="nope")
        pool = get_json(lib, lib.kvhost_pool_get_json, client, b"p")
        assert pool["name"] == "p" and pool["available_tokens"] == "64", pool

        host = (C.c_int64 * 8)()
        count = C.c_size_t(0)
        expect(OUT_OF_RANGE, lib, lib.kvhost_alloc, client, b"p", 8, host, 4, C.byref(count))
        assert count.value == 8
        call(lib, lib.kvhost_alloc, client, b"p", 8, host, 8, C.byref(count))

        call(lib, lib.kvhost_shm_device_pool_create, client, b"p", 16, shm_dir.encode(), 0, 0,
             C.byref(dev))
        want = {}
        for c in range(2):
            for layer in range(3):
                base, size = C.c_void_p(), C.c_uint64()
                call(lib, lib.kvhost_shm_device_pool_layer, dev, c, layer, C.byref(base),
                     C.byref(size))
                assert size.value == 16 * ROW_BYTES
                rows = bytes((c * 7 + layer * 3 + i) % 251 + 1 for i in range(8 * ROW_BYTES))
                C.memmove(base.value, rows, len(rows))
                want[c, layer] = (base.value, rows)
        call(lib, lib.kvhost_attach_shm, client, b"p", dev, b'{"layer_progress": true}',
             C.byref(att))
        first = (C.c_int64 * 8)(*range(8))
        second = (C.c_int64 * 8)(*range(8, 16))
        ticket = C.c_uint64(0)
        call(lib, lib.kvhost_backup, client, att, host, 8, first, 8, None, 0, 1, 0,
             C.byref(ticket))
        load = LoadTicket()
        call(lib, lib.kvhost_load_with_events, client, att, host, 8, second, 8, C.byref(load))
        assert load.ticket_id != 0 and load.event_set >= 0, (load.ticket_id, load.event_set)
        status = get_json(lib, lib.kvhost_transfer_wait, client, load.ticket_id, 30000)
        assert status["done"] is True, status
        for (c, layer), (base, rows) in want.items():
            got = C.string_at(base + 8 * ROW_BYTES, len(rows))
            assert got == rows, f"component {c} layer {layer} differs after the round trip"
    finally:
        lib.kvhost_attachment_destroy(att)
        lib.kvhost_shm_device_pool_destroy(dev)
        lib.kvhost_client_close(client)


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    kvhostd, so = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="kvhost-ctypes-")
    shm = tempfile.mkdtemp(prefix="kvhost-ctypes-", dir="/dev/shm")
    sock = os.path.join(tmp, "kvhost.sock")
    log = open(os.path.join(tmp, "kvhostd.log"), "w")
    proc = subprocess.Popen([kvhostd, f"--listen=unix://{sock}", f"--shm-dir={shm}",
                             "--backend=host"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock) and time.monotonic() < deadline:
            assert proc.poll() is None, "kvhostd exited during start"
            time.sleep(0.01)
        run(bind(C.CDLL(so)), f"unix://{sock}", shm)
        print("PASS: pools, buffers, shm round trip and errors through ctypes")
        return 0
    except (AssertionError, Error) as e:
        log.flush()
        print(f"FAIL: {e}\n--- kvhostd log ---\n{open(log.name).read()}")
        return 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
