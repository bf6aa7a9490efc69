"""``KvhostOffloadingSpec``: vLLM 0.33's ``OffloadingSpec``
(vllm/v1/kv_offload/base.py) whose tier is kvhostd's node cache.

vLLM's OffloadingConnector builds one in its scheduler and in every worker
(OffloadingSpecFactory.create_spec, vllm/v1/kv_offload/factory.py), by name:

  --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
    "kv_connector_extra_config":{"spec_name":"KvhostOffloadingSpec",
                                 "spec_module_path":"kvhost.vllm"}}'

or, with kvhost's ``vllm.general_plugins`` entry point installed
(plugin.py), by spec_name alone. The constructor is cheap and connects to
nothing: it checks the vLLM release and the settings (settings.py), and
refuses what kvhost cannot serve, at start-up and by name (more than one KV
cache group; vLLM's canonical_layout). get_manager (scheduler) and
get_worker (each worker) connect, each with its own kvhost session.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import vllm
from vllm.v1.kv_offload.base import OffloadingSpec

from .keys import CacheNamespace
from .manager import KvhostOffloadingManager
from .settings import Settings, check_release
from .worker import KvhostOffloadingWorker


class KvhostOffloadingSpec(OffloadingSpec):  # type: ignore[misc]  # vLLM's class: Any to mypy
    """vLLM's KV offloading into kvhostd's node cache (docs/VLLM.md)."""

    def __init__(self, config: Any) -> None:
        check_release(str(vllm.__version__))
        super().__init__(config)
        self.settings = Settings.from_extra_config(self.extra_config)
        if config.canonical_layout:
            raise ValueError("kvhost.vllm: kv_connector_extra_config['canonical_layout'] = True "
                             "is not supported: kvhost stores each rank's own pages "
                             "(docs/VLLM.md)")
        if len(config.groups) != 1:
            raise ValueError(f"kvhost.vllm: {len(config.groups)} KV cache groups to offload "
                             f"(a hybrid model); kvhost serves one (docs/VLLM.md)")
        # As vLLM's CPU spec: where every rank holds the same bytes (MLA under
        # TP), OffloadingConnectorWorker lets rank 0 alone store them.
        self.replicated_layout = bool(config.replicated_layout)
        self.namespace = CacheNamespace(config)
        #: The cache's pool name.
        self.cache_name = self.settings.cache or self.namespace.default_cache_name()
        #: This worker's shard of a chunk (keys.py): its rank, or 0 when
        #: the ranks' bytes are the same.
        self.shard = 0 if self.replicated_layout else int(config.parallel.rank)
        self._manager: Optional[KvhostOffloadingManager] = None
        self._worker: Optional[KvhostOffloadingWorker] = None

    def _worker_name(self, role: str) -> str:
        return f"vllm-{role}:{self.config.engine_id}:{os.getpid()}"

    def get_manager(self) -> KvhostOffloadingManager:
        if self._manager is None:
            self._manager = KvhostOffloadingManager(
                self.settings, self.namespace, self.cache_name,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                worker_name=self._worker_name("scheduler"))
        return self._manager

    def get_worker(self, kv_caches: Any) -> KvhostOffloadingWorker:
        if self._worker is None:
            self._worker = KvhostOffloadingWorker(
                self.settings, self.namespace, self.cache_name, self.shard, kv_caches,
                worker_name=self._worker_name(f"worker{self.config.parallel.rank}"))
        return self._worker
