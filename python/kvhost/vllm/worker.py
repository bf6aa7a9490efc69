"""vLLM 0.33's ``OffloadingWorker`` (vllm/v1/kv_offload/base.py) over
kvhostd's node cache: runs in every vLLM worker process.

Built by KvhostOffloadingSpec.get_worker once vLLM's
OffloadingConnectorWorker.register_kv_caches has the canonical KV tensors
(.../kv_connector/v1/offloading/worker.py); it connects a worker session,
creates or adopts the cache pool (layout.py) and attaches the tensors once.
Then each job is one node-cache call per 4096 keys:

  submit_store(job, GPULoadStoreSpec, KvhostLoadStoreSpec) -> Store
  submit_load(job, KvhostLoadStoreSpec, GPULoadStoreSpec)  -> Restore

the GPU block ids as device rows, one key per block (keys.py), with the
chunk side skipping ``block_indices[g] % blocks_per_chunk`` blocks of its
first chunk, as vLLM's CPU worker (cpu/gpu_worker.py transfer_async) does.
On CUDA tensors each call waits, in kvhostd, for an event recorded on the
current stream at submit (the model's writes of a stored block, the
scheduler's zeroing of a loaded one: the fences vLLM's CPU worker takes
with wait_stream). get_finished polls the tickets; wait blocks on them.

vLLM's OffloadingConnectorWorker asserts every submit's return value, so a
submit never raises and returns True: a kvhost error (a key evicted since
the lookup, the daemon gone, the cache full of pinned pages) is absorbed and
reported by get_finished as TransferResult(success=False). vLLM 0.33's
connector asserts success there too, so such a job stops the engine with
an AssertionError rather than serving blocks that were never loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Set, Tuple

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from ..cache import KeyState, NodeCache
from ..client import Client
from ..errors import KvhostError
from ..torch_helpers import interprocess_event
from ..transfer import Attachment, Ticket
from .keys import CacheNamespace
from .layout import CacheLayout
from .load_store_spec import KvhostLoadStoreSpec
from .settings import Settings

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    job_id: int
    tickets: List[Ticket]
    num_bytes: int
    start: float
    #: CUDA events the copies wait for: alive until the tickets are done.
    events: List[Any] = field(default_factory=list)
    failed: Optional[str] = None


def plan(namespace: CacheNamespace, shard: int, gpu_spec: Any,
         chunks: KvhostLoadStoreSpec) -> Tuple[List[bytes], List[int]]:
    """The node-cache keys and GPU block ids (device rows) of a job, one per
    GPU block: vLLM's GPULoadStoreSpec (block_ids, per group group_sizes and
    block_indices) against the chunks' OffloadKeys. ValueError when they do
    not match."""
    bpc = namespace.blocks_per_chunk
    block_ids = [int(b) for b in gpu_spec.block_ids]
    keys: List[bytes] = []
    rows: List[int] = []
    gpu_off = chunk_off = 0
    for size, first in zip(gpu_spec.group_sizes, gpu_spec.block_indices):
        if size == 0:
            continue
        skip = int(first) % bpc
        num_chunks = -(-(skip + int(size)) // bpc)
        if chunk_off + num_chunks > len(chunks) or gpu_off + size > len(block_ids):
            raise ValueError(f"kvhost.vllm: a group of {size} blocks from block {first} needs "
                             f"{num_chunks} chunks past {chunk_off}; the job has {len(chunks)}")
        for i in range(int(size)):
            pos = skip + i
            keys.append(namespace.key(chunks.offload_keys[chunk_off + pos // bpc], shard,
                                      pos % bpc))
            rows.append(block_ids[gpu_off + i])
        gpu_off += int(size)
        chunk_off += num_chunks
    if chunk_off != len(chunks) or gpu_off != len(block_ids):
        raise ValueError(f"kvhost.vllm: the job's {len(block_ids)} GPU blocks use "
                         f"{gpu_off} and {chunk_off} of its {len(chunks)} chunks")
    return keys, rows


class KvhostOffloadingWorker(OffloadingWorker):  # type: ignore[misc]  # vLLM's: Any to mypy
    """Stores and restores a worker's KV blocks in kvhostd's node cache."""

    def __init__(self, settings: Settings, namespace: CacheNamespace, cache_name: str,
                 shard: int, kv_caches: Any, worker_name: str) -> None:
        self._namespace = namespace
        self._shard = shard
        self._layout = CacheLayout.of(kv_caches)
        self._client = Client(settings.address, timeout=settings.timeout_s, session=True,
                              owner_token=settings.owner_token, worker_name=worker_name)
        try:
            self._layout.ensure_pool(self._client, cache_name, settings.cache_bytes)
            self._att: Optional[Attachment] = self._layout.attach(self._client, cache_name)
        except BaseException:
            self._client.close()
            raise
        self._cache: NodeCache = self._client.node_cache(cache_name)
        self._block_bytes = self._layout.row_bytes * len(self._layout.tensors)
        self._cuda = bool(self._layout.tensors[0].is_cuda)
        self._jobs: List[_Job] = []
        self._finished: List[TransferResult] = []

    @property
    def attachment(self) -> Optional[Attachment]:
        """The attachment of the canonical tensors (None after shutdown)."""
        return self._att

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Async GPU -> node cache: the blocks not present yet are stored."""
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                    expedited: bool = False) -> bool:
        """Async node cache -> GPU (kvhostd runs every transfer at once, so
        an expedited load queues behind nothing here either)."""
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def _submit(self, job_id: int, gpu_spec: Any, chunks: Any, store: bool) -> bool:
        job = _Job(job_id, [], 0, time.monotonic())
        try:
            if self._att is None:
                raise ValueError("the worker was shut down")
            if not isinstance(chunks, KvhostLoadStoreSpec):
                raise ValueError(f"a {type(chunks).__name__}, not a KvhostLoadStoreSpec")
            keys, rows = plan(self._namespace, self._shard, gpu_spec, chunks)
            for start in range(0, len(keys), NodeCache.MAX_KEYS):
                part = slice(start, start + NodeCache.MAX_KEYS)
                event = self._stream_event()
                if event is not None:
                    job.events.append(event)
                if store:
                    r = self._cache.store(self._att, keys[part], rows[part], event=event)
                    written = sum(1 for s in r.states if s == KeyState.ABSENT)
                    job.num_bytes += written * self._block_bytes
                    if r.ticket is not None:
                        job.tickets.append(r.ticket)
                else:
                    job.tickets.append(self._cache.restore(self._att, keys[part], rows[part],
                                                           event=event))
                    job.num_bytes += len(keys[part]) * self._block_bytes
        except (KvhostError, ValueError) as e:
            job.failed = str(e)
            logger.error("kvhost.vllm: %s job %d failed: %s", "store" if store else "load",
                         job_id, e)
        self._jobs.append(job)
        return True

    def _stream_event(self) -> Any:
        """An interprocess CUDA event recorded on the current stream (None on
        the host backend): kvhostd's copies wait for it first."""
        if not self._cuda:
            return None
        event = interprocess_event()
        event.record()  # on the current stream, where the model writes the KV
        return event

    def _done(self, job: _Job, block: bool) -> bool:
        """Whether `job` is finished (failed included); block: wait for it."""
        while job.failed is None and job.tickets:
            try:
                if block:
                    job.tickets[0].wait()
                elif not job.tickets[0].poll(status=False):
                    return False
            except KvhostError as e:
                job.failed = str(e)
                logger.error("kvhost.vllm: job %d failed: %s", job.job_id, e)
                break
            job.tickets.pop(0)
        return True

    def get_finished(self) -> List[TransferResult]:
        """The jobs finished since the last call, each once."""
        still: List[_Job] = []
        for job in self._jobs:
            if not self._done(job, block=False):
                still.append(job)
                continue
            ok = job.failed is None
            self._finished.append(TransferResult(
                job_id=job.job_id, success=ok, transfer_size=job.num_bytes if ok else None,
                transfer_time=time.monotonic() - job.start if ok else None))
        self._jobs = still
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Set[int]) -> None:
        """Blocks until the jobs `job_ids` are finished (get_finished reports them)."""
        for job in self._jobs:
            if job.job_id in job_ids:
                self._done(job, block=True)

    def shutdown(self) -> None:
        """Waits for the jobs in flight, detaches and closes the session."""
        for job in self._jobs:
            self._done(job, block=True)
        self._jobs.clear()
        if self._att is not None:
            try:
                self._att.detach()
            except KvhostError as e:
                logger.warning("kvhost.vllm: detach: %s", e)
            self._att = None
        self._client.close()
