"""The lifetime of the ABI's handles, as Python objects.

The ABI has one rule that Python's garbage collector does not keep by
itself: the client must outlive every handle made through it (device
pools, attachments, load events, worker copiers and tickets). So each
:class:`Handle` holds its client, and the client keeps a weak registry of
its handles; :meth:`Client.close` releases the ones still open, newest
first, before the client itself. A handle is released once, by
``close()`` or by the garbage collector, whichever comes first.

Not synchronised: as in the ABI, a handle must not be closed while another
thread uses it.
"""

from __future__ import annotations

import ctypes as C
import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

from . import _lib


class Handle:
    """One ABI handle: its pointer, its client, and the call that frees it."""

    #: The kvhost_*_destroy call that releases this kind of handle.
    _DESTROY = ""

    def __init__(self, client: Optional["Registry"], ptr: C.c_void_p) -> None:
        self._ptr: Optional[C.c_void_p] = ptr
        self._client = client
        if client is not None:
            client._adopt(self)

    @property
    def closed(self) -> bool:
        """True once the handle has been released."""
        return self._ptr is None

    def _p(self) -> C.c_void_p:
        """The pointer for a call; ValueError once closed."""
        if self._ptr is None:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._ptr

    def _release(self) -> None:
        """Frees the handle (idempotent). Subclasses release what they own first."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None and ptr.value:
            getattr(_lib.lib(), self._DESTROY)(ptr)

    def close(self) -> None:
        """Releases the handle; later calls on it raise ValueError."""
        self._release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


class Registry:
    """The handles a client made, released newest first when it closes."""

    if TYPE_CHECKING:  # provided by Client
        @property
        def closed(self) -> bool: ...

        def _handle(self) -> C.c_void_p: ...

    def __init__(self) -> None:
        self._handles: "weakref.WeakValueDictionary[int, Handle]" = \
            weakref.WeakValueDictionary()
        self._serial = itertools.count()
        self._registry_lock = threading.Lock()

    def _adopt(self, handle: Handle) -> None:
        with self._registry_lock:
            self._handles[next(self._serial)] = handle

    def _release_handles(self) -> None:
        with self._registry_lock:
            handles = [self._handles.get(k) for k in sorted(self._handles.keys(), reverse=True)]
        for handle in handles:
            if handle is not None:
                handle._release()
