#!/usr/bin/env python3
"""The kvhost Python package's CUDA calls, on GPU 0 against a kvhostd with
--backend=cuda --worker-copy (the Python twin of tests/c_api_gpu_test.c).

Device memory comes from libcudart through ctypes first, so neither torch
nor numpy is needed: attach_cuda of per-layer pointers, a backup that waits
on an exported interprocess event, a load waited on per layer on a stream,
a worker copy each way, and a hybrid pool group (MHA + MAMBA) attached with
attach_group_cuda, all checked byte for byte. Then, with torch, the same
group through attach_group_tensors, and the torch worker
(python_package_gpu_worker.py) runs once per memory kind, each in its own
process under a timeout: torch's default caching
allocator, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and tensors
over a raw cuMemCreate allocation. MHA and MLA per-layer tensors, byte-exact
backups (ordered by the worker's event) and loads (per-layer waits on
torch.cuda.current_stream() ordering a kernel that reads the layer).
The default kind's worker also drives kvhost.sglang's MHA pool on CUDA
from a side stream, as sglang's L2TransferEngine does: backups and
per-layer loads return with no host wait for the copy, and the stream's own
order (ready fence, the wait for the transfer's last layer) makes the bytes
right after stream.synchronize() alone.
A daemon that cannot import cuMem memory fails the last two kinds with
FAILED_PRECONDITION: they are never skipped.
Skips (exit 77) without a usable GPU, and after the ctypes checks passed
when torch is not installed.
  usage: python_package_gpu_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR
  $KVHOST_KVHOSTD, when set, is the daemon to run (a bundle's).
"""
import ctypes as C
import ctypes.util
import importlib.util
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


#: The torch workers' memory kinds (python_package_gpu_worker.py) and the
#: PYTORCH_CUDA_ALLOC_CONF each runs under ("" leaves torch's default).
TORCH_VARIANTS = (("default", ""), ("expandable", "expandable_segments:True"), ("cumem", ""))
#: Seconds one torch worker may take (its first CUDA call and two pools'
#: transfers take a few); a hung one is killed and fails.
WORKER_TIMEOUT_S = 120


ATTN_SPEC = dict(SPEC, layer_num=2)
SSM_SPEC = {"kind": "MAMBA", "layout": "PAGE_FIRST_DIRECT", "dtype": "BF16", "page_size": 1,
            "layer_num": 2, "size_tokens": 16,
            "mamba": {"temporal": {"dims": [2, 3]}, "temporal_dtype": "FP32",
                      "conv": [{"dims": [5]}]}}
HYBRID = {"layer_num": 4, "entries": [
    {"name": "kv", "pool": "attn", "layer_map": [0, -1, 1, -1], "anchor": True},
    {"name": "ssm", "pool": "ssm", "layer_map": [-1, 0, -1, 1]}]}
#: Group buffers, (entry, component, rows, row bytes), two layers each.
GROUP_BUFFERS = [("kv", "k", 16, 32), ("kv", "v", 16, 32), ("ssm", "temporal", 8, 24),
                 ("ssm", "conv0", 8, 10)]


def group_rows(entry):
    return (8, 16) if entry == "kv" else (3, 8)  # (rows moved, rows)


def check_group_attach(address, rt):
    """attach_group_cuda of a hybrid group (MHA + MAMBA) from one cudaMalloc;
    a backup with pool_transfers and a load back, byte for byte."""
    layout, image, at = [], bytearray(), 0
    for i, (entry, comp, rows, rb) in enumerate(GROUP_BUFFERS):
        moved = group_rows(entry)[0]
        for layer in range(2):
            layout.append((entry, comp, layer, at, rows, rb, moved))
            image += b"".join(bytes(1 + (i * 131 + layer * 31 + r * 7 + b) % 251
                                    for b in range(rb)) if r < moved else bytes(rb)
                              for r in range(rows))
            at += rows * rb
    base = C.c_void_p()
    cuda(rt.cudaMalloc(C.byref(base), len(image)), "cudaMalloc")
    try:
        cuda(rt.cudaMemcpy(base, bytes(image), len(image), H2D), "cudaMemcpy to")
        entries = {}
        for entry in ("kv", "ssm"):
            layers = {}
            for e, comp, _layer, off, _rows, _rb, _m in layout:
                if e == entry:
                    layers.setdefault(comp, []).append(base.value + off)
            sizes = {comp: rows * rb for e, comp, rows, rb in GROUP_BUFFERS if e == entry}
            entries[entry] = kvhost.CudaGroupEntry(layers, group_rows(entry)[1], sizes)
        with kvhost.Client(address, timeout=30, wait_ready=20) as c:
            c.create_pool("attn", ATTN_SPEC)
            c.create_pool("ssm", SSM_SPEC)
            c.create_group("hybrid", HYBRID)
            kv_host = c.alloc("hybrid", 8, numpy=False)
            ssm_host = c.alloc("ssm", 3, numpy=False)
            with c.attach_group_cuda("hybrid", entries) as att:
                assert att.group == "hybrid" and att.pool == "attn", att.info
                att.backup(kv_host, range(8), wait=True,
                           pool_transfers={"ssm": (ssm_host, range(3))})
                att.load(kv_host, range(8, 16),
                         pool_transfers={"ssm": (ssm_host, range(3, 6))}).wait(30)
        now = C.create_string_buffer(len(image))
        cuda(rt.cudaMemcpy(now, base, len(image), D2H), "cudaMemcpy back")
        for entry, comp, layer, off, _rows, rb, moved in layout:
            got = now.raw[off + moved * rb:off + 2 * moved * rb]
            assert got == bytes(image[off:off + moved * rb]), \
                f"entry {entry} component {comp} layer {layer} differs"
    finally:
        rt.cudaFree(base)


def check_group_tensors(address):
    """attach_group_tensors: the same group from torch tensors."""
    import torch  # noqa: PLC0415
    dev = torch.device("cuda", 0)
    tensors = {"kv": {"k": [torch.randint(0, 255, (16, 32), dtype=torch.uint8, device=dev)
                            for _ in range(2)],
                      "v": [torch.randint(0, 255, (16, 32), dtype=torch.uint8, device=dev)
                            for _ in range(2)]},
               "ssm": {"temporal": [torch.randint(0, 255, (8, 24), dtype=torch.uint8, device=dev)
                                    for _ in range(2)],
                       "conv0": [torch.randint(0, 255, (8, 10), dtype=torch.uint8, device=dev)
                                 for _ in range(2)]}}
    torch.cuda.synchronize()
    with kvhost.Client(address, timeout=30, wait_ready=20) as c:
        c.create_pool("attn2", ATTN_SPEC)
        c.create_pool("ssm2", SSM_SPEC)
        c.create_group("hybrid2", dict(HYBRID, entries=[
            dict(HYBRID["entries"][0], pool="attn2"), dict(HYBRID["entries"][1], pool="ssm2")]))
        kv_host = c.alloc("hybrid2", 8, numpy=False)
        ssm_host = c.alloc("ssm2", 3, numpy=False)
        with c.attach_group_tensors("hybrid2", tensors) as att:
            att.backup(kv_host, range(8), wait=True,
                       pool_transfers={"ssm": (ssm_host, range(3))})
            att.load(kv_host, range(8, 16),
                     pool_transfers={"ssm": (ssm_host, range(3, 6))}).wait(30)
        torch.cuda.synchronize()
        for entry, comps in tensors.items():
            moved = group_rows(entry)[0]
            for comp, layers in comps.items():
                for layer, t in enumerate(layers):
                    assert torch.equal(t[moved:2 * moved], t[:moved]), \
                        f"entry {entry} component {comp} layer {layer} differs"


def torch_workers(address, lib_path, src):
    """Runs the torch worker once per memory kind, each in its own process;
    returns the kinds that failed."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "python_package_gpu_worker.py")
    failed = []
    for variant, conf in TORCH_VARIANTS:
        env = dict(os.environ, KVHOST_LIBRARY=lib_path)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        try:
            run = subprocess.run([sys.executable, worker, variant, address, src], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 timeout=WORKER_TIMEOUT_S)
            out, rc = run.stdout, run.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out, rc = out + f"\n(killed after {WORKER_TIMEOUT_S} s)", -9
        print("\n".join("  " + line for line in out.rstrip().splitlines()))
        print(f"{'ok  ' if rc == 0 else 'FAIL'} torch worker, {variant} memory (exit {rc})")
        if rc != 0:
            failed.append(variant)
    return failed


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
    has_torch = importlib.util.find_spec("torch") is not None
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
        for check in (check_attach_backup_load, check_worker_copy, check_group_attach):
            try:
                check(f"unix://{sock}", rt)
                print(f"ok   {check.__name__}")
            except Exception as e:  # every check reports
                failed += 1
                print(f"FAIL {check.__name__}: {type(e).__name__}: {e}")
        if has_torch:
            try:
                check_group_tensors(f"unix://{sock}")
                print("ok   check_group_tensors")
            except Exception as e:
                failed += 1
                print(f"FAIL check_group_tensors: {type(e).__name__}: {e}")
            failed += len(torch_workers(f"unix://{sock}", lib_path, src))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        if failed:
            print("--- kvhostd log ---\n" + open(log.name).read())
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if failed:
        print(f"FAIL: {failed} check(s)")
        return 1
    if not has_torch:
        print("SKIP: the ctypes checks passed, but torch is not installed: the torch worker "
              "(default, expandable-segment and cuMem memory) did not run")
        return SKIP
    print("PASS: the CUDA calls through the Python package, and the torch worker over "
          "default, expandable-segment and cuMem memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
