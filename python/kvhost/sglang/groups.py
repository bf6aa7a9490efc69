"""Pools a worker moves together: :class:`PoolEntry` and
:class:`HostPoolGroup`, sglang's group of host pools as one kvhostd pool
group with one attachment (re-exported by kvhost.sglang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, cast

from ..client import Client
from ..errors import AlreadyExists
from ..pools import adopt_group
from ..shm import ShmDevicePool
from ..transfer import Attachment
from .host_pool import HostKVCache
from .kinds import LogicalHostPool
from .transfers import SchedulerTransfers


@dataclass
class PoolEntry:
    """One pool of a HostPoolGroup, as the seed's: its host pool (one of the
    kvhost.sglang classes), the worker's device pool for it (a
    kvhost.ShmDevicePool on the host backend, or an sglang device pool),
    and the layer mapper: model layer -> the pool's device layer, or None.
    The eviction and device alloc hooks are the caller's (HiCache's); the
    group keeps them and does not call them."""

    name: str
    host_pool: Any
    device_pool: Any
    layer_mapper: Callable[[int], Optional[int]]
    is_primary_index_anchor: bool = False
    host_evict_fn: Optional[Callable[..., Any]] = None
    device_evict_fn: Optional[Callable[..., Any]] = None
    device_alloc_fn: Optional[Callable[..., Any]] = None
    device_free_fn: Optional[Callable[..., Any]] = None


class HostPoolGroup:
    """sglang's group of host pools moved together, as one kvhostd pool group
    (PoolGroup): slots, pages and sizes are the anchor entry's (the first
    with is_primary_index_anchor, else the first); a transfer moves the
    anchor's rows and each ``pool_transfers`` entry's, all in one daemon
    transfer through one attachment of every entry's device pool.

    Args:
      entries: the PoolEntry list (ValueError when empty, as the seed's).
      name: the kvhostd group's name (default: the anchor pool's + ".group").
        A group of that name that exists is used if its entries are these
        and its pools the client's own (kvhost.pools.adopt_group).
      layer_num: model layers the layer mappers are asked about (default:
        the largest layer_num of the entries' pools).

    What differs from the seed: ``pool_transfers`` naming an entry the group
    does not have, or the anchor, is the daemon's InvalidArgument (the seed
    skips it); ``load_to_device_per_layer`` at layer 0 submits every layer of
    every entry and each layer call waits for its layer, as kvhost.sglang's
    pools do; the device pools are the entries' (the argument is ignored, as
    in the seed).
    """

    def __init__(self, entries: List[PoolEntry], *, name: Optional[str] = None,
                 layer_num: Optional[int] = None) -> None:
        if not entries:
            raise ValueError("HostPoolGroup requires at least one pool entry.")
        self.entries = entries
        self.entry_map = {entry.name: entry for entry in entries}
        self.anchor_entry = next((e for e in entries if e.is_primary_index_anchor), entries[0])
        anchor = self.anchor_entry.host_pool
        self.client: Client = anchor.client
        self.name = name or f"{anchor.name}.group"
        self.layer_num = int(layer_num if layer_num is not None else
                             max(int(e.host_pool.layer_num) for e in entries))
        spec: Dict[str, Any] = {"layer_num": self.layer_num, "entries": [
            {"name": e.name, "pool": e.host_pool.name,
             "layer_map": _layer_map(e, self.layer_num),
             "anchor": e is self.anchor_entry} for e in entries]}
        try:
            self.info = self.client.create_group(self.name, spec)
        except AlreadyExists:
            self.info = adopt_group(self.client, self.name)
            have = [(e["name"], e["pool"], list(e["layer_map"])) for e in self.info["entries"]]
            want = [(e["name"], e["pool"], e["layer_map"]) for e in spec["entries"]]
            if have != want or self.info["anchor"] != self.anchor_entry.name:
                raise ValueError(f"group '{self.name}' exists with other entries") from None
        self.layout = anchor.layout
        self.page_size = anchor.page_size
        self.size = anchor.size
        self.can_use_write_back_jit = False
        self._attachment: Optional[Attachment] = None
        self._own_devices: List[ShmDevicePool] = []
        self._transfers = SchedulerTransfers()

    # --- the anchor's ---------------------------------------------------------

    @property
    def kv_buffer(self) -> Any:
        return getattr(self.anchor_entry.host_pool, "kv_buffer", None)

    @property
    def size_per_token(self) -> int:
        return cast(int, self.anchor_entry.host_pool.size_per_token)

    @property
    def dtype(self) -> str:
        return cast(str, self.anchor_entry.host_pool.dtype)

    @property
    def start_layer(self) -> int:
        return int(self.anchor_entry.host_pool.info.get("start_layer", 0))

    @property
    def end_layer(self) -> int:
        return int(self.anchor_entry.host_pool.info.get("end_layer", 0))

    def get_ksize_per_token(self) -> int:
        return cast(int, self.anchor_entry.host_pool.get_ksize_per_token())

    def get_pool(self, name: str) -> Any:
        """The host pool of entry `name` (KeyError naming it)."""
        return self.entry_map[name].host_pool

    def get_page_buffer_meta(self, indices: Any) -> Any:
        return self.anchor_entry.host_pool.get_page_buffer_meta(indices)

    def clear(self) -> None:
        """Every entry's clear()."""
        for entry in self.entries:
            entry.host_pool.clear()

    def available_size(self) -> int:
        return cast(int, self.anchor_entry.host_pool.available_size())

    def alloc(self, need_size: int) -> Any:
        return self.anchor_entry.host_pool.alloc(need_size)

    def free(self, indices: Any) -> int:
        return cast(int, self.anchor_entry.host_pool.free(indices))

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        return self.anchor_entry.host_pool.get_data_page(index, flat)

    def get_dummy_flat_data_page(self) -> Any:
        return self.anchor_entry.host_pool.get_dummy_flat_data_page()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        self.anchor_entry.host_pool.set_from_flat_data_page(index, data_page)

    # --- transfers ------------------------------------------------------------

    def attachment(self) -> Attachment:
        """The group's attachment of every entry's device pool, made on first
        use: shm device pools (host backend) or the sglang device pools'
        CUDA tensors; a LOGICAL entry needs none."""
        if self._attachment is not None and not self._attachment.closed:
            return self._attachment
        logical = {e.name: e.host_pool.device_size for e in self.entries
                   if isinstance(e.host_pool, LogicalHostPool)}
        devices = {e.name: e.device_pool for e in self.entries}
        if all(isinstance(d, ShmDevicePool) for n, d in devices.items() if n not in logical):
            for n in logical:
                if not isinstance(devices[n], ShmDevicePool):
                    # No bytes to hold: only its device rows' count matters.
                    devices[n] = self.client.shm_device_pool(self.entry_map[n].host_pool.name,
                                                             logical[n])
                    self._own_devices.append(devices[n])
            self._attachment = self.client.attach_group_shm(self.name, devices,
                                                            layer_progress=True)
        else:
            tensors = {e.name: ({} if e.name in logical else
                                e.host_pool._device_components(e.device_pool))
                       for e in self.entries}
            self._attachment = self.client.attach_group_tensors(
                self.name, tensors, device_size_tokens=logical, layer_progress=True,
                load_event_sets=HostKVCache._LOAD_EVENT_SETS)
        return self._attachment

    def _pool_transfers(self, pool_transfers: Any) -> Dict[str, Tuple[Any, Any]]:
        """The seed's PoolTransfer list (.name, .host_indices,
        .device_indices; None host indices skipped) or a dict as
        Attachment.backup takes, as that dict."""
        if pool_transfers is None:
            return {}
        if isinstance(pool_transfers, Mapping):
            return dict(pool_transfers)
        out: Dict[str, Tuple[Any, Any]] = {}
        for t in pool_transfers:
            if t.host_indices is None:
                continue
            out[t.name] = (_as_list(t.host_indices), _as_list(t.device_indices))
        return out

    def _cuda_stream(self, att: Attachment) -> Any:
        """torch's current stream on the cuda backend, None on the host
        backend (as the pools' own, HostKVCache._cuda_stream)."""
        return self.anchor_entry.host_pool._cuda_stream(att)

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: Any,
                                     device_indices: Any, io_backend: Any = "kernel",
                                     pool_transfers: Any = None) -> None:
        """The anchor's rows and each pool_transfers entry's, device -> host,
        every layer. `device_pool` is ignored (the entries' are used), as in
        the seed. As the pools' backups: on CUDA it returns once queued, the
        current stream's writes before the call fenced and the stream made
        to wait for the backup's end (a failure raises from the next
        transfer call or close()); on the host backend once copied."""
        HostKVCache._check_io_backend(io_backend)
        att = self.attachment()
        self._transfers.backup(att, self._cuda_stream(att), _as_list(host_indices),
                               _as_list(device_indices), layers=self.layer_num,
                               torch=self.anchor_entry.host_pool._torch,
                               pool_transfers=self._pool_transfers(pool_transfers))

    def load_to_device_per_layer(self, device_pool: Any, host_indices: Any,
                                 device_indices: Any, layer_id: int, io_backend: Any = "kernel",
                                 pool_transfers: Any = None) -> None:
        """Model layer `layer_id` of a load, host -> device: layer 0 submits
        the anchor's rows and each pool_transfers entry's for every layer,
        then every call waits for its layer (every entry's mapped layer): on
        CUDA on the current stream, with no host wait for the copies (a
        failure raises from the next transfer call or close()); on the host
        backend the last layer also waits for the whole load. RuntimeError
        for a later layer with no load of layer 0 pending."""
        HostKVCache._check_io_backend(io_backend)
        att = self.attachment()
        self._transfers.load_layer(att, self._cuda_stream(att), int(layer_id),
                                   _as_list(host_indices), _as_list(device_indices),
                                   layers=self.layer_num, what=f"group '{self.name}'",
                                   torch=self.anchor_entry.host_pool._torch,
                                   pool_transfers=self._pool_transfers(pool_transfers))

    def close(self) -> None:
        """Detaches the group's attachment; the group and its pools stay.
        Waits first for the transfers no call waited for (CUDA), and raises
        the first one's error once detached."""
        failed = self._transfers.drain()
        if self._attachment is not None:
            self._attachment.__exit__(None, None, None)
            self._attachment = None
        for dev in self._own_devices:
            dev.close()
        self._own_devices = []
        if failed is not None:
            raise failed

    def __enter__(self) -> "HostPoolGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HostPoolGroup({self.name!r}, entries={[e.name for e in self.entries]}, "
                f"anchor={self.anchor_entry.name!r})")


def _layer_map(entry: PoolEntry, layer_num: int) -> List[int]:
    """The entry's layer_mapper over the model layers as PoolEntry.layer_map
    (-1 for None); a LOGICAL pool holds no layers, so all -1."""
    if isinstance(entry.host_pool, LogicalHostPool):
        return [-1] * layer_num
    mapped = (entry.layer_mapper(layer) for layer in range(layer_num))
    return [-1 if m is None else int(m) for m in mapped]


def _as_list(indices: Any) -> Any:
    """Indices as the ABI takes them (a tensor's values through .tolist())."""
    if indices is None:
        return []
    return indices.tolist() if hasattr(indices, "tolist") else indices
