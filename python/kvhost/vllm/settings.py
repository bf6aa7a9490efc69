"""kvhost's settings of a vLLM instance, read from ``kv_connector_extra_config``
(vLLM 0.33's OffloadingConfig.extra_config), and the supported-release check.

Every setting has a default; a bad value is a ValueError naming the key and
the value (docs/VLLM.md lists them). The keys start with ``kvhost_`` so they
never meet vLLM's own (``spec_name``, ``blocks_per_chunk``, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .._tokens import read_token_file
from ..client import DEFAULT_ADDRESS

#: vLLM releases whose offloading interfaces (vllm/v1/kv_offload/base.py,
#: .../kv_connector/v1/offloading/{scheduler,worker}.py) kvhost.vllm was
#: written and tested against (tests/python_vllm_test.py).
SUPPORTED_VLLM = ("0.33.0",)

#: The cache's size when this instance is the first to create it (4 GiB).
DEFAULT_CACHE_BYTES = 4 << 30
#: Seconds a kvhost call may take before it fails (the client's timeout).
DEFAULT_TIMEOUT_S = 10.0

_KEYS = ("kvhost_address", "kvhost_cache", "kvhost_owner_token", "kvhost_owner_token_file",
         "kvhost_cache_bytes", "kvhost_timeout_s")


def check_release(version: str) -> None:
    """RuntimeError naming `version` unless it is in SUPPORTED_VLLM."""
    if version not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"kvhost.vllm: vLLM {version} is not supported (supported: "
            f"{', '.join(SUPPORTED_VLLM)}); its OffloadingSpec / OffloadingManager / "
            f"OffloadingWorker interfaces change between releases (docs/VLLM.md)")


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"kvhost.vllm: kv_connector_extra_config[{key!r}] = {value!r} {why} "
                      f"(docs/VLLM.md)")


def _text(extra: Mapping[str, Any], key: str, default: Optional[str]) -> Optional[str]:
    value = extra.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or not value or "\x00" in value:
        raise _bad(key, value, "is not a non-empty string")
    return value


def _positive(extra: Mapping[str, Any], key: str, default: float, integer: bool) -> float:
    value = extra.get(key, default)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not value > 0:
        raise _bad(key, value, f"is not a positive {'integer' if integer else 'number'}")
    return float(value)


@dataclass(frozen=True)
class Settings:
    """What kvhost.vllm needs to reach its node cache."""

    #: kvhostd's address (default $KVHOST_ADDRESS, else kvhost.DEFAULT_ADDRESS).
    address: str
    #: The cache's pool name; None: derived from the model's cache shape
    #: (keys.CacheNamespace.default_cache_name).
    cache: Optional[str]
    #: The cache's owner token (default $KVHOST_OWNER_TOKEN): every instance
    #: that shares the cache presents it.
    owner_token: str
    #: Bytes of the cache when this instance creates it.
    cache_bytes: int
    #: A kvhost call's timeout in seconds.
    timeout_s: float

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "Settings":
        """The settings of `extra` (kv_connector_extra_config), validated."""
        unknown = sorted(k for k in extra if k.startswith("kvhost_") and k not in _KEYS)
        if unknown:
            raise _bad(unknown[0], extra[unknown[0]],
                       f"is not a kvhost setting (known: {', '.join(_KEYS)})")
        address = _text(extra, "kvhost_address",
                        os.environ.get("KVHOST_ADDRESS") or DEFAULT_ADDRESS)
        token_file = _text(extra, "kvhost_owner_token_file", None)
        token = _text(extra, "kvhost_owner_token", None)
        if token_file is not None and token is not None:
            raise _bad("kvhost_owner_token_file", token_file,
                       "is given beside kvhost_owner_token: give one of them")
        if token_file is not None:
            try:
                token = read_token_file(token_file)
            except ValueError as e:
                raise _bad("kvhost_owner_token_file", token_file,
                           f"holds no owner token: {e}") from None
        if token is None:
            token = os.environ.get("KVHOST_OWNER_TOKEN") or None
        if token is None:
            raise _bad("kvhost_owner_token", None,
                       "is not set, nor kvhost_owner_token_file, nor $KVHOST_OWNER_TOKEN: the "
                       "node cache is shared by the instances that present its owner token")
        assert address is not None
        return cls(address=address, cache=_text(extra, "kvhost_cache", None), owner_token=token,
                   cache_bytes=int(_positive(extra, "kvhost_cache_bytes", DEFAULT_CACHE_BYTES,
                                             True)),
                   timeout_s=_positive(extra, "kvhost_timeout_s", DEFAULT_TIMEOUT_S, False))
