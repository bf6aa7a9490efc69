#!/usr/bin/env python3
"""sglang's own host-pool machinery driving kvhost pools with CUDA device pools.

The GPU twin of python_sglang_engine_test.py and python_sglang_kinds_engine_test.py
(whose helpers it uses): against a fresh kvhostd --backend=cuda, with the kvhost
plugin pip-installed and loaded by sglang's own loader (SGLANG_PLUGINS=kvhost), for
MHA in every layout kvhost has (layer_first, page_first, page_first_direct, page_head,
page_unified) and MLA in its four (no page_head):
  - sglang's own device pool on GPU 0 (MHATokenToKVPool / MLATokenToKVPool, bf16);
  - sglang's build_kv_only_group (build_kv_host_pool, HostPoolGroup) builds the
    plugin's kvhost pool over it, and sglang's HybridCacheController (its
    L2TransferEngine and streams) drives it;
  - backup behind sglang's producer event: a kernel still sleeping on the current
    stream writes the device rows, then controller.write(); with io backend direct
    (layer_first, page_first_direct) the call returns before the sleep ends (no host
    wait; with kernel sglang's own index copies wait), and once sglang's ack_finish is
    synchronized (alone) the host pages hold the rows written after the sleep (they
    do not change later, and load back as written);
  - per-layer loads ordering a kernel that reads layer l: controller.load() +
    start_loading() into zeroed rows, then, as an attention backend does, for each
    layer sglang's device pool's get_key_buffer / get_kv_buffer (which waits on
    sglang's LayerDoneCounter) and a gather of the loaded rows on the current
    stream: every layer's rows byte for byte what was written;
  - a load after work queued before it (MHA page_first): a kernel behind a GPU
    sleep fills the rows the load gets, then start_loading(); sglang's transfer
    stream waits for its start event, so the loaded bytes must be what is left.
Stand-ins (the project's): the device token allocator and sglang's runtime-context
memory settings (python_sglang_kinds_engine_test.DeviceAllocator / Env), and sgl_kernel
where it is not installed (tests/sgl_kernel_standin.py: every kernel in it raises).
Python: one that imports sglang (scripts/gpu_run.sh OUT sglang makes it on the GPU
machine, from scripts/engine_wheels_gpu.sh's wheels), else the engine venv
(tests/engine_env.py). Skips (exit 77) without an NVIDIA GPU (no libcuda.so.1, or
no device); with one, anything not working fails.
  usage: python_sglang_gpu_engine_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR
"""
import ctypes
import importlib.util
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_env  # noqa: E402

SKIP = 77
PS, LAYERS, HEADS, DIM = 64, 8, 8, 128  # MHA: 4 KiB a token and layer (K + V)
LORA, ROPE = 512, 64  # MLA: DeepSeek's row, 1152 bytes
MOVED, DEVICE_TOKENS = 4096, 3 * 4096  # per transfer: 128 MiB of MHA
SLEEP_CYCLES = 200_000_000  # the producer's kernel: ~0.1 s on an H100
LAYOUTS = {"MHA": ("layer_first", "page_first", "page_first_direct", "page_head",
                   "page_unified"),
           "MLA": ("layer_first", "page_first", "page_first_direct", "page_unified")}


def cuda_devices():
    """(devices, why not) from the driver itself, not torch: a GPU whose torch
    cannot use it must fail the test, not skip it."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return 0, f"no NVIDIA driver (libcuda.so.1: {e})"
    rc = cu.cuInit(0)
    if rc == 100:  # CUDA_ERROR_NO_DEVICE
        return 0, "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)"
    count = ctypes.c_int(0)
    if rc == 0:
        rc = cu.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        raise RuntimeError(f"the NVIDIA driver is there but CUDA fails: error {rc}")
    return count.value, "no CUDA device (cuDeviceGetCount: 0)"


def device_pool(env, kind, device):
    """sglang's own device pool on GPU 0."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa
    torch = env.torch
    common = dict(size=DEVICE_TOKENS, page_size=PS, dtype=torch.bfloat16, layer_num=LAYERS,
                  device=device, enable_memory_saver=False)
    if kind == "MHA":
        pool = MHATokenToKVPool(head_num=HEADS, head_dim=DIM, **common)
        return pool, list(pool.k_buffer) + list(pool.v_buffer)
    pool = MLATokenToKVPool(kv_lora_rank=LORA, qk_rope_head_dim=ROPE, **common)
    return pool, list(pool.kv_buffer)


def layer_reads(dev, kind, layer):
    """What an attention backend reads of a layer, through the device pool's
    own accessors (they wait on sglang's LayerDoneCounter first)."""
    if kind == "MHA":
        return list(dev.get_kv_buffer(layer))
    return [dev.get_key_buffer(layer)]


def build(env, kind, layout, allocator_cls, device="cuda", prefix="gpu"):
    """sglang's device pool, the kvhost host pool group sglang builds over it, and
    sglang's controller driving both; and the io backend it uses."""
    torch = env.torch
    os.environ["KVHOST_POOL_PREFIX"] = f"{prefix}-{kind.lower()}-{layout}"
    env.memory.hicache_mem_layout = layout
    dev, tensors = device_pool(env, kind, device)
    with env.asm.get_parallel().override(dcp_enabled=False):  # sglang's own API
        group = env.asm.build_kv_only_group(
            page_size=PS, kv_pool=dev, full_layer_mapping={i: i for i in range(LAYERS)},
            use_mla=kind == "MLA", mtp_draft_device_pools=())
    host = group.anchor_entry.host_pool
    want_cls = env.plugin.MHATokenToKVPoolHost if kind == "MHA" else \
        env.plugin.MLATokenToKVPoolHost
    assert isinstance(host, want_cls) and host.name == env.plugin.pool_name("kv"), host
    # sglang's io backend "direct" (CPU indices) exists for these two layouts only;
    # "kernel" copies the indices to the GPU and back, synchronizing the streams.
    io = "direct" if layout in ("layer_first", "page_first_direct") else "kernel"
    ctl = env.controller_cls(allocator_cls(torch, dev), group, PS, None, threading.Event(),
                             io_backend=io, transfer_layer_id_max=LAYERS)
    assert dev.layer_transfer_counter is ctl.layer_done_counter, "counter not registered"
    return dev, tensors, group, ctl, io


def check(env, kind, layout, allocator_cls):
    torch = env.torch
    dev, tensors, group, ctl, io = build(env, kind, layout, allocator_cls)
    host = group.anchor_entry.host_pool
    gen = torch.Generator().manual_seed(len(kind) * 31 + len(layout))
    src = (torch.randperm(DEVICE_TOKENS - MOVED - 2 * PS, generator=gen)[:MOVED] +
           MOVED + 2 * PS).to(torch.int64)  # past the rows the allocator hands out
    src_dev = src.cuda()
    want = [torch.randn((MOVED, *t.shape[1:]), generator=gen).to(t.dtype).cuda()
            for t in tensors]
    # A first write makes the pool's attachment (the device buffers opened by the
    # daemon, the host pool pinned), which may take longer than the sleep below.
    warm = ctl.write(src[:PS])
    ctl.ack_write_queue[-1].finish_event.synchronize()
    assert ctl.evict_host(warm) == PS
    torch.cuda.synchronize()
    # Backup behind sglang's producer event: the rows are written after a sleep
    # on the current stream; write() records the producer event there.
    torch.cuda._sleep(SLEEP_CYCLES)
    for t, w in zip(tensors, want):
        t.index_copy_(0, src_dev, w)
    slots = ctl.write(src)
    ack = ctl.ack_write_queue[-1].finish_event
    assert slots is not None and len(slots) == MOVED, slots
    if io == "direct":  # "kernel": sglang's own index copies wait for the stream
        assert not ack.query(), "write() waited on the host (the producer's sleep was over)"
    ack.synchronize()  # sglang's ack_finish alone
    pages = [int(s) for s in slots[::PS]]
    at_ack = [host.get_data_page(p, flat=True).clone() for p in pages]
    torch.cuda.synchronize()
    time.sleep(0.05)
    later = [host.get_data_page(p, flat=True) for p in pages]
    bad = [i for i, (a, b) in enumerate(zip(at_ack, later)) if not torch.equal(a, b)]
    assert not bad, f"host pages {bad[:8]} changed after sglang's ack_finish had fired"
    # Per-layer loads ordering the kernels that read each layer.
    for t in tensors:
        t.zero_()
    torch.cuda.synchronize()  # kvhost's loads do not wait for the stream (report)
    dst = ctl.load(slots)
    producer = ctl.start_loading()
    assert dst is not None and producer >= 0, (dst, producer)
    ctl.layer_done_counter.set_consumer(producer)
    dst_dev = dst.cuda()
    seen = [[b.index_select(0, dst_dev) for b in layer_reads(dev, kind, layer)]
            for layer in range(LAYERS)]
    torch.cuda.synchronize()
    comps = len(tensors) // LAYERS
    bad = [(c, layer) for layer in range(LAYERS) for c in range(comps)
           if not torch.equal(seen[layer][c].view(torch.int16),
                              want[c * LAYERS + layer].view(torch.int16))]
    assert not bad, f"(component, layer) {bad[:8]}: the kernel after sglang's wait for " \
                    f"the layer read other bytes than were backed up"
    assert ctl.evict_host(slots) == MOVED
    release(env, group)
    print(f"ok   {kind} {layout} (io {io}): backup behind sglang's producer event"
          f"{' with no host wait' if io == 'direct' else ''}, per-layer loads ordering the "
          f"reads, {MOVED} tokens x {LAYERS} layers byte-exact")


def check_load_fence(env, allocator_cls):
    """A load after work queued before it: sglang's start_loading records its
    producer event on the current stream and its transfer stream waits for it, so
    the load's copies follow what the stream still does to the destination rows
    (a forward writing reclaimed rows, under overlap scheduling). Here a kernel
    behind a GPU sleep fills the rows the allocator hands the load next; the
    loaded bytes must be what is left."""
    torch = env.torch
    dev, tensors, group, ctl, io = build(env, "MHA", "page_first", allocator_cls,
                                         prefix="gpu-fence")
    src = torch.arange(DEVICE_TOKENS - MOVED, DEVICE_TOKENS, dtype=torch.int64)
    gen = torch.Generator().manual_seed(5)
    want = [torch.randn((MOVED, *t.shape[1:]), generator=gen).to(t.dtype).cuda()
            for t in tensors]
    for t, w in zip(tensors, want):
        t[DEVICE_TOKENS - MOVED:DEVICE_TOKENS] = w
    torch.cuda.synchronize()
    slots = ctl.write(src)
    ctl.ack_write_queue[-1].finish_event.synchronize()
    rows = slice(16, 16 + MOVED)  # what DeviceAllocator hands out first
    torch.cuda._sleep(SLEEP_CYCLES)
    for t in tensors:
        t[rows] = 1.0
    dst = ctl.load(slots)
    ctl.start_loading()
    torch.cuda.synchronize()
    assert int(dst[0]) == 16 and len(dst) == MOVED, dst
    bad = [i for i, (t, w) in enumerate(zip(tensors, want)) if not torch.equal(
        t[rows].view(torch.int16), w.view(torch.int16))]
    assert not bad, f"device buffers {bad[:8]}: the load landed before the work queued " \
                    f"ahead of start_loading (it overwrote the loaded rows)"
    assert ctl.evict_host(slots) == MOVED
    release(env, group)
    print("ok   load after sglang's start event: the kernel queued before start_loading "
          "did not overwrite the loaded rows")


def release(env, group):
    name = group.anchor_entry.host_pool.name
    group.destroy()
    try:  # frees its pinned memory for the next case; not what is tested
        with env.kvhost.Client(env.daemon.address, session=False) as c:
            c.delete_pool(name)
    except env.kvhost.KvhostError as e:
        print(f"note: pool {name} not deleted: {e}")


def main():
    kvhostd, lib, source_dir = sys.argv[1:4]
    if importlib.util.find_spec("sglang") is None:
        engine_env.enter(source_dir)  # CI's machine: the engine venv
    devices, why = cuda_devices()
    if not devices:
        print(f"SKIP: {why}")
        return SKIP
    os.environ["KVHOST_LIBRARY"] = lib
    os.environ["SGLANG_PLUGINS"] = "kvhost"
    import sgl_kernel_standin  # noqa: PLC0415
    if sgl_kernel_standin.install():
        print("note: sgl_kernel is not installed: its stand-in raises if any kernel is called")
    from python_sglang_engine_test import install_plugin  # noqa: PLC0415
    scratch = install_plugin(source_dir)
    import torch  # noqa: PLC0415
    assert torch.cuda.is_available(), f"a GPU is there but torch {torch.__version__} " \
                                      f"cannot use it"
    import kvhost  # noqa: PLC0415
    assert kvhost.__file__.startswith(sys.path[0]), kvhost.__file__  # the installed copy
    assert kvhost.built_with_cuda(), f"{lib} was built without CUDA"
    from kvhost_testing import Daemon  # noqa: PLC0415
    from python_sglang_kinds_engine_test import DeviceAllocator, Env  # noqa: PLC0415
    from sglang.srt import plugins  # noqa: PLC0415
    import sglang  # noqa: PLC0415
    print(f"sglang {sglang.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}")
    daemon = Daemon(os.environ.get("KVHOST_KVHOSTD") or kvhostd, backend="cuda")
    failed = 0
    try:
        os.environ["KVHOST_ADDRESS"] = daemon.address
        os.environ["KVHOST_OWNER_TOKEN"] = "sglang-gpu-engine-test"
        plugins.load_plugins()  # sglang's loader: entry point group sglang.srt.plugins
        env = Env(daemon)
        cases = [(f"{kind} {layout}", check, (env, kind, layout, DeviceAllocator))
                 for kind, layouts in LAYOUTS.items() for layout in layouts]
        cases.append(("load after sglang's start event", check_load_fence,
                      (env, DeviceAllocator)))
        for what, fn, args in cases:
            try:
                fn(*args)
            except Exception as e:  # every case reports
                failed += 1
                print(f"FAIL {what}: {type(e).__name__}: {e}")
        env.worker.close()
    finally:
        daemon.stop()
        if failed:
            print("--- kvhostd log ---\n" + daemon.log()[-20000:])
        shutil.rmtree(scratch, ignore_errors=True)
    if failed:
        print(f"FAIL: {failed} case(s)")
        return 1
    print("PASS: sglang's HostPoolGroup / HybridCacheController / L2TransferEngine over "
          "kvhost pools and sglang's CUDA device pools, MHA and MLA in every layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
