"""Shared-memory "device" buffers for the host backend (kvhost::ShmDevicePool).

On a kvhostd with ``--backend=host`` a worker's device KV pool is a file in
the daemon's ``--shm-dir``: one buffer per component (``k``, ``v``,
``latent``, ...) and attached layer, each ``rows`` rows of ``row_bytes``.
:class:`ShmDevicePool` makes one shaped after a pool and exposes each
layer's buffer as a writable view: a flat byte memoryview (row ``r`` is
``view[r * row_bytes:(r + 1) * row_bytes]``), or a ``(rows, row_bytes)``
numpy array when numpy is installed (``dtype`` reinterprets each row). Row
``r`` of component ``k`` is what device index ``r`` means to backup / load.

Ownership: the pool owns the mapping. Views keep the Python object alive,
but close() unmaps at once: a view used after close() faults. Close the
attachments on it first (an attachment keeps its device pool open).
Not synchronised; order your writes and reads against transfers by waiting
for their tickets.
"""

from __future__ import annotations

import ctypes as C
from typing import Any, List, NamedTuple, Optional, Union

from . import _arrays, _lib
from ._handles import Handle


class Component(NamedTuple):
    """One buffer kind of a device pool (kvhost_shm_device_pool_component)."""

    #: Pool.components name: "k", "v", "latent", ...
    name: str
    #: Rows per layer buffer.
    rows: int
    #: Bytes per row.
    row_bytes: int
    #: Token slots per row: 1, or page_size for a row-per-page component.
    row_tokens: int


class ShmDevicePool(Handle):
    """A worker's stand-in device KV pool in shared memory (host backend).

    Made by :meth:`kvhost.Client.shm_device_pool`; attach it with
    :meth:`kvhost.Client.attach_shm`.
    """

    _DESTROY = "kvhost_shm_device_pool_destroy"

    def __init__(self, client: Any, ptr: C.c_void_p, pool: str) -> None:
        super().__init__(client, ptr)
        self.pool = pool
        lib = _lib.lib()
        components, layers, nbytes = C.c_uint32(0), C.c_uint32(0), C.c_uint64(0)
        _lib.call(lib.kvhost_shm_device_pool_info, ptr, C.byref(components), C.byref(layers),
                  C.byref(nbytes))
        #: Attached layers (the pool's range unless one was given).
        self.layers = int(layers.value)
        #: Bytes of every buffer together.
        self.nbytes = int(nbytes.value)
        #: The components, in Pool.components order.
        self.components: List[Component] = []
        for c in range(components.value):
            rows, row_bytes, row_tokens = C.c_uint64(0), C.c_uint64(0), C.c_uint64(0)
            name = _lib.call_out(lib.kvhost_shm_device_pool_component, ptr, c, guess=64,
                                 trailing=(C.byref(rows), C.byref(row_bytes),
                                           C.byref(row_tokens)))
            self.components.append(Component(name, int(rows.value), int(row_bytes.value),
                                             int(row_tokens.value)))

    def component(self, component: Union[int, str]) -> Component:
        """A component by index or name; KeyError / IndexError naming it."""
        return self.components[self._index(component)]

    def _index(self, component: Union[int, str]) -> int:
        if isinstance(component, str):
            for i, c in enumerate(self.components):
                if c.name == component:
                    return i
            names = ", ".join(c.name for c in self.components)
            raise KeyError(f"no component {component!r} in the device pool of '{self.pool}' "
                           f"(it has {names})")
        if not 0 <= int(component) < len(self.components):
            raise IndexError(f"component {component} out of range [0, {len(self.components)})")
        return int(component)

    def layer_address(self, component: Union[int, str], layer: int) -> int:
        """The base address of a component's buffer for attached layer `layer`."""
        base, nbytes = C.c_void_p(), C.c_uint64(0)
        _lib.call(_lib.lib().kvhost_shm_device_pool_layer, self._p(), self._index(component),
                  int(layer), C.byref(base), C.byref(nbytes))
        return int(base.value or 0)

    def layer_view(self, component: Union[int, str], layer: int) -> memoryview:
        """A writable flat byte memoryview of one layer's buffer (rows *
        row_bytes; row r at r * row_bytes)."""
        c = self.component(component)
        return _arrays.raw_view(self.layer_address(component, layer), c.rows * c.row_bytes, self)

    def layer_array(self, component: Union[int, str], layer: int, dtype: Any = None) -> Any:
        """One layer's buffer as a numpy array (rows, row_bytes / itemsize).

        dtype defaults to uint8; e.g. numpy.uint16 for BF16 rows. Needs numpy.
        """
        c = self.component(component)
        return _arrays.numpy_view(self.layer_address(component, layer), c.rows, c.row_bytes,
                                  self, dtype)

    def views(self, component: Union[int, str], dtype: Any = None,
              numpy: Optional[bool] = None) -> List[Any]:
        """Every attached layer of a component: numpy arrays when numpy is
        installed (or numpy=True), else memoryviews."""
        if _arrays.want_numpy(numpy):
            return [self.layer_array(component, layer, dtype) for layer in range(self.layers)]
        return [self.layer_view(component, layer) for layer in range(self.layers)]

    def __repr__(self) -> str:
        names = ",".join(c.name for c in self.components)
        return (f"ShmDevicePool(pool={self.pool!r}, components=[{names}], layers={self.layers}, "
                f"{'closed' if self.closed else 'open'})")


def create(client: Any, pool: str, device_size_tokens: int, shm_dir: Optional[str] = None,
           start_layer: int = 0, end_layer: int = 0) -> ShmDevicePool:
    """kvhost_shm_device_pool_create; see Client.shm_device_pool."""
    if shm_dir is None:
        # The daemon's own, so that a worker needs no second copy of its flags.
        shm_dir = client.daemon_status().get("shm_dir") or None
    ptr = C.c_void_p()
    _lib.call(_lib.lib().kvhost_shm_device_pool_create, client._handle(),
              _lib.text(pool, "pool name"), int(device_size_tokens),
              None if shm_dir is None else _lib.text(str(shm_dir), "shm_dir"),
              int(start_layer), int(end_layer), C.byref(ptr))
    return ShmDevicePool(client, ptr, pool)
