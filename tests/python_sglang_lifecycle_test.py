#!/usr/bin/env python3
"""kvhost.sglang's pool lifecycle against a real kvhostd: one scheduler owns
a pool at a time (PoolService.ClaimPool).

An sglang-like scheduler process builds MHATokenToKVPoolHost, allocates,
and is killed with SIGKILL: a new scheduler constructing the same pool gets
every slot back in its one claim, and the dead one's slots are counted as
reclaimed; a second live scheduler on the pool is refused with a message
naming the holder; after kvhostd restarts (and a pool of the same name and
shape exists again, empty) the live scheduler's next alloc,
available_size, free and clear raise SessionLost naming the pool, never
answering from the fresh, empty pool.
Run by tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

# Before kvhost.sglang is imported (its base class is chosen then), and for the
# scheduler processes too: no sglang base class, no instance id from outside,
# and one owner token (schedulers share a pool only under one:
# kvhost.pools.adopt_pool), which every client here takes.
os.environ["KVHOST_SGLANG_BASE"] = "0"
os.environ.pop("KVHOST_INSTANCE_ID", None)
os.environ["KVHOST_OWNER_TOKEN"] = "lifecycle-test-token"

import kvhost  # noqa: E402
import kvhost.errors  # noqa: E402, F401
import kvhost.sglang as sglang  # noqa: E402

pytestmark = pytest.mark.kvhostd_flags("--session-timeout=500ms")

POOL, PS, LAYERS, HEADS, DIM, SIZE = "sched", 4, 3, 2, 8, 64
SPEC = {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16", "page_size": PS,
        "layer_num": LAYERS, "head_num": HEADS, "head_dim": DIM, "size_tokens": SIZE}

# The scheduler: builds the host pool, allocates `n` slots, says so, waits.
SCHEDULER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from kvhost.sglang import MHATokenToKVPoolHost
pool = MHATokenToKVPoolHost({pool!r}, address=sys.argv[2], layout="page_first", page_size={ps},
                            layer_num={layers}, head_num={heads}, head_dim={dim},
                            host_size_tokens={size}, tensors=False)
slots = pool.alloc(int(sys.argv[3]))
print("ready", pool.generation, len(slots), flush=True)
time.sleep(600)
"""


def make(daemon, **kw):
    return sglang.MHATokenToKVPoolHost(POOL, address=daemon.address, layout="page_first",
                                       page_size=PS, layer_num=LAYERS, head_num=HEADS,
                                       head_dim=DIM, host_size_tokens=SIZE, tensors=False, **kw)


def observer(daemon):
    return kvhost.Client(daemon.address, session=False, timeout=10, wait_ready=20)


def start_scheduler(daemon, src, n):
    proc = subprocess.Popen(
        [sys.executable, "-c", SCHEDULER.format(pool=POOL, ps=PS, layers=LAYERS, heads=HEADS,
                                                dim=DIM, size=SIZE),
         os.path.join(src, "python"), daemon.address, str(n)],
        stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if line[:1] != ["ready"]:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"the scheduler did not start: {line}")
    return proc, int(line[1]), int(line[2])


def available(daemon):
    with observer(daemon) as c:
        return c.get_pool(POOL)["available_tokens"]


def holder(daemon):
    with observer(daemon) as c:
        return c.get_pool(POOL).get("holder", {})


def wait_released(daemon):
    deadline = time.monotonic() + 10
    while holder(daemon).get("live"):
        assert time.monotonic() < deadline, "the killed scheduler's session did not end"
        time.sleep(0.02)


def raises(cls, fn, *args, naming=()):
    try:
        fn(*args)
    except cls as e:
        for text in naming:
            assert text in str(e), f"{str(e)!r} does not name {text!r}"
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {cls.__name__}")


def test_lifecycle(daemon, source_dir):
    src = source_dir
    # A scheduler takes the pool and half its slots, then is killed.
    proc, generation, taken = start_scheduler(daemon, src, SIZE // 2)
    try:
        assert (generation, taken) == (1, SIZE // 2), (generation, taken)
        assert available(daemon) == SIZE - taken
        assert holder(daemon) == {"instance_id": f"sglang:{POOL}", "generation": 1,
                                  "live": True}, holder(daemon)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    wait_released(daemon)
    # Released, not freed: the dead scheduler's radix tree was the only index.
    assert available(daemon) == SIZE - taken

    # Its restart gets the whole pool back in its one claim.
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("kvhost.sglang").addHandler(handler)
    logging.getLogger("kvhost.sglang").setLevel(logging.INFO)
    pool = make(daemon)
    try:
        assert pool.generation == 2, pool.generation
        assert pool.available_size() == SIZE, pool.available_size()
        said = [r.getMessage() for r in records]
        assert any(f"{taken} slots of the previous scheduler reclaimed" in m for m in said), said
        assert len(pool.alloc(SIZE)) == SIZE
        pool.clear()

        # A second live scheduler on the pool is refused, naming the holder.
        e = raises(kvhost.errors.FailedPrecondition, make, daemon,
                   naming=(f"pool '{POOL}'", f"'sglang:{POOL}' (generation 2)", "second owner"))
        assert "session" in str(e), e
        assert pool.available_size() == SIZE  # the refusal changed nothing

        slots = pool.alloc(8)
        assert len(slots) == 8
        # kvhostd restarts, and the pool is there again, empty (declared in
        # its config, or made again by someone): the live scheduler's calls
        # must not answer from it.
        daemon.restart()
        with observer(daemon) as c:
            c.create_pool(POOL, SPEC)
        for call, args in ((pool.alloc, (4,)), (pool.available_size, ()), (pool.free, (slots,)),
                           (pool.clear, ())):
            raises(sglang.SessionLost, call, *args,
                   naming=(f"pool '{POOL}'", "session was lost"))
        assert available(daemon) == SIZE  # nothing was allocated in the new daemon
    finally:
        pool.close()
        logging.getLogger("kvhost.sglang").removeHandler(handler)


def test_sessionless_client_claims_nothing(daemon):
    # A client made with session=False (the plugin's today): no claim, as before.
    with observer(daemon) as c:
        pool = make(daemon, client=c)
        try:
            assert pool.generation == 0
            assert "holder" not in c.get_pool(POOL)
            assert len(pool.alloc(4)) == 4
        finally:
            pool.close()
    with make(daemon) as owner:
        assert owner.generation == 1
        assert owner.available_size() == SIZE  # the sessionless object's slots reclaimed
