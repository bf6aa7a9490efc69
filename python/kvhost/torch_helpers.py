"""PyTorch glue, imported only when used: torch stays an optional dependency.

- :func:`attach_tensors`: attach a worker's per-layer CUDA tensors (K and V,
  or components by name) to a pool, with the sizes the ABI checks.
- :func:`attach_group_tensors`: the same for a pool group, one set of
  per-layer tensors per entry (a hybrid model's KV and Mamba state, say).
- :func:`interprocess_event`: a ``torch.cuda.Event`` a backup can wait on.
- :class:`TorchAttachCalls`: both attach calls as Client methods
  (``client.attach_tensors``), mixed into :class:`kvhost.Client`; this module
  imports the core (kvhost.transfer), never the reverse.
- Streams and events pass straight to the other calls:
  ``ticket.wait_layer(l, torch.cuda.current_stream())`` and
  ``att.backup(host, dev, event=event)`` accept torch objects.

Each tensor must be a contiguous CUDA tensor whose first dimension is the
device rows; the attachment holds the tensors so that their memory outlives
it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .transfer import Attachment, CudaGroupEntry


def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("kvhost.torch_helpers needs PyTorch (pip install torch)") from e
    return torch


def _check(where: str, name: str, layer: int, t: Any) -> None:
    if not getattr(t, "is_cuda", False):
        raise ValueError(f"{where}component '{name}' layer {layer}: not a CUDA tensor "
                         f"(device {getattr(t, 'device', '?')})")
    if not t.is_contiguous():
        raise ValueError(f"{where}component '{name}' layer {layer}: not contiguous")


def attach_tensors(client: Any, pool: str, k_layers: Optional[Sequence[Any]] = None,
                   v_layers: Optional[Sequence[Any]] = None, *,
                   components: Optional[Mapping[str, Sequence[Any]]] = None,
                   device_size_tokens: Optional[int] = None, **options: Any) -> Attachment:
    """Attaches per-layer CUDA tensors to `pool` (Client.attach_cuda).

    Args:
      client: a kvhost.Client.
      pool: the pool's name.
      k_layers, v_layers: MHA's per-layer K and V tensors, or
      components: per-layer tensors by Pool.components name.
      device_size_tokens: rows per buffer in tokens; by default the first
        tensor's rows (shape[0]) times its component's row_tokens.
      options: attach_cuda's keywords (layer_progress, start_layer, ...).
    """
    _torch()
    if components is None:
        if k_layers is None:
            raise ValueError("give k_layers (and v_layers) or components")
        components = {"k": list(k_layers)}
        if v_layers is not None:
            components["v"] = list(v_layers)
    elif k_layers is not None or v_layers is not None:
        raise ValueError("give k_layers / v_layers or components, not both")
    layers, ptrs, layer_bytes = _pointers(components, "")
    if device_size_tokens is None:
        device_size_tokens = _rows(client.get_pool(pool), layers)
    att: Attachment = client.attach_cuda(pool, ptrs, device_size_tokens,
                                         layer_bytes=layer_bytes, keep_alive=layers, **options)
    return att


def _pointers(components: Mapping[str, Sequence[Any]], what: str
              ) -> Tuple[Dict[str, List[Any]], Dict[str, List[int]], Dict[str, int]]:
    """The tensors checked, their data pointers and each component's
    smallest layer size in bytes (what the ABI checks against the pool)."""
    layers: Dict[str, List[Any]] = {n: list(ts) for n, ts in components.items()}
    for name, tensors in layers.items():
        for i, t in enumerate(tensors):
            _check(what, name, i, t)
    layer_bytes = {n: min((int(t.numel()) * int(t.element_size()) for t in ts), default=0)
                   for n, ts in layers.items()}
    ptrs = {n: [int(t.data_ptr()) for t in ts] for n, ts in layers.items()}
    return layers, ptrs, layer_bytes


def _rows(pool: Mapping[str, Any], layers: Mapping[str, Sequence[Any]]) -> int:
    """Device rows in tokens: the first tensor's rows (shape[0]) times its
    component's row_tokens in `pool` (a kvhost.v1.Pool dict); 0 without
    tensors."""
    first = next((n for n, ts in layers.items() if ts), None)
    if first is None:
        return 0
    row_tokens = 1
    for c in pool.get("components", []):
        if c.get("name") == first:
            row_tokens = int(c.get("row_tokens") or 1)
    return int(layers[first][0].shape[0]) * row_tokens


def attach_group_tensors(client: Any, group: str,
                         entries: Mapping[str, Mapping[str, Sequence[Any]]], *,
                         device_size_tokens: Optional[Mapping[str, int]] = None,
                         layer_ranges: Optional[Mapping[str, Tuple[int, int]]] = None,
                         **options: Any) -> Attachment:
    """Attaches per-layer CUDA tensors to pool group `group`
    (Client.attach_group_cuda), one entry at a time.

    Args:
      client: a kvhost.Client.
      group: the group's name.
      entries: ``{entry: {component: [tensor per layer]}}``, every entry of
        the group once (``{}`` for an entry whose pool has no components,
        such as a LOGICAL anchor).
      device_size_tokens: rows per buffer in tokens, by entry; an entry not
        given takes its first tensor's rows (shape[0]) times its component's
        row_tokens.
      layer_ranges: ``{entry: (start_layer, end_layer)}``, the entry pool's
        device layers the tensors hold; an entry not given holds its pool's
        range.
      options: attach_group_cuda's keywords (layer_progress, ...).
    """
    _torch()
    sizes = dict(device_size_tokens or {})
    ranges = dict(layer_ranges or {})
    unknown = sorted((set(sizes) | set(ranges)) - set(entries))
    if unknown:
        raise ValueError(f"device_size_tokens / layer_ranges name entries not given: "
                         f"{', '.join(unknown)}")
    pools: Dict[str, str] = {}
    if any(name not in sizes for name in entries):
        pools = {e["name"]: e["pool"] for e in client.get_group(group).get("entries", [])}
    kept: Dict[str, Dict[str, List[Any]]] = {}
    given: Dict[str, CudaGroupEntry] = {}
    for name, components in entries.items():
        layers, ptrs, layer_bytes = _pointers(components, f"entry '{name}' ")
        rows = sizes.get(name)
        if rows is None:
            rows = _rows(client.get_pool(pools[name]), layers) if name in pools else 0
        start, end = ranges.get(name, (0, 0))
        kept[name] = layers
        given[name] = CudaGroupEntry(ptrs, int(rows), layer_bytes, int(start), int(end))
    att: Attachment = client.attach_group_cuda(group, given, keep_alive=kept, **options)
    return att


def interprocess_event() -> Any:
    """A torch.cuda.Event(interprocess=True) (timing off, as IPC events need):
    record it on the stream that wrote the rows, pass it as backup(event=...),
    and keep it alive until the backup's ticket is done."""
    torch = _torch()
    return torch.cuda.Event(enable_timing=False, interprocess=True)


class TorchAttachCalls:
    """The attach calls from torch tensors, as methods of a Client (mixed in;
    torch is imported on the first call, not with this class)."""

    def attach_tensors(self, pool: str, k_layers: Optional[Sequence[Any]] = None,
                       v_layers: Optional[Sequence[Any]] = None, *,
                       components: Optional[Mapping[str, Sequence[Any]]] = None,
                       device_size_tokens: Optional[int] = None, **options: Any) -> Attachment:
        """attach_cuda from per-layer torch tensors (imports torch lazily).

        Give ``k_layers`` / ``v_layers`` (MHA) or ``components`` by name
        (``{"latent": [...]}`` for MLA). device_size_tokens defaults to the
        first tensor's rows times its component's row_tokens. Other keywords
        are attach_cuda's. See :func:`attach_tensors`.
        """
        return attach_tensors(self, pool, k_layers, v_layers, components=components,
                              device_size_tokens=device_size_tokens, **options)

    def attach_group_tensors(self, group: str, entries: Mapping[str, Mapping[str, Sequence[Any]]],
                             **options: Any) -> Attachment:
        """attach_group_cuda from per-layer torch tensors, ``{entry:
        {component: [tensor per layer]}}`` (imports torch lazily). See
        :func:`attach_group_tensors` for the keywords."""
        return attach_group_tensors(self, group, entries, **options)

