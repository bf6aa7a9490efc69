"""Finding and loading libkvhost_c.so, and the C ABI's signatures.

This is the only module that knows where the library lives and how each
``kvhost_*`` call is declared (client/include/kvhost/kvhost_c.h); every other
module calls through :func:`lib` and :func:`call`. The library is loaded on
first use, not at import, so ``import kvhost`` works on a machine without it
and the first call says clearly where it looked.

Search order (the first that loads wins):

1. ``$KVHOST_LIBRARY``: a file, or a directory holding ``libkvhost_c.so.1``.
   When it is set nothing else is tried: an explicit choice that fails must
   not quietly load some other build instead.
2. The package's own directory: ``pip install ./python`` copies the
   library of the checkout's build (step 3, at install time) into it.
3. A build tree: ``$KVHOST_BUILD_DIR/lib``, and ``build/lib`` of the source
   checkout when the package is imported from ``<checkout>/python``.
4. Where ``cmake --install`` puts it: ``<sys.prefix>/lib`` (installed with
   ``--prefix=$VIRTUAL_ENV``) and ``/usr/local/lib`` (CMake's default
   prefix, which the loader searches only after ldconfig has run).
5. The loader: ``ctypes.util.find_library("kvhost_c")`` and the soname
   ``libkvhost_c.so.1`` (``LD_LIBRARY_PATH``, ldconfig's cache).

Thread safety: loading is guarded by a lock; the loaded library is shared.
"""

from __future__ import annotations

import ctypes as C
import ctypes.util
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .errors import InvalidArgument, LibraryError, StatusCode, raise_for

#: The ABI this package speaks (KVHOST_ABI_VERSION of kvhost_c.h).
ABI_VERSION = 1
#: The library's file name; the number is the ABI version.
SONAME = f"libkvhost_c.so.{ABI_VERSION}"
#: Bytes of a cudaIpcEventHandle_t (KVHOST_CUDA_EVENT_HANDLE_BYTES).
CUDA_EVENT_HANDLE_BYTES = 64
#: kvhost_backup / kvhost_load flag: wait for the ticket before returning.
TRANSFER_WAIT = 1
#: Room for an error message. The ABI truncates longer ones; the daemon's
#: messages name a value or two and stay far below this.
ERR_BYTES = 4096


class LoadTicketStruct(C.Structure):
    """kvhost_load_ticket: 24 bytes, pinned by tests/c_api_header_test."""

    _fields_ = [
        ("ticket_id", C.c_uint64),
        ("event_set", C.c_int32),
        ("reserved", C.c_uint32),
        ("layer_base", C.c_uint64),
    ]


class PoolTransferStruct(C.Structure):
    """kvhost_pool_transfer: one pool group entry's rows of a transfer."""

    _fields_ = [
        ("entry", C.c_char_p),
        ("host_indices", C.POINTER(C.c_int64)),
        ("num_host", C.c_size_t),
        ("device_indices", C.POINTER(C.c_int64)),
        ("num_device", C.c_size_t),
    ]


class CudaGroupEntryStruct(C.Structure):
    """kvhost_cuda_group_entry: one pool group entry's CUDA buffers (64 bytes
    on a 64-bit platform, pinned by tests/c_api_header_test)."""

    _fields_ = [
        ("entry", C.c_char_p),
        ("num_components", C.c_size_t),
        ("component_names", C.POINTER(C.c_char_p)),
        ("layer_ptrs", C.POINTER(C.c_void_p)),
        ("layer_bytes", C.POINTER(C.c_uint64)),
        ("device_size_tokens", C.c_uint64),
        ("num_layers", C.c_uint32),
        ("start_layer", C.c_uint32),
        ("end_layer", C.c_uint32),
        ("reserved", C.c_uint32),
    ]


#: Bytes of a node cache key at most (KVHOST_CACHE_MAX_KEY_BYTES).
CACHE_MAX_KEY_BYTES = 256


class CacheStatsStruct(C.Structure):
    """kvhost_cache_stats: 14 uint64s, pinned by tests/c_api_header_test."""

    _fields_ = [(name, C.c_uint64) for name in (
        "page_num", "free_pages", "published", "writing", "pinned", "hits", "misses", "stored",
        "skipped", "evicted", "aborted", "l3_written", "l3_fetched", "l3_missed")]


class CacheEventStruct(C.Structure):
    """kvhost_cache_event: 272 bytes, pinned by tests/c_api_header_test."""

    _fields_ = [
        ("seq", C.c_uint64),
        ("kind", C.c_int32),
        ("key_len", C.c_uint32),
        ("key", C.c_uint8 * CACHE_MAX_KEY_BYTES),
    ]


#: kvhost_async_callback: void (*)(uint64_t request_id, int code, void* user).
ASYNC_CALLBACK = C.CFUNCTYPE(None, C.c_uint64, C.c_int, C.c_void_p)

_vp, _cp, _sz, _int = C.c_void_p, C.c_char_p, C.c_size_t, C.c_int
_u32, _u64, _i32, _i64 = C.c_uint32, C.c_uint64, C.c_int32, C.c_int64
_pvp, _psz = C.POINTER(C.c_void_p), C.POINTER(C.c_size_t)
_pu32, _pu64, _pi32 = C.POINTER(C.c_uint32), C.POINTER(C.c_uint64), C.POINTER(C.c_int32)
_pi64 = C.POINTER(C.c_int64)
_ppt = C.POINTER(PoolTransferStruct)
_ERR = [_cp, _sz]  # every status-returning call ends in (char* err, size_t err_len)
_OUT = [_vp, _sz, _psz]  # (char* out, size_t out_len, size_t* needed)

#: name -> (argtypes, restype), in the header's order. Strings and output
#: buffers are void* so both bytes and ctypes buffers pass.
SIGNATURES: Dict[str, Tuple[List[Any], Any]] = {
    "kvhost_abi_version": ([], _int),
    "kvhost_built_with_cuda": ([], _int),
    "kvhost_code_name": ([_int], _cp),
    "kvhost_client_options_create": ([_pvp] + _ERR, _int),
    "kvhost_client_options_set": ([_vp, _cp, _cp] + _ERR, _int),
    "kvhost_client_options_destroy": ([_vp], None),
    "kvhost_client_connect": ([_vp, _pvp] + _ERR, _int),
    "kvhost_connect": ([_cp, _i64, _int, _pvp] + _ERR, _int),
    "kvhost_client_close": ([_vp], None),
    "kvhost_client_wait_ready": ([_vp, _i64] + _ERR, _int),
    "kvhost_client_open_session": ([_vp, _i64] + _ERR, _int),
    "kvhost_client_session_state": ([_vp, _pi32, _pu64] + _OUT + _ERR, _int),
    "kvhost_client_session_losses": ([_vp, _pu64] + _OUT + _ERR, _int),
    "kvhost_daemon_status_json": ([_vp] + _OUT + _ERR, _int),
    "kvhost_pool_create": ([_vp, _cp, _cp] + _ERR, _int),
    "kvhost_pool_get_json": ([_vp, _cp] + _OUT + _ERR, _int),
    "kvhost_pool_list_json": ([_vp] + _OUT + _ERR, _int),
    "kvhost_pool_delete": ([_vp, _cp, _pu64] + _ERR, _int),
    "kvhost_group_create": ([_vp, _cp, _cp] + _ERR, _int),
    "kvhost_group_get_json": ([_vp, _cp] + _OUT + _ERR, _int),
    "kvhost_group_delete": ([_vp, _cp] + _ERR, _int),
    "kvhost_pool_claim": ([_vp, _cp, _cp, _pu64, _pu64, _pi32] + _ERR, _int),
    "kvhost_alloc": ([_vp, _cp, _u64, _pi64, _sz, _psz] + _ERR, _int),
    "kvhost_alloc_batch": ([_vp, _cp, _pu64, _sz, _pi64, _sz, _psz] + _ERR, _int),
    "kvhost_free": ([_vp, _cp, _pi64, _sz, _pu64] + _ERR, _int),
    "kvhost_page_buffer_meta_json": ([_vp, _cp, _pi64, _sz] + _OUT + _ERR, _int),
    "kvhost_page_shape_json": ([_vp, _cp] + _OUT + _ERR, _int),
    "kvhost_stride_alignment_json": ([_vp, _cp, _u64] + _OUT + _ERR, _int),
    "kvhost_contiguous_buffer_infos_json": ([_vp, _cp] + _OUT + _ERR, _int),
    "kvhost_get_data_page": ([_vp, _cp, _i64, _vp, _sz, _psz] + _ERR, _int),
    "kvhost_set_from_flat_data_page": ([_vp, _cp, _i64, _vp, _sz] + _ERR, _int),
    "kvhost_read_pages": ([_vp, _cp, _pi64, _sz, _u32, _vp, _sz, _psz] + _ERR, _int),
    "kvhost_write_pages": ([_vp, _cp, _pi64, _sz, _vp, _sz, _u32, _pu64] + _ERR, _int),
    "kvhost_shm_device_pool_create": ([_vp, _cp, _u64, _cp, _u32, _u32, _pvp] + _ERR, _int),
    "kvhost_shm_device_pool_destroy": ([_vp], None),
    "kvhost_shm_device_pool_info": ([_vp, _pu32, _pu32, _pu64] + _ERR, _int),
    "kvhost_shm_device_pool_component":
        ([_vp, _u32] + _OUT + [_pu64, _pu64, _pu64] + _ERR, _int),
    "kvhost_shm_device_pool_layer": ([_vp, _u32, _u32, _pvp, _pu64] + _ERR, _int),
    "kvhost_attach_shm": ([_vp, _cp, _vp, _cp, _pvp] + _ERR, _int),
    "kvhost_attach_cuda":
        ([_vp, _cp, _sz, C.POINTER(_cp), _u32, _pvp, _pu64, _u64, _cp, _pvp] + _ERR, _int),
    "kvhost_attach_group_shm": ([_vp, _cp, _sz, C.POINTER(_cp), _pvp, _cp, _pvp] + _ERR, _int),
    "kvhost_attach_group_cuda":
        ([_vp, _cp, _sz, C.POINTER(CudaGroupEntryStruct), _cp, _pvp] + _ERR, _int),
    "kvhost_attachment_id": ([_vp] + _OUT + _ERR, _int),
    "kvhost_attachment_json": ([_vp] + _OUT + _ERR, _int),
    "kvhost_detach": ([_vp, _vp] + _ERR, _int),
    "kvhost_attachment_destroy": ([_vp], None),
    "kvhost_backup":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _vp, _sz, _u32, _i64, _pu64] + _ERR, _int),
    "kvhost_alloc_backup":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _psz, _vp, _sz, _u32, _i64, _pu64] + _ERR, _int),
    "kvhost_load": ([_vp, _vp, _pi64, _sz, _pi64, _sz, _u32, _i64, _pu64] + _ERR, _int),
    "kvhost_load_with_events":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, C.POINTER(LoadTicketStruct)] + _ERR, _int),
    "kvhost_backup_group":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _ppt, _sz, _vp, _sz, _u32, _i64, _pu64] + _ERR, _int),
    "kvhost_backup_with_events":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _vp, _sz, C.POINTER(LoadTicketStruct)] + _ERR, _int),
    "kvhost_backup_group_with_events":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _ppt, _sz, _vp, _sz, C.POINTER(LoadTicketStruct)] +
         _ERR, _int),
    "kvhost_load_group":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _ppt, _sz, _u32, _i64, _pu64] + _ERR, _int),
    "kvhost_load_group_with_events":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _ppt, _sz, C.POINTER(LoadTicketStruct)] + _ERR,
         _int),
    "kvhost_load_group_with_events_after":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _ppt, _sz, _vp, _sz, C.POINTER(LoadTicketStruct)] +
         _ERR, _int),
    "kvhost_transfer_wait": ([_vp, _u64, _i64] + _OUT + _ERR, _int),
    "kvhost_transfer_poll": ([_vp, _u64, _pi32] + _OUT + _ERR, _int),
    "kvhost_load_events_open": ([_vp, _vp, _pvp] + _ERR, _int),
    "kvhost_load_events_destroy": ([_vp], None),
    "kvhost_wait_layer":
        ([_vp, C.POINTER(LoadTicketStruct), _u32, _vp, _i64] + _ERR, _int),
    "kvhost_pool_map_open":
        ([_vp, _vp, C.POINTER(C.c_int), C.POINTER(C.c_uint64), _sz, _psz] + _ERR, _int),
    "kvhost_cuda_export_event": ([_vp, _vp, _sz, _psz] + _ERR, _int),
    "kvhost_worker_copier_open": ([_vp, _vp, _i32, _pvp] + _ERR, _int),
    "kvhost_worker_copier_destroy": ([_vp], None),
    "kvhost_worker_copy_backup": ([_vp, _pi64, _sz, _pi64, _sz, _vp, _pvp] + _ERR, _int),
    "kvhost_worker_copy_load": ([_vp, _pi64, _sz, _pi64, _sz, _vp, _pvp] + _ERR, _int),
    "kvhost_worker_ticket_info": ([_vp, _pu64, _pu32] + _ERR, _int),
    "kvhost_worker_copy_wait_layer": ([_vp, _vp, _u32, _vp] + _ERR, _int),
    "kvhost_worker_copy_wait": ([_vp, _vp, _i64] + _ERR, _int),
    "kvhost_worker_ticket_destroy": ([_vp], None),
    "kvhost_async_create": ([_vp, _pvp] + _ERR, _int),
    "kvhost_async_destroy": ([_vp], None),
    "kvhost_async_set_callback": ([_vp, ASYNC_CALLBACK, _vp] + _ERR, _int),
    "kvhost_async_alloc": ([_vp, _cp, _u64, _pu64] + _ERR, _int),
    "kvhost_async_free": ([_vp, _cp, _pi64, _sz, _pu64] + _ERR, _int),
    "kvhost_async_backup":
        ([_vp, _vp, _pi64, _sz, _pi64, _sz, _vp, _sz, _u32, _i64, _pu64] + _ERR, _int),
    "kvhost_async_load": ([_vp, _vp, _pi64, _sz, _pi64, _sz, _u32, _i64, _pu64] + _ERR, _int),
    "kvhost_async_completed": ([_vp], _u64),
    "kvhost_async_wait": ([_vp, _u64, _i64] + _ERR, _int),
    "kvhost_async_take_indices": ([_vp, _u64, _pi64, _sz, _psz] + _ERR, _int),
    "kvhost_async_take_value": ([_vp, _u64, _pu64] + _ERR, _int),
    "kvhost_l3_store": ([_vp, _cp, _pi64, _pvp, _psz, _sz, _pi32, _pu64] + _ERR, _int),
    "kvhost_l3_fetch": ([_vp, _cp, _pvp, _psz, _pi64, _sz, _pi32, _pu64] + _ERR, _int),
    "kvhost_l3_exist": ([_vp, _cp, _pvp, _psz, _sz, _pu64] + _ERR, _int),
    "kvhost_l3_start_store": ([_vp, _cp, _pi64, _pvp, _psz, _sz, _pu64] + _ERR, _int),
    "kvhost_l3_start_fetch": ([_vp, _cp, _pvp, _psz, _pi64, _sz, _pu64] + _ERR, _int),
    "kvhost_l3_wait":
        ([_vp, _cp, _u64, _int, _pi32, _pi32, _sz, _psz, _pu64] + _ERR, _int),
    "kvhost_cache_lookup": ([_vp, _cp, _pvp, _psz, _sz, _int, _pu32, _pi32, _pu64] + _ERR, _int),
    "kvhost_cache_store":
        ([_vp, _cp, _vp, _pvp, _psz, _sz, _pi64, _sz, _vp, _sz, _pi32,
          C.POINTER(LoadTicketStruct), _pu64] + _ERR, _int),
    "kvhost_cache_restore":
        ([_vp, _cp, _vp, _pvp, _psz, _sz, _pi64, _sz, _vp, _sz, C.POINTER(LoadTicketStruct)] +
         _ERR, _int),
    "kvhost_cache_store_from_pool":
        ([_vp, _cp, _cp, _pvp, _psz, _sz, _pi64, _sz, _pi32, C.POINTER(LoadTicketStruct), _pu64] +
         _ERR, _int),
    "kvhost_cache_restore_to_pool":
        ([_vp, _cp, _cp, _pvp, _psz, _sz, _pi64, _sz, C.POINTER(LoadTicketStruct)] + _ERR, _int),
    "kvhost_cache_release_pin": ([_vp, _cp, _u64] + _ERR, _int),
    "kvhost_cache_evict": ([_vp, _cp, _pvp, _psz, _sz, _pi32, _pu64] + _ERR, _int),
    "kvhost_cache_get_stats": ([_vp, _cp, C.POINTER(CacheStatsStruct)] + _ERR, _int),
    "kvhost_cache_read_events":
        ([_vp, _cp, _u64, _u32, C.POINTER(CacheEventStruct), _sz, _psz, _pu64, _pi32] + _ERR,
         _int),
}

_lock = threading.Lock()
_loaded: Optional[C.CDLL] = None
_loaded_path: Optional[str] = None


def _checkout_build_lib() -> Optional[Path]:
    """build/lib of the source checkout this package sits in, if it does."""
    checkout = Path(__file__).resolve().parent.parent.parent
    if (checkout / "client" / "include" / "kvhost" / "kvhost_c.h").is_file():
        return checkout / "build" / "lib"
    return None


def _in_dir(directory: Path) -> List[str]:
    return [str(directory / SONAME), str(directory / "libkvhost_c.so")]


def build_tree_candidates() -> List[str]:
    """The library of a build (steps 1 and 3 of the module doc): what
    ``pip install ./python`` bundles into the package (python/build_backend)."""
    explicit = os.environ.get("KVHOST_LIBRARY")
    if explicit:
        return _in_dir(Path(explicit)) if os.path.isdir(explicit) else [explicit]
    places: List[str] = []
    build_dir = os.environ.get("KVHOST_BUILD_DIR")
    if build_dir:
        places += _in_dir(Path(build_dir) / "lib")
    checkout_lib = _checkout_build_lib()
    if checkout_lib is not None:
        places += _in_dir(checkout_lib)
    return places


def install_prefix_dirs() -> List[Path]:
    """Where ``cmake --install`` puts the library when no loader path names
    it (step 4): the running Python's prefix (``--prefix=$VIRTUAL_ENV``),
    then CMake's default prefix /usr/local, before ldconfig has run."""
    dirs = [Path(sys.prefix) / "lib", Path("/usr/local/lib")]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i]]


def candidates() -> List[str]:
    """Every place the library is looked for, in order (see the module doc)."""
    if os.environ.get("KVHOST_LIBRARY"):
        return build_tree_candidates()
    places = _in_dir(Path(__file__).resolve().parent) + build_tree_candidates()
    for directory in install_prefix_dirs():
        places += _in_dir(directory)
    found = ctypes.util.find_library("kvhost_c")
    if found:
        places.append(found)
    places.append(SONAME)  # a bare name: the dynamic loader's own search
    return places


def _bind(cdll: C.CDLL) -> None:
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.argtypes, fn.restype = argtypes, restype


def lib() -> C.CDLL:
    """The loaded library with every call declared; loads it on first use.

    Raises LibraryError naming every place tried (and why each failed), or
    the ABI version found when it is not the one this package speaks.
    """
    global _loaded, _loaded_path
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        tried: List[str] = []
        for place in candidates():
            is_path = os.sep in place
            if is_path and not os.path.exists(place):
                tried.append(f"{place} (no such file)")
                continue
            try:
                cdll = C.CDLL(place)
            except OSError as e:
                tried.append(f"{place} ({e})")
                continue
            try:
                _bind(cdll)
            except AttributeError as e:
                tried.append(f"{place} (not libkvhost_c: {e})")
                continue
            version = cdll.kvhost_abi_version()
            if version != ABI_VERSION:
                raise LibraryError(
                    f"{place} speaks kvhost C ABI {version}; this package speaks "
                    f"{ABI_VERSION}", [place])
            _loaded, _loaded_path = cdll, place
            return cdll
        how = ("$KVHOST_LIBRARY is set, so only it was tried"
               if os.environ.get("KVHOST_LIBRARY") else
               "set $KVHOST_LIBRARY to the file (CMake target kvhost_c), or "
               "$KVHOST_BUILD_DIR to the build tree")
        raise LibraryError(
            "libkvhost_c.so not found; tried:\n  " + "\n  ".join(tried) + f"\n{how}", tried)


def library_path() -> str:
    """The file the library was loaded from (loads it if needed)."""
    lib()
    assert _loaded_path is not None
    return _loaded_path


def code_name(code: int) -> str:
    """"OK", "NOT_FOUND", ... for a status code, as the library names it."""
    name: bytes = lib().kvhost_code_name(int(code))
    return name.decode()


def call(fn: Callable[..., int], *args: Any) -> None:
    """fn(*args, err, err_len); raises the KvhostError subclass of its code."""
    err = C.create_string_buffer(ERR_BYTES)
    rc = fn(*args, err, ERR_BYTES)
    if rc != 0:
        raise_for(rc, err.value.decode("utf-8", errors="replace"))


def call_status(fn: Callable[..., int], *args: Any) -> Tuple[int, str]:
    """fn(*args, err, err_len) without raising: (code, message)."""
    err = C.create_string_buffer(ERR_BYTES)
    rc = fn(*args, err, ERR_BYTES)
    return rc, err.value.decode("utf-8", errors="replace")


#: First guess for a string answer. Most (a pool, a status) are a few KiB;
#: a bigger one costs one retry of the same read.
_FIRST_GUESS = 16 << 10
_OUT_OF_RANGE = 11


def call_out(fn: Callable[..., int], *args: Any, guess: int = _FIRST_GUESS,
             trailing: Sequence[Any] = ()) -> str:
    """A call whose answer goes into an (out, out_len, needed) buffer.

    Tries a buffer of `guess` bytes and, when the ABI answers OUT_OF_RANGE
    with a bigger size needed, once more with that size (the ABI's retry
    rule: such calls are reads). `trailing` are the arguments between the
    buffer and (err, err_len). Returns the answer as text, without its NUL.
    """
    size = max(int(guess), 1)
    for _ in range(3):  # the answer can grow between the tries; a bounded retry
        buf = C.create_string_buffer(size)
        needed = C.c_size_t(0)
        rc, msg = call_status(fn, *args, buf, size, C.byref(needed), *trailing)
        if rc == 0:
            return buf.value.decode("utf-8", errors="replace")
        if rc == _OUT_OF_RANGE and needed.value > size:
            size = needed.value
            continue
        raise_for(rc, msg)
    raise_for(_OUT_OF_RANGE, f"answer kept growing past {size} bytes")
    raise AssertionError("unreachable")


def text(value: Any, what: str) -> bytes:
    """`value` (a str) as the C ABI's NUL-terminated text; the one place the
    package encodes a string for the ABI.

    The ABI reads a ``const char*`` up to its first NUL, so a NUL inside
    would cut the text and the call would act on another name
    ("p\\x00q" on pool "p"): such a value is InvalidArgument naming it, and
    nothing is sent. TypeError for anything but a str; `what` names the
    argument ("pool name", "group name", ...).
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if "\0" in value:
        raise InvalidArgument(StatusCode.INVALID_ARGUMENT,
                              f"{what} {value!r} contains a NUL character (at index "
                              f"{value.index(chr(0))}), which the C ABI would cut: refused, "
                              f"nothing was sent")
    return value.encode()


def ms(seconds: Optional[float]) -> int:
    """A timeout in seconds as the ABI's milliseconds: None is 0 (the call's
    default); a positive time never rounds down to 0. A negative one passes
    through for the ABI to refuse by name."""
    if seconds is None:
        return 0
    value = float(seconds) * 1000.0
    return math.ceil(value) if value > 0 else int(value)
