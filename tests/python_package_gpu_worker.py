#!/usr/bin/env python3
"""One torch worker of tests/python_package_gpu_test.py, in a process of its own.

The same body runs over three kinds of CUDA memory (the VARIANT argument):
  default     torch's caching allocator (cudaMalloc: legacy CUDA IPC)
  expandable  torch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
              (the parent sets it; cuMemCreate memory)
  cumem       a raw cuMemCreate allocation through libcuda.so.1 (POSIX fd
              handles, several handles mapped side by side in one reserved
              range), wrapped as torch tensors through __cuda_array_interface__;
              every tensor spans several handles and none starts at one.
For the two cuMem kinds the memory is checked to be cuMem memory
(cuMemRetainAllocationHandle succeeds on it), so that the variant cannot pass
on memory of the default kind.

The body, per pool (MHA LAYER_FIRST and MLA PAGE_FIRST, per-layer tensors):
  1. backup: rows written by a torch kernel queued behind a long sleep on the
     current stream, the worker's interprocess event recorded after them and
     passed with the backup (no synchronisation): the host pages read back
     byte for byte with get_data_page, so the copy waited for the event;
  2. load: host pages written with set_from_flat_data_page, a per-layer load
     into other rows; after wait_layer(l, stream=torch.cuda.current_stream())
     a torch kernel gathers layer l's rows at once, and what it gathered must
     be the loaded bytes;
  3. the round trip: the load's rows backed up again and loaded into a third
     set of rows, equal to the first.
Then (default memory only) kvhost.sglang's MHA pool on CUDA, as sglang's
L2TransferEngine drives it from a side stream (check_sglang): each
backup_from_device_all_layer returns while the rows are still being
written behind a sleep on that stream (no host wait), and after only
stream.synchronize() the host pages equal the rows the kernel wrote (the
pool's ready fence on the stream, and the stream's wait for the backup's
end); six backups in a row, past the fence ring's size. Per-layer loads
return without a host wait for the copy (the load's ticket is kept, not
waited for), and after stream.synchronize() a kernel queued after each
layer's call saw that layer's loaded bytes.
  usage: python_package_gpu_worker.py VARIANT ADDRESS SOURCE_DIR
  (KVHOST_LIBRARY names libkvhost_c). Exit 0 passed, 1 failed.
"""
import ctypes as C
import os
import sys
import traceback

ROWS, MOVED, LAYERS, PS = 16384, 2048, 4, 16
SHAPES = {
    # name: (spec, {component: per-row shape of bf16})
    "mha": ({"kind": "MHA", "layout": "LAYER_FIRST", "dtype": "BF16", "page_size": PS,
             "layer_num": LAYERS, "head_num": 2, "head_dim": 128, "size_tokens": 4 * MOVED},
            {"k": (2, 128), "v": (2, 128)}),
    "mla": ({"kind": "MLA", "layout": "PAGE_FIRST", "dtype": "BF16", "page_size": PS,
             "layer_num": LAYERS, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
             "size_tokens": 4 * MOVED},
            {"latent": (1, 576)}),
}
#: torch.cuda._sleep cycles before the rows of a backup are written: some
#: 10-50 ms, far longer than submitting the backup takes.
SLEEP_CYCLES = 50_000_000

kvhost = None
torch = None


# --- cuMem through libcuda ------------------------------------------------

class _Location(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class _AllocFlags(C.Structure):
    _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class _AllocProp(C.Structure):
    """CUmemAllocationProp."""
    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", _Location),
                ("win32HandleMetaData", C.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(C.Structure):
    """CUmemAccessDesc."""
    _fields_ = [("location", _Location), ("flags", C.c_int)]


_PINNED, _POSIX_FD, _ON_DEVICE, _READ_WRITE, _RECOMMENDED = 1, 1, 1, 3, 1


def libcuda():
    cu = C.CDLL("libcuda.so.1")
    u64, vp, sz = C.c_uint64, C.c_void_p, C.c_size_t
    sigs = {
        "cuMemGetAllocationGranularity": [C.POINTER(sz), C.POINTER(_AllocProp), C.c_int],
        "cuMemCreate": [C.POINTER(u64), sz, C.POINTER(_AllocProp), u64],
        "cuMemAddressReserve": [C.POINTER(u64), sz, sz, u64, u64],
        "cuMemMap": [u64, sz, sz, u64, u64],
        "cuMemSetAccess": [u64, sz, C.POINTER(_AccessDesc), sz],
        "cuMemUnmap": [u64, sz],
        "cuMemRelease": [u64],
        "cuMemAddressFree": [u64, sz],
        "cuMemRetainAllocationHandle": [C.POINTER(u64), vp],
    }
    for name, args in sigs.items():
        fn = getattr(cu, name)
        fn.argtypes, fn.restype = args, C.c_int
    return cu


def cu_check(rc, what):
    assert rc == 0, f"{what}: CUresult {rc}"


def is_cumem(cu, ptr):
    """Whether `ptr` lies in cuMemCreate memory (a handle can be retained)."""
    handle = C.c_uint64(0)
    if cu.cuMemRetainAllocationHandle(C.byref(handle), C.c_void_p(ptr)) != 0:
        return False
    cu.cuMemRelease(handle)
    return True


class CuMemArena:
    """A reserved range mapped from handles of two granules each (POSIX fd
    handles, read-write for this GPU); carve() hands out pieces that start
    off a handle boundary, so each tensor spans several handles."""

    def __init__(self, cu, nbytes, device):
        self.cu = cu
        self.prop = _AllocProp()
        self.prop.type = _PINNED
        self.prop.requestedHandleTypes = _POSIX_FD
        self.prop.location = _Location(_ON_DEVICE, device)
        gran = C.c_size_t(0)
        cu_check(cu.cuMemGetAllocationGranularity(C.byref(gran), C.byref(self.prop),
                                                  _RECOMMENDED), "granularity")
        self.granule = gran.value
        self.chunk = 2 * self.granule
        self.size = (nbytes + self.granule // 2 + self.chunk - 1) // self.chunk * self.chunk
        self.base = C.c_uint64(0)
        cu_check(cu.cuMemAddressReserve(C.byref(self.base), self.size, 0, 0, 0), "reserve")
        self.handles = []
        for at in range(0, self.size, self.chunk):
            h = C.c_uint64(0)
            cu_check(cu.cuMemCreate(C.byref(h), self.chunk, C.byref(self.prop), 0), "cuMemCreate")
            self.handles.append(h)
            cu_check(cu.cuMemMap(self.base.value + at, self.chunk, 0, h, 0), "cuMemMap")
        access = _AccessDesc(_Location(_ON_DEVICE, device), _READ_WRITE)
        cu_check(cu.cuMemSetAccess(self.base.value, self.size, C.byref(access), 1), "access")
        # Half a granule in: no piece starts where a handle does.
        self.next = self.base.value + self.granule // 2

    def carve(self, nbytes):
        at = self.next
        self.next += (nbytes + 255) // 256 * 256
        assert self.next <= self.base.value + self.size, "arena too small"
        return at

    def close(self):
        self.cu.cuMemUnmap(self.base.value, self.size)
        for h in self.handles:
            self.cu.cuMemRelease(h)
        self.cu.cuMemAddressFree(self.base.value, self.size)


class _CudaArray:
    """A device range as __cuda_array_interface__ (int16: bf16's bits)."""

    def __init__(self, ptr, shape):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": "<i2",
                                         "data": (ptr, False), "version": 3, "strides": None}


# --- the body ---------------------------------------------------------------

class Tensors:
    """Per-layer int16 tensors (bf16 bits) of every component, of one variant."""

    def __init__(self, variant, comps, cu):
        self.arena = None
        self.layers = {}
        if variant == "cumem":
            total = sum(LAYERS * ROWS * 2 * _numel(s) + 256 for s in comps.values())
            self.arena = CuMemArena(cu, total, torch.cuda.current_device())
        for name, shape in comps.items():
            per = []
            for _ in range(LAYERS):
                if self.arena is not None:
                    ptr = self.arena.carve(ROWS * 2 * _numel(shape))
                    t = torch.as_tensor(_CudaArray(ptr, (ROWS,) + shape), device="cuda")
                    assert t.data_ptr() == ptr, "torch copied the cuMem array"
                else:
                    t = torch.empty((ROWS,) + shape, dtype=torch.int16, device="cuda")
                t.zero_()
                per.append(t)
            self.layers[name] = per
        if cu is not None:
            for name, per in self.layers.items():
                for layer, t in enumerate(per):
                    assert is_cumem(cu, t.data_ptr()), \
                        f"{variant}: {name} layer {layer} is not cuMem memory"

    def bf16(self):
        return {n: [t.view(torch.bfloat16) for t in ts] for n, ts in self.layers.items()}

    def close(self):
        self.layers = {}
        torch.cuda.synchronize()
        if self.arena is not None:
            self.arena.close()


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def expected_page(spec, tensors, rows):
    """The flat page (pool.proto PageData) of device rows `rows` (one page)."""
    idx = torch.tensor(rows, dtype=torch.int64, device="cuda")
    parts = []
    for per in tensors.layers.values():
        got = torch.stack([t.index_select(0, idx).reshape(len(rows), -1) for t in per])
        if spec["layout"] == "PAGE_FIRST":  # (ps, L, row): token-major
            got = got.transpose(0, 1)
        parts.append(got.contiguous().cpu().numpy().tobytes())
    return b"".join(parts)


def random_rows(count, seed):
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(ROWS // PS, generator=g)[:count // PS]
    return [int(p) * PS + o for p in pages.tolist() for o in range(PS)]


def check_pool(c, variant, kind, cu):
    spec, comps = SHAPES[kind]
    name = f"{kind}-{variant}"
    c.create_pool(name, spec)
    tensors = Tensors(variant, comps, cu)
    stream = torch.cuda.current_stream()
    try:
        host = c.alloc(name, MOVED, numpy=False)
        src, dst, third = (random_rows(3 * MOVED, 7)[i * MOVED:(i + 1) * MOVED]
                           for i in range(3))
        src_t = torch.tensor(src, device="cuda")
        bf = tensors.bf16()
        att = c.attach_tensors(name, components=bf, layer_progress=True)
        with att:
            assert att.info["backend"] == "cuda", att.info
            # 1. The rows are written behind a sleep; only the event orders the copy.
            event = kvhost.torch_helpers.interprocess_event()
            torch.cuda._sleep(SLEEP_CYCLES)
            for i, per in enumerate(tensors.layers.values()):
                for layer, t in enumerate(per):
                    fill = torch.randint(-32768, 32767, (MOVED,) + t.shape[1:], dtype=torch.int16,
                                         device="cuda", generator=None)
                    t.index_copy_(0, src_t, fill)
            event.record(stream)
            ticket = att.backup(host, src, event=event)
            ticket.wait(60)
            for p in range(MOVED // PS):
                want = expected_page(spec, tensors, src[p * PS:(p + 1) * PS])
                got = c.get_data_page(name, host[p * PS])
                assert got == want, f"{variant} {kind}: backup page {p} differs from the rows"
            # 2. Host pages written, loaded per layer; a kernel reads each layer at once.
            pages = {}
            for p in range(MOVED // PS):
                data = os.urandom(len(want))
                pages[p] = data
                c.set_from_flat_data_page(name, host[p * PS], data)
            dst_t = torch.tensor(dst, device="cuda")
            load = att.load(host, dst, per_layer=True)
            seen = {}
            for layer in range(LAYERS):
                load.wait_layer(layer, stream=torch.cuda.current_stream(), timeout=30)
                for cname, per in tensors.layers.items():
                    seen[(cname, layer)] = per[layer].index_select(0, dst_t)  # on the stream
            stream.synchronize()
            load.wait(60)
            for p in range(MOVED // PS):
                rows = dst[p * PS:(p + 1) * PS]
                assert expected_page(spec, tensors, rows) == pages[p], \
                    f"{variant} {kind}: loaded page {p} differs from the host page"
            for (cname, layer), got in seen.items():
                now = tensors.layers[cname][layer].index_select(0, dst_t)
                assert torch.equal(got, now), \
                    f"{variant} {kind}: the kernel after wait_layer({layer}) saw other bytes " \
                    f"of '{cname}' than the load wrote"
            # 3. Round trip: dst -> host -> third equals dst.
            att.backup(host, dst, wait=True, timeout=60)
            att.load(host, third, wait=True, timeout=60)
            third_t = torch.tensor(third, device="cuda")
            for cname, per in tensors.layers.items():
                for layer, t in enumerate(per):
                    assert torch.equal(t.index_select(0, dst_t), t.index_select(0, third_t)), \
                        f"{variant} {kind}: round trip differs ({cname} layer {layer})"
        c.delete_pool(name)
    finally:
        tensors.close()


class _SglangDevicePool:
    """What kvhost.sglang reads of sglang's MHA device pool."""

    def __init__(self, tensors):
        bf = tensors.bf16()
        self.k_buffer, self.v_buffer = bf["k"], bf["v"]


def check_sglang(c):
    """kvhost.sglang's MHA pool on CUDA with no host waits (module doc)."""
    from kvhost import sglang as kvs
    spec, comps = SHAPES["mha"]
    tensors = Tensors("default", comps, None)
    pool = kvs.MHATokenToKVPoolHost(
        "sgl-cuda", client=c, layout="layer_first", dtype="bfloat16", page_size=PS,
        layer_num=LAYERS, head_num=2, head_dim=128, host_size_tokens=4 * MOVED, tensors=True)
    dev = _SglangDevicePool(tensors)
    side = torch.cuda.Stream()
    try:
        host = pool.alloc(MOVED)
        assert host is not None
        host_list = [int(x) for x in host.tolist()]
        # Attached before the timed calls: opening the buffers and pinning
        # the pool may take longer than the sleep.
        att = pool._attachment(dev)
        assert att.info["backend"] == "cuda" and att.info["load_event_sets"] == 16, att.info
        for n in range(6):  # past READY_FENCES: every fence is re-armed
            src = random_rows(MOVED, 11 + n)
            src_cpu = torch.tensor(src, dtype=torch.int64)
            with torch.cuda.stream(side):
                # Copied before the sleep: a copy from pageable memory waits
                # for the stream on the host.
                src_t = src_cpu.cuda()
                torch.cuda._sleep(SLEEP_CYCLES)
                for per in tensors.layers.values():
                    for t in per:
                        fill = torch.randint(-32768, 32767, (MOVED,) + t.shape[1:],
                                             dtype=torch.int16, device="cuda")
                        t.index_copy_(0, src_t, fill)
                pool.backup_from_device_all_layer(dev, host, src_cpu, "kernel")
                ack = torch.cuda.Event()
                ack.record(side)
            assert not ack.query(), \
                f"backup {n}: the call waited on the host (the sleep before the rows was over)"
            side.synchronize()  # no ticket wait: only the stream's own order
            for p in range(MOVED // PS):
                want = expected_page(spec, tensors, src[p * PS:(p + 1) * PS])
                got = c.get_data_page("sgl-cuda", host_list[p * PS])
                assert got == want, f"sglang backup {n}: page {p} differs from the rows " \
                                    f"the kernel wrote before the call"
        pages = {}
        for p in range(MOVED // PS):
            pages[p] = os.urandom(len(want))
            c.set_from_flat_data_page("sgl-cuda", host_list[p * PS], pages[p])
        dst = random_rows(MOVED, 5)
        dst_cpu = torch.tensor(dst, dtype=torch.int64)
        seen = {}
        with torch.cuda.stream(side):
            dst_t = dst_cpu.cuda()
            for layer in range(LAYERS):
                pool.load_to_device_per_layer(dev, host, dst_cpu, layer, "kernel")
                for cname, per in tensors.layers.items():
                    seen[(cname, layer)] = per[layer].index_select(0, dst_t)  # on `side`
        assert len(pool._transfers.kept) >= 1, "the load's ticket was waited for, not kept"
        side.synchronize()
        for p in range(MOVED // PS):
            assert expected_page(spec, tensors, dst[p * PS:(p + 1) * PS]) == pages[p], \
                f"sglang load: page {p} differs from the host page"
        for (cname, layer), got in seen.items():
            now = tensors.layers[cname][layer].index_select(0, dst_t)
            assert torch.equal(got, now), f"sglang load: the kernel after layer {layer}'s " \
                                          f"call saw other bytes of '{cname}'"
        pool.close()  # waits for the kept tickets, raising a failed one
        c.delete_pool("sgl-cuda")
    finally:
        tensors.close()


def main():
    global kvhost, torch
    variant, address, src = sys.argv[1:4]
    sys.path.insert(0, os.path.join(src, "python"))
    import torch as torch_module
    import kvhost as package
    import kvhost.torch_helpers  # noqa: F401
    torch, kvhost = torch_module, package
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    cu = libcuda() if variant in ("expandable", "cumem") else None
    if variant == "expandable":
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        assert "expandable_segments:True" in conf, conf
    failed = 0
    with kvhost.Client(address, timeout=60, wait_ready=20) as c:
        for kind in SHAPES:
            try:
                check_pool(c, variant, kind, cu)
                print(f"ok   {variant} {kind}")
            except Exception as e:  # both kinds report
                failed += 1
                hint = ""
                if isinstance(e, kvhost.FailedPrecondition) and variant != "default":
                    hint = " (a daemon without cuMem import refuses such memory so)"
                print(f"FAIL {variant} {kind}: {type(e).__name__}: {e}{hint}")
                traceback.print_exc()
    if variant == "default":
        with kvhost.Client(address, timeout=60, wait_ready=20) as c:
            try:
                check_sglang(c)
                print("ok   default kvhost.sglang on CUDA, no host waits")
            except Exception as e:
                failed += 1
                print(f"FAIL default kvhost.sglang: {type(e).__name__}: {e}")
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
