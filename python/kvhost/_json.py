"""JSON between Python and the C ABI: dicts out, dicts or text in.

The ABI speaks protobuf's JSON mapping of the kvhost.v1 messages, which
writes 64-bit integers as strings ("64"). A Python caller wants ints, so
:func:`loads` turns the string values of the 64-bit fields back into ints.
It knows them by name (:data:`INT64_FIELDS`); the package ships no .proto
files to read them from. tests/python_package_test.py checks the set against
proto/kvhost/v1/*.proto, so a new 64-bit field cannot be missed silently.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Union

from . import _lib

#: The kvhost.v1 fields of a 64-bit integer type, less any name that some
#: other message gives a string, bytes or enum field (there: "id"), whose
#: string values must stay strings.
INT64_FIELDS = frozenset("""
aborted after_seq age_s alignment available_tokens backup_bytes bytes bytes_per_page
bytes_per_token bytes_released bytes_saved device_indices device_size_tokens dims
duration_us enqueue_us evicted first_layer_us free_pages freed generation head_bytes heads
hit_bytes hit_pages hits host_indices index indices item_bytes items l3_fetched l3_missed
l3_written layer_base layers
length load_bytes memory_available_bytes memory_limit_bytes memory_reserve_bytes misses
next_after num_tokens offset page_bytes page_num page_size page_strides pages_written pid
pin_id pinned plane_bytes planes pool_bytes pool_bytes_releasing populated_bytes
prefix_pages published reclaimed_tokens region_bytes region_offset row_bytes seq since_s
size_bytes size_tokens skipped state_slot_bytes stored stored_bytes stored_pages ticket_id
tickets_done tickets_failed tickets_in_flight tile_begin tile_end timeout_ms token_bytes
tokens uptime_s writing
""".split())


def _ints(value: Any) -> Any:
    """A 64-bit field's value: its string (or list of strings) as ints."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return _convert(value)  # a message of the same name elsewhere ("layers")


def _convert(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (_ints(v) if k in INT64_FIELDS else _convert(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_convert(v) for v in node]
    return node


def loads(text: str) -> Any:
    """The ABI's JSON as Python objects, 64-bit integer fields as ints."""
    return _convert(json.loads(text))


def dumps(spec: Union[Mapping[str, Any], str, bytes], what: str) -> bytes:
    """A spec for the ABI: a mapping as JSON, text passed on as it is.

    `what` names the argument in the TypeError for anything else.
    """
    if isinstance(spec, bytes):
        return spec
    if isinstance(spec, str):
        return _lib.text(spec, what)
    if isinstance(spec, Mapping):
        return json.dumps(dict(spec)).encode()
    raise TypeError(f"{what} must be a mapping or JSON text, not {type(spec).__name__}")
