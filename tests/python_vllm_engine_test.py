#!/usr/bin/env python3
"""vLLM 0.33.0's own engine core driving kvhost.vllm (host-backend kvhostd):
two vLLM engines, each vLLM's Scheduler (vllm/v1/core/sched/scheduler.py) with
vLLM's OffloadingConnector in the scheduler role (its OffloadingConnectorScheduler
calls the spec's manager) and an OffloadingConnector in the worker role
(register_kv_caches derives the canonical tensors; its OffloadingConnectorWorker
calls the spec's worker), both built by vLLM from

  {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
   "kv_connector_extra_config": {"spec_name": "KvhostOffloadingSpec",
                                 "spec_module_path": "kvhost.vllm", ...}}

Engine a serves a prompt of five full blocks and a tail: vLLM's scheduler
offloads its blocks into the node cache. Engine b, with an empty GPU prefix
cache, serves the same prompt: vLLM's scheduler finds the five blocks in the
cache (get_num_new_matched_tokens), loads them into b's blocks, and computes
only the tail; b's blocks hold a's bytes. Then a restarted engine (new
connectors, new kvhost sessions) finds them too; and with
blocks_per_chunk 2 (extra_config "block_size": 32) the same holds chunk by
chunk.

Stand-ins, for what needs a GPU or a model: the model's forward pass (the
test writes each block's KV itself, and its sampled token is a constant), the
GPU KV tensors (CPU tensors over a kvhost ShmDevicePool, the host backend's
device memory, handed to register_kv_caches), and the model's Hugging Face
config (facebook/opt-125m's config.json, written to a scratch directory:
vLLM's ModelConfig reads it offline). The step loop is what vLLM's
EngineCore does around the model runner (schedule, the worker connector's
bind / start_load_kv / wait_for_save / get_finished, update_from_output), as
vLLM's own tests/v1/kv_connector/unit/offloading_connector/utils.py does.

  usage: python_vllm_engine_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR [PYTEST_ARGS...]
  (ctest runs it so; it re-executes itself under the engine venv)
"""
import json
import os
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
if __name__ == "__main__" and len(sys.argv) >= 4:  # ctest: into the engine venv first
    import engine_env
    engine_env.enter_with(os.path.abspath(sys.argv[3]), "vllm")

import pytest  # noqa: E402

pytest.importorskip("vllm.v1.kv_offload.base", reason="vllm is not installed in this venv "
                    "(scripts/engine_venv.sh builds the engine venv, which pins vllm==0.33.0)")
os.environ["HF_HUB_OFFLINE"] = "1"  # the model's config is a local file
import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig, set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector)
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,  # noqa: E402
                                         resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import kvhost  # noqa: E402
import kvhost.vllm as kv  # noqa: E402

TOKEN = "vllm-engine-test"
BS, HEADS, DIM, BLOCKS, LAYERS = 16, 2, 8, 32, 2
FULL_BLOCKS = 5
PROMPT = list(range(100, 100 + FULL_BLOCKS * BS + 3))  # five full blocks and a tail
#: facebook/opt-125m's config.json (what vLLM's own connector tests load from the hub).
OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "do_layer_norm_before": True,
    "ffn_dim": 3072, "hidden_size": 768, "word_embed_proj_dim": 768,
    "max_position_embeddings": 2048, "num_attention_heads": 12, "num_hidden_layers": 12,
    "vocab_size": 50272, "torch_dtype": "float16", "dropout": 0.1, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "init_std": 0.02, "layerdrop": 0.0, "use_cache": True}


class Engine:
    """A vLLM engine core without a model: vLLM's Scheduler and the worker's
    OffloadingConnector over CPU KV tensors in a ShmDevicePool."""

    def __init__(self, daemon, model_dir, extra=None):
        settings = {"spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm",
                    "kvhost_address": daemon.address, "kvhost_owner_token": TOKEN,
                    **(extra or {})}
        cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9,
                            enable_prefix_caching=True)
        cache.kv_cache_layout = "LBHNC"  # what OffloadingConnector asks for
        self.config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                     dtype="float16", seed=42),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1000,
                                             max_model_len=2048, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            cache_config=cache, device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                                kv_role="kv_both",
                                                kv_connector_extra_config=settings))
        layer = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM,
                                  dtype=torch.float16)
        page = layer.page_size_bytes
        names = [f"layer{i}" for i in range(LAYERS)]
        kv_cache_config = KVCacheConfig(
            num_blocks=BLOCKS, kv_cache_groups=[KVCacheGroupSpec(names, layer)],
            kv_cache_tensors=[KVCacheTensor(size=page * LAYERS * BLOCKS, layers=names,
                                            layer_stride=page * BLOCKS,
                                            block_stride=page * LAYERS)])
        self.config.cache_config.num_gpu_blocks = BLOCKS
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, self.config)
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_cache_config,
                                   log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=block_size, hash_block_size=hash_block_size)
        self.worker = OffloadingConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        spec = self.worker.connector_worker.spec
        assert isinstance(spec, kv.KvhostOffloadingSpec), type(spec)
        assert isinstance(self.scheduler.connector.connector_scheduler.manager,
                          kv.KvhostOffloadingManager)
        # The host backend's device memory, in the cache pool's shape.
        self.device_client = kvhost.Client(daemon.address, session=False, owner_token=TOKEN)
        kv.CacheLayout([None] * LAYERS, page, BLOCKS).ensure_pool(
            self.device_client, spec.cache_name, spec.settings.cache_bytes)
        self.shm = self.device_client.shm_device_pool(spec.cache_name, BLOCKS, daemon.shm)
        kv.register_shm_device_pool(self.shm)
        self.kv_caches = {
            name: torch.frombuffer(self.shm.layer_view("latent", i), dtype=torch.float16)
            .view(BLOCKS, 2, BS, HEADS, DIM) for i, name in enumerate(names)}
        with set_current_vllm_config(self.config):
            self.worker.register_kv_caches(self.kv_caches)
        assert isinstance(self.worker.connector_worker.worker, kv.KvhostOffloadingWorker)
        self.cache = self.device_client.node_cache(spec.cache_name)

    def serve(self, req_id, write_kv):
        """Runs one request to its end (two tokens); returns its block ids
        (as first allocated) and the tokens vLLM scheduled for it (computed by
        the model, not taken from the cache)."""
        init_none_hash(sha256)
        params = SamplingParams(max_tokens=2)
        params.update_from_generation_config({}, 2)
        req = Request(request_id=req_id, prompt_token_ids=PROMPT, sampling_params=params,
                      pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))
        self.scheduler.add_request(req)
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        block_ids, scheduled = None, 0
        connector = self.scheduler.connector.connector_scheduler
        deadline = time.monotonic() + 60
        while self.scheduler.requests or connector._jobs or self.scheduler.finished_req_ids:
            assert time.monotonic() < deadline, "the request did not finish"
            out = self.scheduler.schedule()
            scheduled += out.num_scheduled_tokens.get(req_id, 0)
            if block_ids is None and req_id in self.scheduler.requests and \
                    req.num_computed_tokens + out.num_scheduled_tokens.get(req_id, 0) > 0:
                block_ids = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
                if write_kv:  # the model's forward pass writes the prompt's KV
                    for i, block in enumerate(block_ids):
                        for layer, t in enumerate(self.kv_caches.values()):
                            t[block] = pattern(i, layer)
            metadata = out.kv_connector_metadata
            self.worker.handle_preemptions(metadata)
            self.worker.bind_connector_metadata(metadata)
            self.worker.start_load_kv(ctx)
            self.worker.wait_for_save()
            sending, recving = self.worker.get_finished(out.finished_req_ids)
            meta = self.worker.build_connector_worker_meta() or OffloadingWorkerMetadata()
            self.worker.clear_connector_metadata()
            running = self.scheduler.running
            self.scheduler.update_from_output(out, ModelRunnerOutput(
                req_ids=[r.request_id for r in running],
                req_id_to_index={r.request_id: i for i, r in enumerate(running)},
                sampled_token_ids=[[7] for _ in running], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=sending, finished_recving=recving,
                    invalid_block_ids=set(), kv_connector_worker_meta=meta)))
            time.sleep(0.001)
        return block_ids, scheduled

    def block(self, block_id):
        return [t[block_id].clone() for t in self.kv_caches.values()]

    def close(self):
        self.worker.shutdown()
        self.scheduler.connector.shutdown()
        self.shm.close()
        self.device_client.close()


def pattern(i, layer):
    """Block i's KV of the prompt in `layer`: what a forward pass would write."""
    n = 2 * BS * HEADS * DIM
    return (torch.arange(n, dtype=torch.float32).remainder(97) + i * 1000 + layer * 100) \
        .to(torch.float16).view(2, BS, HEADS, DIM)


@pytest.fixture
def model_dir(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(OPT_CONFIG, f)
    return str(tmp_path)


@pytest.fixture
def engines(daemon, model_dir):
    made = []

    def make(extra=None):
        made.append(Engine(daemon, model_dir, extra))
        return made[-1]
    yield make
    for e in made:
        e.close()


def check_shared(a, a_blocks, b, b_blocks, num_blocks):
    for i in range(num_blocks):
        assert all(torch.equal(x, y) for x, y in zip(a.block(a_blocks[i]), b.block(b_blocks[i]))), \
            f"prompt block {i}: b's block {b_blocks[i]} != a's block {a_blocks[i]}"
        assert torch.equal(b.block(b_blocks[i])[0], pattern(i, 0)), i


def test_a_second_engine_loads_the_first_ones_prefix(engines):
    a = engines()
    a_blocks, a_computed = a.serve("a1", write_kv=True)
    assert a_computed == len(PROMPT) + 1, a_computed  # the prompt, then one decode step
    stats = a.cache.stats()
    assert stats.published == FULL_BLOCKS, stats  # vLLM offloaded the five full blocks
    b = engines()
    for t in b.kv_caches.values():
        t.zero_()
    b_blocks, b_computed = b.serve("b1", write_kv=False)
    assert b_computed == a_computed - FULL_BLOCKS * BS, b_computed  # five blocks loaded
    check_shared(a, a_blocks, b, b_blocks, FULL_BLOCKS)
    # A restarted engine (new connectors and kvhost sessions) finds them too.
    a.close()
    engines_made = engines()
    c_blocks, c_computed = engines_made.serve("c1", write_kv=False)
    assert c_computed == a_computed - FULL_BLOCKS * BS, c_computed
    assert all(torch.equal(engines_made.block(c_blocks[i])[0], pattern(i, 0))
               for i in range(FULL_BLOCKS))


def test_chunks_of_two_blocks(engines):
    a = engines({"block_size": 2 * BS})  # blocks_per_chunk 2
    a_blocks, a_computed = a.serve("a1", write_kv=True)
    assert a.cache.stats().published == 4  # two full chunks of two blocks
    b = engines({"block_size": 2 * BS})
    b_blocks, b_computed = b.serve("b1", write_kv=False)
    assert b_computed == a_computed - 4 * BS, b_computed
    check_shared(a, a_blocks, b, b_blocks, 4)


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    kvhostd, lib, src = (os.path.abspath(a) for a in sys.argv[1:4])
    os.environ.update(KVHOST_TEST_KVHOSTD=kvhostd, KVHOST_LIBRARY=lib,
                      KVHOST_TEST_SOURCE_DIR=src)
    rc = pytest.main([os.path.abspath(__file__), "-p", "no:cacheprovider", "-rs", "-v",
                      *sys.argv[4:]])
    return 1 if rc == 5 else int(rc)


if __name__ == "__main__":
    sys.exit(main())
