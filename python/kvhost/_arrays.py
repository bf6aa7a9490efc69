"""Indices and bytes between Python objects and the C ABI, numpy optional.

Slot indices go to the ABI as ``int64_t*``. A caller may hold them as a
list, a range, an ``array.array('q')``, a numpy array of any integer dtype or
a CPU torch tensor; :func:`int64_arg` gives the ABI a pointer to int64s
without copying where the object already is contiguous int64 (numpy,
``array('q')``), and copies otherwise. Bytes (pages, device rows) travel as
``void*`` with their length (:func:`readable`, :func:`writable`).

numpy is imported once, on first need; without it everything works through
lists and memoryviews.
"""

from __future__ import annotations

import ctypes as C
import operator
from typing import Any, List, Optional, Sequence, Tuple, Union

_numpy: Any = None
_numpy_checked = False


def numpy() -> Any:
    """The numpy module, or None when it is not installed."""
    global _numpy, _numpy_checked
    if not _numpy_checked:
        try:
            import numpy as np  # noqa: PLC0415 (optional dependency)
            _numpy = np
        except ImportError:
            _numpy = None
        _numpy_checked = True
    return _numpy


def want_numpy(flag: Optional[bool]) -> bool:
    """Whether an answer is a numpy array: `flag`, or numpy's presence when None."""
    if flag is None:
        return numpy() is not None
    if flag and numpy() is None:
        raise ImportError("numpy=True, but numpy is not installed")
    return bool(flag)


#: What int64_arg returns: the pointer, the count, and the object that owns
#: the memory (kept alive until the call returns).
Int64Arg = Tuple[Any, int, Any]

_P_I64 = C.POINTER(C.c_int64)


def _is_torch_tensor(obj: Any) -> bool:
    # By name, so that torch is never imported here.
    return type(obj).__module__.startswith("torch") and hasattr(obj, "numpy")


def int64_arg(indices: Any, what: str = "indices") -> Int64Arg:
    """Slot indices as an int64_t* for the ABI (see the module doc).

    A float or a non-integer element is a TypeError naming `what`: a slot is
    never rounded.
    """
    if indices is None:
        raise TypeError(f"{what} must be a sequence of ints, not None")
    if _is_torch_tensor(indices):
        indices = indices.detach().cpu().numpy()
    np = numpy()
    if np is not None and isinstance(indices, np.ndarray):
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, not {indices.dtype}")
        arr = np.ascontiguousarray(indices.reshape(-1), dtype=np.int64)
        return arr.ctypes.data_as(_P_I64), int(arr.size), arr
    if isinstance(indices, (bytes, bytearray, str)):
        raise TypeError(f"{what} must be a sequence of ints, not {type(indices).__name__}")
    if not isinstance(indices, (list, tuple, range)):
        try:
            view: Optional[memoryview] = memoryview(indices)
        except TypeError:
            view = None
        if view is not None and view.format in ("q", "<q", "=q", "l") and \
                view.itemsize == 8 and view.c_contiguous and not view.readonly:
            flat = view.cast("B").cast("q")
            arr = (C.c_int64 * len(flat)).from_buffer(flat)
            return C.cast(arr, _P_I64), len(arr), (arr, flat)
    try:
        values = [operator.index(v) for v in indices]
    except TypeError as e:
        raise TypeError(f"{what} must be a sequence of ints: {e}") from None
    arr = (C.c_int64 * len(values))(*values)
    return C.cast(arr, _P_I64), len(values), arr


def int64_result(arr: "C.Array[C.c_int64]", count: int, as_numpy: bool,
                 start: int = 0) -> Union[List[int], Any]:
    """`count` int64s of a ctypes array from `start`, as a list or a numpy copy."""
    if as_numpy:
        np = numpy()
        return np.ctypeslib.as_array(arr)[start:start + count].copy()
    return list(arr[start:start + count])


def readable(data: Any, what: str = "data") -> Tuple[Any, int, Any]:
    """Any buffer-protocol object as (void* pointer, bytes, keep-alive).

    bytes pass without a copy; a writable contiguous buffer (bytearray,
    numpy array, memoryview of one) too; a read-only non-bytes buffer is
    copied once.
    """
    if isinstance(data, bytes):
        return data, len(data), data
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"{what} must support the buffer protocol "
                        f"(bytes, bytearray, memoryview, numpy array), not "
                        f"{type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    flat = view.cast("B") if view.format not in ("B", "b", "c") or view.ndim != 1 else view
    if flat.readonly:
        copy = bytes(flat)
        return copy, len(copy), copy
    arr = (C.c_ubyte * flat.nbytes).from_buffer(flat)
    return C.cast(arr, C.c_void_p), flat.nbytes, (arr, flat)


def to_bytes(data: Any, what: str = "data") -> bytes:
    """A C-contiguous buffer's bytes as bytes (a copy unless already bytes)."""
    if isinstance(data, bytes):
        return data
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"{what} must support the buffer protocol "
                        f"(bytes, bytearray, memoryview, numpy array), not "
                        f"{type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    return view.tobytes()


def writable(out: Any, what: str = "out") -> Tuple[C.c_void_p, int, Any]:
    """A writable contiguous buffer as (void* pointer, bytes, keep-alive)."""
    try:
        view = memoryview(out)
    except TypeError:
        raise TypeError(f"{what} must be a writable buffer (bytearray, numpy array), "
                        f"not {type(out).__name__}") from None
    if view.readonly or not view.c_contiguous:
        raise ValueError(f"{what} must be writable and C-contiguous")
    flat = view.cast("B") if view.format not in ("B", "b", "c") or view.ndim != 1 else view
    arr = (C.c_ubyte * flat.nbytes).from_buffer(flat)
    return C.cast(arr, C.c_void_p), flat.nbytes, (arr, flat)


def raw_view(address: int, nbytes: int, owner: Any) -> memoryview:
    """A writable flat byte memoryview of `nbytes` at `address`.

    Flat, because a multi-dimensional memoryview cannot be indexed by row;
    row r of a buffer is ``view[r * row_bytes:(r + 1) * row_bytes]``.
    `owner` is kept alive by the view (a device pool's mapping); closing the
    owner explicitly still invalidates the view.
    """
    arr = (C.c_ubyte * nbytes).from_address(address)
    setattr(arr, "_kvhost_owner", owner)  # the mapping must outlive every view of it
    return memoryview(arr).cast("B")


def numpy_view(address: int, rows: int, row_bytes: int, owner: Any,
               dtype: Any = None) -> Any:
    """raw_view as a numpy array of shape (rows, row_bytes / itemsize)."""
    np = numpy()
    if np is None:
        raise ImportError("numpy is not installed; use the memoryview views instead")
    dt = np.dtype(np.uint8 if dtype is None else dtype)
    if row_bytes % dt.itemsize:
        raise ValueError(f"a {row_bytes}-byte row does not hold whole {dt} elements")
    arr = (C.c_ubyte * (rows * row_bytes)).from_address(address)
    setattr(arr, "_kvhost_owner", owner)
    return np.frombuffer(arr, dtype=dt).reshape(rows, row_bytes // dt.itemsize)


def pointer_list(values: Sequence[int]) -> "C.Array[C.c_void_p]":
    """A void*[] of integer addresses."""
    return (C.c_void_p * len(values))(*[operator.index(v) for v in values])


#: A key of the L3 tier or the node cache: bytes, or str sent as UTF-8.
Key = Union[bytes, str]


def keys_arg(keys: Sequence[Key]) -> Tuple[Any, Any, int, List[bytes]]:
    """Keys as the ABI's ``(const void* const* keys, const size_t* key_lens,
    n)``, and the encoded bytes, which the caller keeps alive for the call."""
    encoded = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]
    n = len(encoded)
    ptrs = (C.c_void_p * max(n, 1))(*[C.cast(C.c_char_p(k), C.c_void_p) for k in encoded])
    lens = (C.c_size_t * max(n, 1))(*[len(k) for k in encoded])
    return ptrs, lens, n, encoded
