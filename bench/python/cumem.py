"""Device memory from the CUDA driver's virtual memory API, through ctypes.

transfer_bench.py's ``--allocator=cumem``: the KV buffers of a worker whose
allocator maps physical handles itself (as vLLM's CuMemAllocator does)
instead of calling cudaMalloc. :class:`CuMemArena` reserves one virtual
range, creates one physical handle per buffer (cuMemCreate, POSIX file
descriptor handle type, rounded up to the allocation granularity), maps the
handles back to back and makes the range read-write for the GPU.
:func:`as_tensor` wraps a piece as a torch tensor through
``__cuda_array_interface__`` (no copy; the arena must outlive the tensor).

The structs are CUmemAllocationProp and CUmemAccessDesc of cuda.h (CUDA 12 /
13); tests/python_package_gpu_worker.py declares them the same way and ran
them on the H200 (docs/PERF.md, run U).

Not thread-safe; an arena belongs to the thread that made it. Needs a
current CUDA context (torch makes the primary one current).
"""

from __future__ import annotations

import ctypes as C
from typing import Any, List, Sequence


class _Location(C.Structure):
    """CUmemLocation."""

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


# CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
# CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
# CU_MEM_ALLOC_GRANULARITY_RECOMMENDED.
_PINNED, _POSIX_FD, _ON_DEVICE, _READ_WRITE, _RECOMMENDED = 1, 1, 1, 3, 1


def libcuda() -> Any:
    """libcuda.so.1 with the signatures used here (OSError without a driver)."""
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


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def is_cumem(cu: Any, ptr: int) -> bool:
    """Whether `ptr` lies in cuMemCreate memory (its handle can be retained):
    true of expandable segments too, false of cudaMalloc memory."""
    handle = C.c_uint64(0)
    if cu.cuMemRetainAllocationHandle(C.byref(handle), C.c_void_p(ptr)) != 0:
        return False
    cu.cuMemRelease(handle)
    return True


class CuMemArena:
    """`sizes` buffers of device memory on GPU `device`, each its own
    physical handle, mapped back to back in one reserved range.

    ``pointers[i]`` is buffer i's address. close() unmaps and releases
    everything (synchronise the GPU first).
    """

    def __init__(self, cu: Any, sizes: Sequence[int], device: int) -> None:
        self.cu = cu
        prop = _AllocProp()
        prop.type = _PINNED
        prop.requestedHandleTypes = _POSIX_FD
        prop.location = _Location(_ON_DEVICE, device)
        gran = C.c_size_t(0)
        _check(cu.cuMemGetAllocationGranularity(C.byref(gran), C.byref(prop), _RECOMMENDED),
               "cuMemGetAllocationGranularity")
        self.granule = gran.value
        rounded = [(s + self.granule - 1) // self.granule * self.granule for s in sizes]
        self.size = sum(rounded)
        self.base = C.c_uint64(0)
        self.handles: List[C.c_uint64] = []
        self.mapped = 0
        _check(cu.cuMemAddressReserve(C.byref(self.base), self.size, 0, 0, 0),
               f"cuMemAddressReserve of {self.size} bytes")
        self.pointers: List[int] = []
        try:
            at = self.base.value
            for nbytes in rounded:
                h = C.c_uint64(0)
                _check(cu.cuMemCreate(C.byref(h), nbytes, C.byref(prop), 0),
                       f"cuMemCreate of {nbytes} bytes (POSIX fd handle)")
                self.handles.append(h)
                _check(cu.cuMemMap(at, nbytes, 0, h, 0), "cuMemMap")
                self.mapped = at + nbytes - self.base.value
                self.pointers.append(at)
                at += nbytes
            access = _AccessDesc(_Location(_ON_DEVICE, device), _READ_WRITE)
            _check(cu.cuMemSetAccess(self.base.value, self.size, C.byref(access), 1),
                   "cuMemSetAccess")
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self.base.value == 0:
            return
        if self.mapped:
            self.cu.cuMemUnmap(self.base.value, self.mapped)
        for h in self.handles:
            self.cu.cuMemRelease(h)
        self.cu.cuMemAddressFree(self.base.value, self.size)
        self.base = C.c_uint64(0)
        self.handles, self.pointers, self.mapped = [], [], 0


class _CudaArray:
    """A device range as __cuda_array_interface__ (version 3)."""

    def __init__(self, ptr: int, shape: Sequence[int], typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None}


def as_tensor(torch: Any, ptr: int, shape: Sequence[int]) -> Any:
    """An int16 torch tensor of `shape` over device memory at `ptr` (bf16's
    bits: ``.view(torch.bfloat16)``; the interface has no bf16 type)."""
    t = torch.as_tensor(_CudaArray(ptr, shape, "<i2"), device="cuda")
    if t.data_ptr() != ptr:
        raise RuntimeError("torch copied the cuMem array instead of wrapping it")
    return t
