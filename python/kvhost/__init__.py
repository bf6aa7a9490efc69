"""kvhost: Python bindings for kvhostd's host KV-cache pools.

A pure-Python package over the C ABI (libkvhost_c.so) through ctypes; see
python/README.md. A scheduler makes pools and allocates slots; a worker
attaches its device KV buffers and moves rows between them and the slots::

    import kvhost
    with kvhost.Client("unix:///run/kvhost/kvhost.sock") as c:
        c.create_pool("p", {"kind": "MHA", "layout": "PAGE_FIRST", ...})
        slots = c.alloc("p", 64)
        with c.async_calls() as calls:          # without blocking: Futures
            freed = calls.free("p", slots)      # returns at once
        print(freed.result())                   # the block waited for it

The library is loaded on first use, so importing works without it; the
first call raises :class:`LibraryError` naming where it looked.
"""

from ._lib import ABI_VERSION, CUDA_EVENT_HANDLE_BYTES, candidates, code_name, library_path
from ._streams import cuda_export_event
from .async_calls import AsyncCalls
from .cache import (CacheEvent, CacheEventBatch, CacheStats, EventKind, EvictOutcome, KeyState,
                    LookupResult, NodeCache, StoreResult)
from .client import DEFAULT_ADDRESS, Client, SessionLosses, SessionState, connect
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, KvhostError, LibraryError,
                     NotFound, OutOfRange, PermissionDenied, ResourceExhausted, StatusCode,
                     Unauthenticated, Unavailable, Unimplemented, Unknown)
from .pools import Pool
from .shm import Component, ShmDevicePool
from .storage import PageOutcome, PagesResult
from .transfer import Attachment, CudaGroupEntry, LoadTicket, Ticket
from .worker import WorkerCopier, WorkerTicket

__version__ = "0.1.0"


def abi_version() -> int:
    """The loaded library's C ABI version (this package speaks ABI_VERSION)."""
    from . import _lib  # noqa: PLC0415 (the submodule, not a name it exports)
    return int(_lib.lib().kvhost_abi_version())


def built_with_cuda() -> bool:
    """Whether the loaded library was built with CUDA (attach_cuda can work)."""
    from . import _lib  # noqa: PLC0415 (the submodule, not a name it exports)
    return bool(_lib.lib().kvhost_built_with_cuda())


__all__ = [
    "ABI_VERSION", "CUDA_EVENT_HANDLE_BYTES", "DEFAULT_ADDRESS", "Aborted", "AlreadyExists",
    "AsyncCalls", "Attachment", "CacheEvent", "CacheEventBatch", "CacheStats", "Cancelled",
    "Client", "Component", "CudaGroupEntry", "DataLoss", "DeadlineExceeded", "EventKind",
    "EvictOutcome", "FailedPrecondition", "Internal", "InvalidArgument", "KeyState",
    "KvhostError", "LibraryError", "LoadTicket", "LookupResult", "NodeCache", "NotFound",
    "OutOfRange", "PageOutcome", "PagesResult", "PermissionDenied", "Pool",
    "ResourceExhausted", "SessionLosses", "SessionState", "ShmDevicePool", "StatusCode",
    "StoreResult", "Ticket",
    "Unauthenticated", "Unavailable", "Unimplemented", "Unknown", "WorkerCopier", "WorkerTicket",
    "abi_version", "built_with_cuda", "candidates", "code_name", "connect", "cuda_export_event",
    "library_path", "__version__",
]
