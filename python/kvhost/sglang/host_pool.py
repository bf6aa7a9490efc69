"""HostKVCache: sglang HiCache's host pool calls over one kvhostd pool (the
base of every kvhost.sglang pool kind; kvhost/sglang/__init__.py says what
differs from sglang). Claims the pool for one scheduler (SessionLost once
its session is gone), maps its regions for zero-copy page pointers, and
moves rows through one attachment with SchedulerTransfers.
"""

from __future__ import annotations

import ctypes as C
import logging
import mmap
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple, cast

from .. import _arrays
from ..client import DEFAULT_ADDRESS, Client
from ..errors import AlreadyExists, FailedPrecondition, ResourceExhausted, Unavailable
from ..pools import adopt_pool
from ..shm import ShmDevicePool
from ..transfer import Attachment
from .spec import GIB, IO_BACKENDS, ITEMSIZE, TORCH_DTYPE, dtype_enum, layout_enum
from .transfers import SchedulerTransfers

_log = logging.getLogger("kvhost.sglang")

#: How long construction retries a claim that kvhostd answers Unavailable
#: (the dead predecessor's transfers still running; they end within
#: kvhostd's --session-timeout, 5 s by default).
CLAIM_WAIT_S = 30.0

class SessionLost(FailedPrecondition):
    """The worker session that claimed a HostKVCache's pool is gone (kvhostd
    restarted, or the connection broke and the daemon ended the session):
    its slots may be freed or reused by now, so every slot call of the
    cache raises this instead of answering from an empty pool."""


def instance_id_for(pool: str) -> str:
    """The sglang instance id a HostKVCache of `pool` claims it with:
    KVHOST_INSTANCE_ID when set (one per scheduler, e.g. "<host>:<port>:tp<rank>"),
    else "sglang:<pool>" — stable across restarts, and one per pool since
    each TP rank has its own pool."""
    return os.environ.get("KVHOST_INSTANCE_ID") or f"sglang:{pool}"


def _sglang_base() -> type:
    """sglang's HostKVCache when sglang is importable (so its defaults, such
    as prepare_transfer_indices and the *_physical hooks, are inherited);
    object otherwise. KVHOST_SGLANG_BASE=0 keeps sglang out."""
    if os.environ.get("KVHOST_SGLANG_BASE", "1") == "0":
        return object
    try:
        from sglang.srt.mem_cache.pool_host.base import HostKVCache as base  # noqa: PLC0415
    except ImportError:
        return object
    return cast(type, base)


def _torch(wanted: Optional[bool]) -> Any:
    """torch if it is to be used (tensors=None: when installed), else None."""
    if wanted is False:
        return None
    try:
        import torch  # noqa: PLC0415 (optional)
    except ImportError:
        if wanted:
            raise
        return None
    return torch


# mypy checks against object: sglang's class is untyped, and optional.
if TYPE_CHECKING:
    _Base = object
else:
    _Base = _sglang_base()


class HostKVCache(_Base):
    """A kvhostd pool with sglang HostKVCache's calls (use a subclass).

    With sglang importable this subclasses sglang's HostKVCache without
    calling its constructor (which allocates the buffer in-process): the
    members sglang's callers read are set here (docs/SGLANG.md lists them;
    tests/python_sglang_contract_test.py checks them against the pinned
    release). kvhost.sglang.plugin's classes take sglang's constructor.

    Args:
      name: the pool's name (one per scheduler, or per model and rank).
      client: a kvhost.Client to use (it must outlive this object), or None
        to connect to `address` (closed by close()).
      layout, dtype, page_size, layer_num: as sglang's.
      host_size_gib: GiB (2**30 bytes) of host memory; host_size_tokens: slots; or
        host_to_device_ratio with device_size (the device pool's tokens).
      tensors: torch results (None: when torch is installed).
      instance_id: the sglang instance claiming the pool (instance_id_for:
        KVHOST_INSTANCE_ID, else "sglang:<name>"). The claim needs a client
        with a worker session (the one made here has one); with a client
        made with session=False nothing is claimed, as before claims.
      claim_wait: seconds to retry a claim answered Unavailable (CLAIM_WAIT_S).
    Raises ValueError for a layout or dtype kvhostd lacks (naming it), and
    the daemon's errors as kvhost exceptions (InvalidArgument naming a bad
    field, ResourceExhausted when host memory is short, FailedPrecondition
    naming the holder when another live scheduler holds the pool).
    """

    _KIND = ""
    #: sglang's HostKVCache members with fixed values on a kvhost pool.
    dcp_size = 1
    dcp_rank = 0
    shared_allocation_domain = None
    stores_page_envelope = False
    storage_format_tag = None
    #: sglang's staged JIT write-back kernel writes host memory in-process:
    #: kvhostd does the copy instead.
    can_use_write_back_jit = False
    #: Where sglang's allocator state lives (sglang's HostKVCache.device).
    device = "cpu"
    pin_memory = False

    def __init__(self, name: str, *, client: Optional[Client] = None,
                 address: str = DEFAULT_ADDRESS, layout: str = "layer_first",
                 dtype: Any = "bfloat16", page_size: int = 1, layer_num: int,
                 host_size_gib: float = 0.0, host_size_tokens: int = 0,
                 host_to_device_ratio: float = 0.0, device_size: int = 0,
                 start_layer: int = 0, tensors: Optional[bool] = None,
                 shape: Dict[str, Any], end_layer: Optional[int] = None,
                 target_layer_num: Optional[int] = None, pool_label: str = "kv",
                 instance_id: Optional[str] = None, claim_wait: float = CLAIM_WAIT_S) -> None:
        self.layout = layout
        self.pool_label = pool_label
        spec: Dict[str, Any] = {
            "kind": self._KIND, "layout": layout_enum(layout), "dtype": dtype_enum(dtype),
            "page_size": int(page_size), "layer_num": int(layer_num),
            "size_tokens": int(host_size_tokens), "size_bytes": round(float(host_size_gib) * GIB),
            "host_to_device_ratio": float(host_to_device_ratio),
            "device_size_tokens": int(device_size), "start_layer": int(start_layer), **shape}
        self._torch = _torch(tensors)
        self._own_client = client is None
        # A session of its own: the claim below, and what the pool maps,
        # live as long as it does.
        self.client = Client(address) if client is None else client
        self.name = name
        self.instance_id = instance_id or instance_id_for(name)
        #: The claim's generation, and the session id it was made in ("":
        #: nothing claimed: a sessionless client, or a follower pool).
        self.generation = 0
        self._claim_session = ""
        try:
            try:
                info = self.client.create_pool(name, spec)
            except AlreadyExists:
                info = adopt_pool(self.client, name)
                self._check_same_shape(info["spec"], spec)
            if getattr(self.client, "session", False) and not info.get("follows"):
                self._claim(float(claim_wait))
                info = self.client.get_pool(name)
        except BaseException:
            if self._own_client:
                self.client.close()
            raise
        self.info = info
        #: kvhost's DType name; `dtype` is the torch.dtype when torch is used.
        self.kv_dtype = spec["dtype"]
        self.dtype = (getattr(self._torch, TORCH_DTYPE[self.kv_dtype])
                      if self._torch is not None else self.kv_dtype)
        self.page_size = int(page_size)
        self.layer_num = int(layer_num)
        #: Host layers of the model's (the rest are packed MTP draft layers).
        self.target_layer_num = self.layer_num if target_layer_num is None \
            else int(target_layer_num)
        self.start_layer = int(start_layer)
        self.end_layer = self.start_layer + self.target_layer_num if end_layer is None \
            else int(end_layer)
        self.size = int(info["size_tokens"])
        self.page_num = int(info["page_num"])
        self.size_per_token = int(info["bytes_per_token"])
        self.bytes_per_page = int(info["bytes_per_page"])
        # Pages (index // page_size) this object allocated: what clear() frees.
        self._pages: Set[int] = set()
        # Reentrant: mapping the regions (under it) may attach (under it).
        self._lock = threading.RLock()
        self._attachments: Dict[int, Attachment] = {}
        # Backups and per-layer loads, and what they keep between calls.
        self._transfers = SchedulerTransfers()
        self._maps: List[Tuple[mmap.mmap, int]] = []
        # sglang's @synchronized methods (inherited ones) take self.lock.
        self.lock = threading.RLock()

    def _claim(self, wait: float) -> None:
        """Claims the pool for self.instance_id (PoolService.ClaimPool),
        retrying Unavailable for `wait` seconds."""
        deadline = time.monotonic() + wait
        while True:
            try:
                claim = self.client.claim_pool(self.name, self.instance_id)
                break
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        self.generation = int(claim["generation"])
        self._claim_session = self.client.session_state().session_id
        if not claim["renewed"]:
            _log.info("kvhost pool '%s' claimed by instance '%s' (generation %d): %d slots of "
                      "the previous scheduler reclaimed", self.name, self.instance_id,
                      self.generation, claim["reclaimed_tokens"])

    def _check_session(self) -> None:
        """Raises SessionLost once the session that claimed the pool is gone."""
        if not self._claim_session:
            return
        state = self.client.session_state()
        if state.open and state.session_id == self._claim_session:
            return
        raise SessionLost(int(SessionLost.CODE), (
            f"kvhost pool '{self.name}': the daemon's session was lost (kvhostd restarted, or "
            f"the connection broke and kvhostd ended the session): the claim of instance "
            f"'{self.instance_id}' (generation {self.generation}) and the slots it held are gone; "
            f"restart the scheduler"))

    #: Spec fields that are sizes, not shape: a pool that exists keeps its own.
    _SIZES = ("size_tokens", "size_bytes", "host_to_device_ratio", "device_size_tokens")

    @classmethod
    def _check_same_shape(cls, have: Dict[str, Any], want: Dict[str, Any]) -> None:
        # Sizes are the first creator's; the shape must be the same to share.
        for key, value in want.items():
            if key not in cls._SIZES and have.get(key) != value:
                raise ValueError(f"pool exists with {key} {have.get(key)!r}, not {value!r}")

    # --- sizes and slots ----------------------------------------------------

    def get_size_per_token(self) -> int:
        """Host bytes per token slot over all layers (and K and V)."""
        return self.size_per_token

    def get_ksize_per_token(self) -> int:
        """sglang's K share of get_size_per_token (all of it but for MHA)."""
        return self.size_per_token

    @property
    def logical_size(self) -> int:
        """Slots sglang's radix tree and controller see (no DCP: size)."""
        return self.size * self.dcp_size

    @property
    def logical_page_size(self) -> int:
        return self.page_size * self.dcp_size

    def available_size(self) -> int:
        """Slots of the pool not allocated now (every scheduler's).
        SessionLost once the claiming session is gone."""
        self._check_session()
        size = self.client.available_size(self.name)
        self._check_session()  # a restart during the call: its answer is another daemon's
        return size

    def _indices(self, values: Any) -> Any:
        if self._torch is not None:
            return self._torch.tensor(list(values), dtype=self._torch.int64)
        return values

    def alloc(self, need_size: int) -> Any:
        """`need_size` slots (whole pages), or None when fewer are free.
        SessionLost once the claiming session is gone (never an empty or a
        fresh pool's slots)."""
        self._check_session()
        if int(need_size) == 0:
            return self._indices([])
        try:
            slots = self.client.alloc(self.name, int(need_size))
        except ResourceExhausted:
            self._check_session()
            return None
        self._check_session()
        with self._lock:
            self._pages.update(int(s) // self.page_size for s in slots[::self.page_size])
        if self._torch is not None:
            return self._indices(slots)
        return slots

    def free(self, indices: Any) -> int:
        """Frees whole pages of slots; returns len(indices) as sglang does.
        SessionLost once the claiming session is gone."""
        self._check_session()
        values = [int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]
        if values:
            self.client.free(self.name, values)
        with self._lock:
            self._pages.difference_update(i // self.page_size for i in values)
        return len(values)

    def clear(self) -> None:
        """Frees every slot this object allocated (other clients' stay).
        SessionLost once the claiming session is gone."""
        self._check_session()
        with self._lock:
            pages, self._pages = sorted(self._pages), set()
        ps = self.page_size
        slots = [p * ps + o for p in pages for o in range(ps)]
        if slots:
            self.client.free(self.name, slots)

    # --- pages --------------------------------------------------------------

    def page_shape(self) -> Tuple[int, ...]:
        """sglang's get_data_page(flat=False) shape for this layout."""
        raise NotImplementedError

    #: The flat page's element type as a tensor: the pool's dtype, or bytes
    #: for kinds whose page mixes types (sglang's Mamba page is uint8).
    _FLAT_BYTES = False

    def _flat_dtype(self) -> str:
        return "UINT8" if self._FLAT_BYTES else self.kv_dtype

    def _as_page(self, data: bytes, flat: bool) -> Any:
        torch = self._torch
        if torch is not None:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            t = t.view(getattr(torch, TORCH_DTYPE[self._flat_dtype()]))
            return t if flat else t.reshape(self.page_shape())
        np = _arrays.numpy()
        if not flat:
            if np is None:
                raise ValueError("get_data_page(flat=False) needs torch or numpy")
            return np.frombuffer(data, dtype=np.uint8).reshape(
                self.page_shape()[:-1] + (-1,))
        return data

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        """The page whose first slot is `index`: a flat tensor of the pool's
        dtype (torch), else bytes; flat=False gives sglang's shape (numpy:
        uint8 with the last dimension in bytes)."""
        if not flat:
            self.page_shape()  # a kind without one says so before any call
            view = self._page_view(int(index)) if self._torch is not None else None
            if view is not None:
                return view
        return self._as_page(cast(bytes, self.client.get_data_page(self.name, int(index))), flat)

    def _page_view(self, index: int) -> Any:
        """sglang's flat=False page as a view of the pool's mapped memory (a
        storage backend's writes land in the host page), or None where the
        page's blocks are not evenly spaced in one region (then a copy).

        The strides come from the daemon's own page metadata (the layout
        math stays in kvhostd): the page's blocks are the leading dimensions
        of page_shape(), each block contiguous; every block's offset is
        checked against the derived strides."""
        torch = self._torch
        ps = self.page_size
        meta = self.client.get_page_buffer_meta(self.name, list(range(index, index + ps)))
        segs = meta.get("segments", [])
        shape = self.page_shape()
        itemsize = ITEMSIZE[self.kv_dtype]
        lead, n = 0, 1
        while n < len(segs) and lead < len(shape):
            n *= shape[lead]
            lead += 1
        rest = shape[lead:]
        block = itemsize
        for d in rest:
            block *= d
        if not segs or n != len(segs) or len({int(g["region_index"]) for g in segs}) != 1 \
                or any(int(g["length"]) != block for g in segs):
            return None
        offs = [int(g["offset"]) for g in segs]
        for candidate in (range(lead), reversed(range(lead))):  # which dim varies fastest
            order = list(candidate)
            strides, step = [0] * lead, 1
            for d in reversed(order):
                strides[d] = step
                step *= shape[d]
            # byte stride of each leading dim: offset of its first step
            byte = [offs[strides[d]] - offs[0] if shape[d] > 1 else 0 for d in range(lead)]
            if all(b % itemsize == 0 for b in byte) and all(
                    offs[i] == offs[0] + sum(byte[d] * ((i // strides[d]) % shape[d])
                                             for d in range(lead)) for i in range(len(offs))):
                break
        else:
            return None
        region = int(segs[0]["region_index"])
        with self._lock:
            base = self._region_base(region, meta.get("region_paths"))
            size = len(self._maps[region][0])
        mem = torch.frombuffer(_arrays.raw_view(base, size, self), dtype=torch.uint8)
        mem = mem[:size - size % itemsize].view(self.dtype)
        inner: List[int] = []
        step = 1
        for d in reversed(rest):
            inner.insert(0, step)
            step *= d
        return mem.as_strided(shape, [b // itemsize for b in byte] + inner, offs[0] // itemsize)

    def get_dummy_flat_data_page(self) -> Any:
        """A zero page of the flat page's size (torch: of the pool's dtype)."""
        torch = self._torch
        if torch is not None:
            dtype = self._flat_dtype()
            return torch.zeros(self.bytes_per_page // ITEMSIZE[dtype],
                               dtype=getattr(torch, TORCH_DTYPE[dtype]))
        return bytearray(self.bytes_per_page)

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        """Writes one flat page (a tensor of any dtype, or a buffer)."""
        if hasattr(data_page, "data_ptr"):  # a torch tensor: its bytes, on the CPU
            t = data_page.detach().cpu().contiguous()
            data_page = C.string_at(t.data_ptr(), t.numel() * t.element_size())
        self.client.set_from_flat_data_page(self.name, int(index), data_page)

    def _region_base(self, region: int, paths: Optional[List[str]] = None) -> int:
        """The address of region `region` of the pool in this process, every
        region mapped once, shared with the daemon: the pointers stay valid
        until close(), like sglang's pinned buffer's.

        The regions come as descriptors over kvhostd's handoff socket
        (HANDOFF_KIND_POOL_MAP), checked against this client's session and
        token, through an attachment of this pool made within a session
        (:meth:`_map_attachment`; sglang's path, kvhost.sglang.plugin, always
        has one). Only a pool with no such attachment (kvhost's own
        constructors, used without a device pool) maps its region files by
        path (GetPool's region_paths, shown to the owner token's holder)."""
        if not self._maps:
            att = self._map_attachment()
            if att is not None:
                for fd, size in att.pool_map():
                    try:
                        mm = mmap.mmap(fd, size)
                    finally:
                        os.close(fd)
                    self._maps.append((mm, C.addressof(C.c_char.from_buffer(mm))))
                self.mapped_by = "handoff"
        paths = paths if paths is not None else self.info.get("region_paths", [])
        while len(self._maps) <= region:
            path = paths[len(self._maps)]
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            self._maps.append((mm, C.addressof(C.c_char.from_buffer(mm))))
            self.mapped_by = "path"
        return self._maps[region][1]

    #: How the regions were mapped: "handoff" (descriptors), "path", or None.
    mapped_by: Optional[str] = None

    def _map_attachment(self) -> Optional[Attachment]:
        """An attachment of this pool made within a session, whose handoff
        hands the pool's regions (None: map by path). Called with the lock."""
        for att in self._attachments.values():
            if not att.closed and att.info.get("session_id") and not att.info.get("group") \
                    and att.info.get("handoff_socket"):
                return att
        if self._OWN_DEVICE:  # attach the pool's own device buffers now
            return self._attachment(self)
        return None

    #: Whether the pool knows its device buffers from construction (sglang's
    #: buffer_info, kvhost.sglang.plugin), so that mapping may attach them.
    _OWN_DEVICE = False

    def get_page_buffer_meta(self, indices: Any) -> Tuple[List[int], List[int]]:
        """(ptr_list, size_list) of whole pages' bytes, in sglang's order,
        pointing into the pool's region files mapped into this process."""
        meta = self.client.get_page_buffer_meta(self.name, indices)
        ptrs, sizes = [], []
        with self._lock:
            for seg in meta.get("segments", []):
                base = self._region_base(int(seg["region_index"]), meta.get("region_paths"))
                ptrs.append(base + int(seg["offset"]))
                sizes.append(int(seg["length"]))
        return ptrs, sizes

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """Whether every component's page start is `page_size_bytes`-aligned
        (NIXL O_DIRECT), as kvhostd answers it (IsStridePageAligned: a
        page-major layout's component buffers and page strides, PAGE_UNIFIED's
        page block and head-group range; LAYER_FIRST never, as in sglang).
        InvalidArgument for an alignment that is not a power of two."""
        answer = self.client.stride_alignment(self.name, int(page_size_bytes))
        return bool(answer["aligned"])

    # --- transfers ----------------------------------------------------------

    def _attachment(self, device_pool: Any) -> Attachment:
        """The attachment for `device_pool`, made on first use: an Attachment
        as given, an ShmDevicePool (host backend), or an sglang device pool
        (its k_buffer / v_buffer, or MLA's kv_buffer, CUDA tensors)."""
        if isinstance(device_pool, Attachment):
            return device_pool
        key = id(device_pool)
        with self._lock:
            att = self._attachments.get(key)
            if att is not None and not att.closed:
                return att
            if isinstance(device_pool, ShmDevicePool):
                att = self.client.attach_shm(self.name, device_pool, layer_progress=True)
            else:
                att = self._attach_tensors(device_pool)
            self._attachments[key] = att
            return att

    #: Event sets of an attachment: every backup and load not yet finished
    #: holds one (cuda backend), and the calls return before they finish.
    #: sglang keeps a few loads and a few backups in flight; past 16 a call
    #: waits for the oldest transfer first (KeptTickets.retrying).
    _LOAD_EVENT_SETS = 16

    def _attach_tensors(self, device_pool: Any) -> Attachment:
        return self.client.attach_tensors(self.name,
                                          components=self._device_components(device_pool),
                                          layer_progress=True,
                                          load_event_sets=self._LOAD_EVENT_SETS)

    def _device_components(self, device_pool: Any) -> Dict[str, List[Any]]:
        """An sglang device pool's per-layer CUDA tensors by Pool.components
        name (what attach_tensors takes)."""
        raise NotImplementedError(f"{type(self).__name__} does not know the tensors of "
                                  f"{type(device_pool).__name__}; attach them yourself and "
                                  f"pass the kvhost.Attachment")

    def _component_buffer(self, component: str) -> Any:
        """A component's host buffer, mapped from the pool's region file:
        a uint8 tensor (torch) or a memoryview (sglang's
        get_hybrid_pool_buffer entries, for storage backends to register)."""
        for comp in self.info.get("components", []):
            if comp["name"] == component:
                with self._lock:
                    base = self._region_base(int(comp["region_index"]))
                view = _arrays.raw_view(base + int(comp["offset"]), int(comp["bytes"]), self)
                if self._torch is not None:
                    return self._torch.frombuffer(view, dtype=self._torch.uint8)
                return view
        raise KeyError(f"pool '{self.name}' has no component {component!r}")

    @staticmethod
    def _check_io_backend(io_backend: Any) -> None:
        if io_backend is not None and io_backend not in IO_BACKENDS:
            raise ValueError(f"Unsupported IO backend: {io_backend!r} (expected "
                             f"{' or '.join(IO_BACKENDS)})")

    def _cuda_stream(self, att: Attachment) -> Any:
        """torch's current stream for an attachment of the cuda backend (the
        stream sglang's transfer engine set: its d2h or h2d stream); None on
        the host backend, whose transfers have no device stream to order."""
        if self._torch is not None and att.info.get("backend") == "cuda":
            # The device named: torch's current_stream() without one looks
            # the device up through torch.cuda.is_available(), which counts
            # the devices on every call (~60 us under torch 2.11, measured).
            cuda = self._torch.cuda
            return cuda.current_stream(cuda.current_device())
        return None

    def _transfer_layers(self, att: Attachment) -> int:
        """Ticket layers of the attachment's transfers."""
        layers = int(att.info.get("end_layer", 0)) - int(att.info.get("start_layer", 0))
        return layers or self.layer_num

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: Any,
                                     device_indices: Any, io_backend: Any = "kernel", *,
                                     event: Any = None) -> None:
        """Device rows -> host slots, every layer.

        cuda backend: returns once the backup is queued, without waiting for
        the copy. Its ready fence is an interprocess event recorded here on
        torch's current stream (or `event`, an interprocess torch.cuda.Event
        the caller recorded after writing the rows), so the daemon copies
        only what that stream wrote before the call; and the stream is made
        to wait for the backup's last layer, so an event the caller records
        on it next (sglang's ack_finish) completes only once every row is in
        the host pool. A failed backup raises, with the daemon's error, from
        this pool's next transfer call (or close()).

        host backend: the device rows are shared memory and the caller's
        events are CPU ones, always complete: the call returns once copied,
        raising the backup's error.
        """
        self._check_io_backend(io_backend)
        att = self._attachment(device_pool)
        self._transfers.backup(att, self._cuda_stream(att), host_indices, device_indices,
                               layers=self._transfer_layers(att), torch=self._torch,
                               event=event)

    def load_to_device_per_layer(self, device_pool: Any, host_indices: Any,
                                 device_indices: Any, layer_id: int,
                                 io_backend: Any = "kernel", *, is_draft: bool = False) -> None:
        """Host slots -> device rows of layer `layer_id` (of the attachment).

        Layer 0 submits the load of every layer; each layer's call makes
        torch's current stream wait for that layer of it (cuda backend) and
        returns, so the forward pass starts while later layers arrive (its
        indices past layer 0 are ignored). Nothing waits for the copies on
        the host: a failed load raises, with the daemon's error, from this
        pool's next transfer call (or close()). On the host backend (no
        device streams) each layer's call returns once that layer is copied
        and the last layer's raises the load's error.
        RuntimeError for a later layer with no load of layer 0 pending.
        Layers past target_layer_num are packed MTP draft layers: loaded
        only with is_draft=True (sglang's rule), else the call does nothing.
        """
        self._check_io_backend(io_backend)
        if not is_draft and not 0 <= int(layer_id) < self.target_layer_num:
            return
        att = self._attachment(device_pool)
        self._transfers.load_layer(att, self._cuda_stream(att), int(layer_id), host_indices,
                                   device_indices, layers=self._transfer_layers(att),
                                   what=f"pool '{self.name}'", torch=self._torch)

    @property
    def kv_buffer(self) -> Any:
        """The components' host buffers (init_kv_buffer), mapped on first use."""
        if self._kv_buffer is None:
            self._kv_buffer = self.init_kv_buffer()
        return self._kv_buffer

    @kv_buffer.setter
    def kv_buffer(self, value: Any) -> None:  # a kind without a tensor sets None
        self._kv_buffer = value

    _kv_buffer = None

    def init_kv_buffer(self) -> Any:
        """sglang's abstract allocation hook: the pool's memory is kvhostd's,
        so this returns the components' mapped host buffers."""
        return [self._component_buffer(c["name"]) for c in self.info.get("components", [])]

    def get_split_heads_page_buffer_meta(self, indices: Any, split_factor: int) -> Any:
        """Refused: kvhostd has no per-head-split page metadata (storage
        backends that split pages across TP ranks, e.g. mooncake's)."""
        raise NotImplementedError(f"kvhost pool '{self.name}': split-heads page metadata "
                                  f"(split_factor {split_factor}) is not supported")

    # --- lifetime -----------------------------------------------------------

    def destroy(self) -> None:
        """sglang's shutdown hook: close() (idempotent)."""
        self.close()

    def close(self) -> None:
        """Detaches the device pools attached here, unmaps the regions and
        closes the client if this object made it, which ends its session
        and so the claim (the slots stay allocated until the next claim
        reclaims them). The pool stays. Waits first for the transfers no
        call waited for (cuda backend), and raises the first one's error
        once everything is closed."""
        failed = self._transfers.drain()
        with self._lock:
            atts, self._attachments = list(self._attachments.values()), {}
            maps, self._maps = self._maps, []
            self._kv_buffer = None
        for att in atts:
            att.__exit__(None, None, None)
        for mm, _ in maps:
            try:
                mm.close()
            except BufferError:  # a caller's view of it is alive: leave it mapped
                pass
        if self._own_client:
            self.client.close()
        if failed is not None:
            raise failed

    def __enter__(self) -> "HostKVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, layout={self.layout!r}, "
                f"size={self.size}, page_size={self.page_size})")
