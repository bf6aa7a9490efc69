"""PyTorch glue, imported only when used: torch stays an optional dependency.

- :func:`attach_tensors`: attach a worker's per-layer CUDA tensors (K and V,
  or components by name) to a pool, with the sizes the ABI checks.
- :func:`interprocess_event`: a ``torch.cuda.Event`` a backup can wait on.
- Streams and events pass straight to the other calls:
  ``ticket.wait_layer(l, torch.cuda.current_stream())`` and
  ``att.backup(host, dev, event=event)`` accept torch objects.

Each tensor must be a contiguous CUDA tensor whose first dimension is the
device rows; the attachment holds the tensors so that their memory outlives
it.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from .transfer import Attachment


def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("kvhost.torch_helpers needs PyTorch (pip install torch)") from e
    return torch


def _check(name: str, layer: int, t: Any) -> None:
    if not getattr(t, "is_cuda", False):
        raise ValueError(f"component '{name}' layer {layer}: not a CUDA tensor "
                         f"(device {getattr(t, 'device', '?')})")
    if not t.is_contiguous():
        raise ValueError(f"component '{name}' layer {layer}: not contiguous")


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
    layers: Dict[str, Sequence[Any]] = {n: list(ts) for n, ts in components.items()}
    for name, tensors in layers.items():
        for i, t in enumerate(tensors):
            _check(name, i, t)
    if device_size_tokens is None:
        first_name = next(iter(layers))
        row_tokens = 1
        for c in client.get_pool(pool).get("components", []):
            if c.get("name") == first_name:
                row_tokens = int(c.get("row_tokens") or 1)
        device_size_tokens = int(layers[first_name][0].shape[0]) * row_tokens
    layer_bytes = {n: min(int(t.numel()) * int(t.element_size()) for t in ts)
                   for n, ts in layers.items()}
    ptrs = {n: [int(t.data_ptr()) for t in ts] for n, ts in layers.items()}
    return client.attach_cuda(pool, ptrs, device_size_tokens, layer_bytes=layer_bytes,
                              keep_alive=layers, **options)


def interprocess_event() -> Any:
    """A torch.cuda.Event(interprocess=True) (timing off, as IPC events need):
    record it on the stream that wrote the rows, pass it as backup(event=...),
    and keep it alive until the backup's ticket is done."""
    torch = _torch()
    return torch.cuda.Event(enable_timing=False, interprocess=True)
