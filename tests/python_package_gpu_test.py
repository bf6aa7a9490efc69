#!/usr/bin/env python3
"""The kvhost Python package's CUDA calls, on GPU 0 against a kvhostd with
--backend=cuda --worker-copy (the Python twin of tests/c_api_gpu_test.c).

Device memory comes from libcudart through ctypes, so neither torch nor
numpy is needed: attach_cuda of per-layer pointers, a backup that waits on
an exported interprocess event, a load waited on per layer on a stream, and
a worker copy each way, all checked byte for byte. Where torch is installed
it runs the same round trip through attach_tensors, a
torch.cuda.Event(interprocess=True) and torch.cuda.current_stream().
Skips (exit 77) without a usable GPU.
  usage: python_package_gpu_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR
  $KVHOST_KVHOSTD, when set, is the daemon to run (a bundle's).
"""
import ctypes as C
import ctypes.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

SKIP = 77
SPEC = {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16", "page_size": 4,
        "layer_num": 3, "head_num": 2, "head_dim": 8, "size_tokens": 64}
ROW_BYTES, ROWS, MOVED, LAYERS = 32, 16, 8, 3
LAYER_BYTES = ROWS * ROW_BYTES
H2D, D2H = 1, 2  # cudaMemcpyKind
kvhost = None


def cudart():
    """libcudart through ctypes, or None (with why) when there is no GPU."""
    names = [n for n in (ctypes.util.find_library("cudart"),) if n]
    names += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in names:
        try:
            rt = C.CDLL(name)
        except OSError:
            continue
        count = C.c_int(0)
        rc = rt.cudaGetDeviceCount(C.byref(count))
        if rc != 0 or count.value == 0:
            return None, f"cudaGetDeviceCount: error {rc}, {count.value} device(s)"
        rt.cudaMalloc.argtypes = [C.POINTER(C.c_void_p), C.c_size_t]
        rt.cudaMemcpy.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t, C.c_int]
        rt.cudaFree.argtypes = [C.c_void_p]
        rt.cudaStreamCreateWithFlags.argtypes = [C.POINTER(C.c_void_p), C.c_uint]
        rt.cudaStreamSynchronize.argtypes = [C.c_void_p]
        rt.cudaStreamDestroy.argtypes = [C.c_void_p]
        rt.cudaEventCreateWithFlags.argtypes = [C.POINTER(C.c_void_p), C.c_uint]
        rt.cudaEventRecord.argtypes = [C.c_void_p, C.c_void_p]
        rt.cudaEventDestroy.argtypes = [C.c_void_p]
        return rt, ""
    return None, "no libcudart"


def cuda(rc, what):
    assert rc == 0, f"{what}: CUDA error {rc}"


def pattern(buffer, row):
    return bytes(1 + (buffer * 131 + row * 7 + b) % 251 for b in range(ROW_BYTES))


class DevicePool:
    """One cudaMalloc of component-major layer buffers and its host image."""

    def __init__(self, rt):
        self.rt = rt
        self.base = C.c_void_p()
        cuda(rt.cudaMalloc(C.byref(self.base), 2 * LAYERS * LAYER_BYTES), "cudaMalloc")
        image = bytearray()
        for i in range(2 * LAYERS):
            image += b"".join(pattern(i, r) if r < MOVED else bytes(ROW_BYTES)
                              for r in range(ROWS))
        self.image = bytes(image)
        cuda(rt.cudaMemcpy(self.base, self.image, len(self.image), H2D), "cudaMemcpy to")
        ptr = self.base.value
        self.layers = {"k": [ptr + i * LAYER_BYTES for i in range(LAYERS)],
                       "v": [ptr + (LAYERS + i) * LAYER_BYTES for i in range(LAYERS)]}

    def moved(self):
        """Rows [MOVED, 2 MOVED) of every buffer hold what rows [0, MOVED) had."""
        now = C.create_string_buffer(len(self.image))
        cuda(self.rt.cudaMemcpy(now, self.base, len(self.image), D2H), "cudaMemcpy back")
        for i in range(2 * LAYERS):
            at = i * LAYER_BYTES
            got = now.raw[at + MOVED * ROW_BYTES:at + 2 * MOVED * ROW_BYTES]
            want = self.image[at:at + MOVED * ROW_BYTES]
            assert got == want, f"buffer {i} (component {i // LAYERS} layer {i % LAYERS}) differs"

    def free(self):
        self.rt.cudaFree(self.base)


def check_attach_backup_load(address, rt):
    dev = DevicePool(rt)
    stream, written = C.c_void_p(), C.c_void_p()
    cuda(rt.cudaStreamCreateWithFlags(C.byref(stream), 1), "cudaStreamCreateWithFlags")
    try:
        with kvhost.Client(address, timeout=30, wait_ready=20) as c:
            c.create_pool("p", SPEC)
            host = c.alloc("p", MOVED, numpy=False)
            sizes = {"k": LAYER_BYTES, "v": LAYER_BYTES}
            with c.attach_cuda("p", dev.layers, ROWS, layer_bytes=sizes,
                               layer_progress=True) as att:
                assert att.info["backend"] == "cuda", att.info
                # The worker's event, recorded after its writes (disable timing | interprocess).
                cuda(rt.cudaEventCreateWithFlags(C.byref(written), 0x2 | 0x4), "event")
                cuda(rt.cudaEventRecord(written, stream), "cudaEventRecord")
                handle = kvhost.cuda_export_event(written.value)
                assert len(handle) == kvhost.CUDA_EVENT_HANDLE_BYTES
                att.backup(host, range(MOVED), wait=True, timeout=30, event=written.value)
                att.backup(host, range(MOVED), event=handle).wait(30)
                ticket = att.load(host, range(MOVED, 2 * MOVED), per_layer=True)
                assert ticket.event_set >= 0, ticket.event_set
                for layer in range(LAYERS):
                    ticket.wait_layer(layer, stream.value, timeout=10)
                cuda(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                ticket.wait(30)
                dev.moved()
    finally:
        if written.value:
            rt.cudaEventDestroy(written)
        rt.cudaStreamDestroy(stream)
        dev.free()


def check_worker_copy(address, rt):
    dev = DevicePool(rt)
    stream, consumer = C.c_void_p(), C.c_void_p()
    cuda(rt.cudaStreamCreateWithFlags(C.byref(stream), 1), "stream")
    cuda(rt.cudaStreamCreateWithFlags(C.byref(consumer), 1), "consumer stream")
    try:
        with kvhost.Client(address, timeout=30, wait_ready=20) as c:
            c.create_pool("w", SPEC)
            host = c.alloc("w", MOVED, numpy=False)
            with c.attach_cuda("w", dev.layers, ROWS) as att, att.worker_copier() as copier:
                with copier.backup(host, range(MOVED), stream.value) as backup:
                    assert backup.ticket_id and backup.layers == LAYERS, backup.layers
                    backup.wait(30)
                    kvhost.Ticket(c, backup.ticket_id).wait(30)
                with copier.load(host, range(MOVED, 2 * MOVED), stream.value) as load:
                    for layer in range(LAYERS):
                        load.wait_layer(layer, consumer.value)
                    try:
                        load.wait_layer(LAYERS, consumer.value)
                        raise AssertionError("a layer past the copy's was accepted")
                    except kvhost.InvalidArgument:
                        pass
                    cuda(rt.cudaStreamSynchronize(consumer), "sync consumer")
                    load.wait(30)
                dev.moved()
    finally:
        rt.cudaStreamDestroy(stream)
        rt.cudaStreamDestroy(consumer)
        dev.free()


def check_torch(address):
    try:
        import torch
    except ImportError:
        print("  (torch not installed: the ctypes checks cover the calls)")
        return
    from kvhost import torch_helpers
    k = [torch.zeros(ROWS, 2, 8, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    v = [torch.zeros(ROWS, 2, 8, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    for i, t in enumerate(k + v):
        t[:MOVED].view(torch.int16).copy_(
            torch.arange(MOVED * 16, dtype=torch.int16).reshape(MOVED, 2, 8) + i)
    with kvhost.Client(address, timeout=30, wait_ready=20) as c:
        c.create_pool("t", SPEC)
        host = c.alloc("t", MOVED)
        with c.attach_tensors("t", k, v, layer_progress=True) as att:
            event = torch_helpers.interprocess_event()
            event.record(torch.cuda.current_stream())
            att.backup(host, range(MOVED), event=event).wait(30)
            ticket = att.load(host, range(MOVED, 2 * MOVED), per_layer=True)
            for layer in range(LAYERS):
                ticket.wait_layer(layer, torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
            ticket.wait(30)
            for t in k + v:
                assert torch.equal(t[MOVED:2 * MOVED].view(torch.int16),
                                   t[:MOVED].view(torch.int16)), "a torch layer differs"


def main():
    global kvhost
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    kvhostd, lib_path, src = (os.path.abspath(a) for a in sys.argv[1:])
    kvhostd = os.environ.get("KVHOST_KVHOSTD") or kvhostd
    rt, why = cudart()
    if rt is None:
        print(f"SKIP: no usable CUDA GPU ({why})")
        return SKIP
    os.environ["KVHOST_LIBRARY"] = lib_path
    sys.path.insert(0, os.path.join(src, "python"))
    import kvhost as package
    kvhost = package
    if not kvhost.built_with_cuda():
        print("FAIL: libkvhost_c was built without CUDA")
        return 1
    tmp = tempfile.mkdtemp(prefix="kvhost-pygpu-")
    shm = tempfile.mkdtemp(prefix="kvhost-pygpu-", dir="/dev/shm")
    sock = os.path.join(tmp, "kvhost.sock")
    log = open(os.path.join(tmp, "kvhostd.log"), "w")
    proc = subprocess.Popen([kvhostd, f"--listen=unix://{sock}", f"--shm-dir={shm}",
                             "--backend=cuda", "--worker-copy"], stdout=log,
                            stderr=subprocess.STDOUT)
    failed = 0
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, "kvhostd did not start"
            time.sleep(0.02)
        for check in (check_attach_backup_load, check_worker_copy, check_torch):
            try:
                if check is check_torch:
                    check(f"unix://{sock}")
                else:
                    check(f"unix://{sock}", rt)
                print(f"ok   {check.__name__}")
            except Exception as e:  # every check reports
                failed += 1
                print(f"FAIL {check.__name__}: {type(e).__name__}: {e}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        if failed:
            print("--- kvhostd log ---\n" + open(log.name).read())
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print("FAIL" if failed else "PASS: the CUDA calls through the Python package")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
