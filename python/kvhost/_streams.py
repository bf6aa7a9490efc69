"""CUDA streams and events as the C ABI takes them: a leaf of the package
(it imports only _lib), shared by the transfer calls, the worker copies and
the asynchronous calls.

A stream may be given as an int (``cudaStream_t``), as anything with
``.cuda_stream`` (torch.cuda.Stream) or ``.ptr`` (cupy), or None (the legacy
default stream). The worker's event before a backup may be the 64 handle
bytes, a ``torch.cuda.Event(interprocess=True)`` (its ``ipc_handle()``), or
a ``cudaEvent_t`` int (exported with :func:`cuda_export_event`).
"""

from __future__ import annotations

import ctypes as C
import operator
from typing import Any, Optional

from . import _lib


def stream_arg(stream: Any) -> Optional[int]:
    """A CUDA stream as the address the ABI takes (None: the legacy default)."""
    if stream is None:
        return None
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr)) or None
    if isinstance(stream, C.c_void_p):
        return stream.value
    try:
        return operator.index(stream) or None
    except TypeError:
        raise TypeError(f"stream must be None, an int (cudaStream_t), or have .cuda_stream, "
                        f"not {type(stream).__name__}") from None


def cuda_export_event(cuda_event: int) -> bytes:
    """The cudaIpcEventHandle_t bytes of a cudaEvent_t made with
    cudaEventInterprocess | cudaEventDisableTiming, for backup(event=...).

    Unimplemented in a library built without CUDA; FailedPrecondition
    without a usable GPU.
    """
    handle = C.create_string_buffer(_lib.CUDA_EVENT_HANDLE_BYTES)
    needed = C.c_size_t(0)
    _lib.call(_lib.lib().kvhost_cuda_export_event, C.c_void_p(int(cuda_event) or None), handle,
              len(handle), C.byref(needed))
    return handle.raw[: needed.value or _lib.CUDA_EVENT_HANDLE_BYTES]


def event_bytes(event: Any) -> Optional[bytes]:
    """backup's `event` as handle bytes (see the module doc)."""
    if event is None:
        return None
    if hasattr(event, "ipc_handle"):
        event = event.ipc_handle()
    if isinstance(event, (bytes, bytearray, memoryview)):
        return bytes(event)
    if isinstance(event, int):
        return cuda_export_event(event)
    raise TypeError(f"event must be handle bytes, a torch.cuda.Event or a cudaEvent_t int, "
                    f"not {type(event).__name__}")
