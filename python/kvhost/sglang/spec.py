"""The words kvhost.sglang's pools share with kvhostd's pool spec: sglang's
layout and dtype names mapped to kvhost.v1's, element sizes, the unit of
sizes. A leaf: it imports nothing of the package.
"""

from __future__ import annotations

from typing import Any

#: Bytes of a GiB: ``host_size_gib`` is in the unit of kvhostd's and
#: kvhostctl's sizes (``--size-bytes=1G`` is 2**30), not sglang's decimal GB.
GIB = 1 << 30

#: sglang's layout names -> kvhost.v1.Layout. sglang's MLA
#: "page_first_kv_split" has no kvhost layout and is refused.
LAYOUTS = {
    "layer_first": "LAYER_FIRST",
    "page_first": "PAGE_FIRST",
    "page_first_direct": "PAGE_FIRST_DIRECT",
    "page_head": "PAGE_HEAD",
    "page_unified": "PAGE_UNIFIED",
}

#: dtype spellings (torch's without "torch.", and kvhost's) -> kvhost.v1.DType.
DTYPES = {
    "bfloat16": "BF16", "bf16": "BF16",
    "float16": "FP16", "half": "FP16", "fp16": "FP16",
    "float32": "FP32", "float": "FP32", "fp32": "FP32",
    "float8_e4m3fn": "FP8_E4M3", "fp8_e4m3": "FP8_E4M3",
    "float8_e5m2": "FP8_E5M2", "fp8_e5m2": "FP8_E5M2",
    "uint8": "UINT8",
}
ITEMSIZE = {"BF16": 2, "FP16": 2, "FP32": 4, "FP8_E4M3": 1, "FP8_E5M2": 1, "UINT8": 1}
TORCH_DTYPE = {"BF16": "bfloat16", "FP16": "float16", "FP32": "float32",
                "FP8_E4M3": "float8_e4m3fn", "FP8_E5M2": "float8_e5m2", "UINT8": "uint8"}
#: sglang's io_backend values; the daemon picks its own copy engine for both.
IO_BACKENDS = ("kernel", "direct")


def layout_enum(layout: str) -> str:
    """kvhost's Layout name for sglang's `layout`; ValueError naming it."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: kvhostd has "
                         f"{', '.join(repr(k) for k in LAYOUTS)}")
    return LAYOUTS[layout]


def dtype_enum(dtype: Any) -> str:
    """kvhost's DType name for a torch dtype or its name; ValueError naming it."""
    key = str(dtype).lower()
    key = key[len("torch."):] if key.startswith("torch.") else key
    if key.upper() in ITEMSIZE:
        return key.upper()
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: kvhostd has {', '.join(sorted(DTYPES))}")
    return DTYPES[key]
