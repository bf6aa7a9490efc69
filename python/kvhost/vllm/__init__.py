"""kvhost for vLLM: KV offloading into kvhostd's node cache (docs/VLLM.md).

``KvhostOffloadingSpec`` is a vLLM 0.33 OffloadingSpec that vLLM's
OffloadingConnector loads by name (``"spec_module_path": "kvhost.vllm"``, or
the ``vllm.general_plugins`` entry point, plugin.py). Its manager
(scheduler) and worker (each GPU worker) store and restore vLLM's KV blocks
by key in a node cache that every vLLM instance on the node with the same
owner token shares, and that outlives them.

  spec.py            KvhostOffloadingSpec
  manager.py         KvhostOffloadingManager (OffloadingManager)
  worker.py          KvhostOffloadingWorker (OffloadingWorker)
  load_store_spec.py KvhostLoadStoreSpec (LoadStoreSpec): a job's chunks
  keys.py            CacheNamespace: node-cache keys of vLLM's chunks
  layout.py          CacheLayout: canonical KV tensors as a kvhost pool
  settings.py        Settings (kv_connector_extra_config), SUPPORTED_VLLM
  plugin.py          register(): the vllm.general_plugins entry point

Importing this package imports vLLM's offloading modules.
"""

from .keys import CacheNamespace
from .layout import CacheLayout, register_shm_device_pool
from .load_store_spec import KvhostLoadStoreSpec
from .manager import KvhostOffloadingManager
from .settings import SUPPORTED_VLLM, Settings, check_release
from .spec import KvhostOffloadingSpec
from .worker import KvhostOffloadingWorker

__all__ = ["CacheLayout", "CacheNamespace", "KvhostLoadStoreSpec", "KvhostOffloadingManager",
           "KvhostOffloadingSpec", "KvhostOffloadingWorker", "SUPPORTED_VLLM", "Settings",
           "check_release", "register_shm_device_pool"]
