"""Worker copies: the copy runs in this process, on the caller's stream (CUDA).

With ``kvhostd --worker-copy`` a worker may run a transfer's copy kernel
itself, on its own CUDA stream, instead of the daemon's: the host pool is
mapped into this process. :class:`WorkerCopier` (from
``Attachment.worker_copier()``, which needs an attachment made from CUDA
buffers) queues copies; each gives a :class:`WorkerTicket` to make a
consumer stream wait for a layer, or to wait for the whole copy.

Unimplemented in a library built without CUDA; FailedPrecondition without
a usable GPU or for an attachment of shm buffers.

Ownership: close a copier before the CUDA context goes; closing waits for
every copy it started. A ticket may outlive its copier.
"""

from __future__ import annotations

import ctypes as C
from typing import Any, Optional

from . import _arrays, _lib
from ._handles import Handle
from ._streams import stream_arg


class WorkerTicket(Handle):
    """One worker copy: its daemon ticket id and layers, and waits on it."""

    _DESTROY = "kvhost_worker_ticket_destroy"

    def __init__(self, client: Any, ptr: C.c_void_p, copier: "WorkerCopier") -> None:
        super().__init__(client, ptr)
        self._copier = copier
        ticket_id, layers = C.c_uint64(0), C.c_uint32(0)
        _lib.call(_lib.lib().kvhost_worker_ticket_info, ptr, C.byref(ticket_id),
                  C.byref(layers))
        #: The daemon's ticket id.
        self.ticket_id = int(ticket_id.value)
        #: Layers the copy moves.
        self.layers = int(layers.value)

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Makes `stream` (the consumer's) wait until layer `layer` is copied."""
        _lib.call(_lib.lib().kvhost_worker_copy_wait_layer, self._copier._p(), self._p(),
                  int(layer), stream_arg(stream))

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until the copy ended and kvhostd was told (None: 1 min)."""
        _lib.call(_lib.lib().kvhost_worker_copy_wait, self._copier._p(), self._p(),
                  _lib.ms(timeout))


class WorkerCopier(Handle):
    """Runs an attachment's copies on the caller's CUDA streams."""

    _DESTROY = "kvhost_worker_copier_destroy"

    def __init__(self, client: Any, ptr: C.c_void_p, attachment: Any) -> None:
        super().__init__(client, ptr)
        self._attachment = attachment  # its buffers are the copier's device layers

    def _copy(self, fn_name: str, host_indices: Any, device_indices: Any,
              stream: Any) -> WorkerTicket:
        host, nh, keep_h = _arrays.int64_arg(host_indices, "host_indices")
        dev, nd, keep_d = _arrays.int64_arg(device_indices, "device_indices")
        out = C.c_void_p()
        _lib.call(getattr(_lib.lib(), fn_name), self._p(), host, nh, dev, nd,
                  stream_arg(stream), C.byref(out))
        del keep_h, keep_d
        return WorkerTicket(self._client, out, self)

    def backup(self, host_indices: Any, device_indices: Any, stream: Any = None) -> WorkerTicket:
        """Device rows -> host slots, queued on `stream`."""
        return self._copy("kvhost_worker_copy_backup", host_indices, device_indices, stream)

    def load(self, host_indices: Any, device_indices: Any, stream: Any = None) -> WorkerTicket:
        """Host slots -> device rows, queued on `stream`."""
        return self._copy("kvhost_worker_copy_load", host_indices, device_indices, stream)


def open_copier(attachment: Any, blocks: int = 0) -> WorkerCopier:
    """kvhost_worker_copier_open; blocks per launch, 0 for the default (8)."""
    ptr = C.c_void_p()
    _lib.call(_lib.lib().kvhost_worker_copier_open, attachment._client_handle(),
              attachment._p(), int(blocks), C.byref(ptr))
    return WorkerCopier(attachment._client, ptr, attachment)
