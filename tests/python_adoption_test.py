#!/usr/bin/env python3
"""Another local user against the Python package, on a real kvhostd.

Two attacks of issue 29 that need no daemon bug: a name squatted before the
scheduler starts, and a name with a NUL in it.

- A pool (or group) that exists already is adopted by kvhost.sglang's pools
  only when it is protected by the client's own owner token
  (kvhost.pools.adopt_pool / adopt_group): a pool created first by another
  client, with no token or another one, is refused with PermissionDenied
  naming the pool and the risk, and left as it was; a client's own
  protected pool (another rank's, the same token) is adopted, a LOGICAL one
  included.
- A name with a NUL would be cut by the C ABI ("p\\x00q" acting on pool
  "p"): every call refuses it with InvalidArgument naming it, before
  anything is sent, and pool "p" stays exactly as it was.

No GPU, numpy or torch needed.
Run by tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""
import os

import kvhost
import kvhost.pools as pools
import kvhost.sglang as sglang
import pytest
from kvhost_testing import SPEC


PS, LAYERS, HEADS, DIM, SIZE = 4, 3, 2, 8, 64
TOKEN, OTHER = "victim-token", "attacker-token"



@pytest.fixture(autouse=True)
def no_owner_token(monkeypatch):
    """A client made without a token takes $KVHOST_OWNER_TOKEN: none here."""
    monkeypatch.delenv("KVHOST_OWNER_TOKEN", raising=False)

def client(daemon, token=None):
    return kvhost.Client(daemon.address, session=False, timeout=10, wait_ready=20,
                         owner_token=token)


def raises(cls, fn, *args, naming=(), **kw):
    try:
        fn(*args, **kw)
    except cls as e:
        for part in naming:
            assert part in str(e), f"{str(e)!r} does not name {part!r}"
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {cls.__name__}")


def mha(c, name, **kw):
    kw.setdefault("host_size_tokens", SIZE)
    return sglang.MHATokenToKVPoolHost(name, client=c, layout="page_first", dtype="bfloat16",
                                       page_size=PS, layer_num=LAYERS, head_num=HEADS,
                                       head_dim=DIM, tensors=False, **kw)


def test_a_squatted_pool_is_refused(daemon):
    with client(daemon) as attacker, client(daemon, OTHER) as other, \
            client(daemon, TOKEN) as victim, client(daemon) as tokenless:
        # No token: anyone could read and write it.
        mha(attacker, "kv")  # the scheduler's own call, made first
        marked = attacker.alloc("kv", PS, numpy=False)
        before = attacker.get_pool("kv")
        for c in (victim, tokenless):
            e = raises(kvhost.PermissionDenied, mha, c, "kv",
                       naming=("pool 'kv' already exists", "not protected by an owner token",
                               "refusing to adopt it", "KVHOST_OWNER_TOKEN"))
            assert e.code_name == "PERMISSION_DENIED", e.code_name
        after = attacker.get_pool("kv")
        assert after["available_tokens"] == before["available_tokens"] == SIZE - PS, after
        attacker.free("kv", marked)
        # Another user's token: its holder could delete it and put an open one there.
        mha(other, "kv2")
        raises(kvhost.PermissionDenied, mha, victim, "kv2",
               naming=("pool 'kv2' already exists",
                       "not protected by this client's owner token"))
        raises(kvhost.PermissionDenied, pools.adopt_pool, victim, "kv2", naming=("'kv2'",))
        # A squatted LOGICAL pool (no region files): the token-gated proof.
        sglang.LogicalHostPool("full", SIZE, PS, client=attacker, tensors=False)
        sglang.LogicalHostPool("full2", SIZE, PS, client=other, tensors=False)
        raises(kvhost.PermissionDenied, sglang.LogicalHostPool, "full", SIZE, PS, client=victim,
               tensors=False, naming=("pool 'full' already exists", "not protected"))
        raises(kvhost.PermissionDenied, sglang.LogicalHostPool, "full2", SIZE, PS,
               client=victim, tensors=False,
               naming=("pool 'full2'", "not protected by this client's owner token"))
        assert sorted(p["name"] for p in victim.list_pools()) == ["full", "full2", "kv", "kv2"]


def test_a_squatted_group_is_refused(daemon):
    with client(daemon) as attacker, client(daemon, TOKEN) as victim:
        attacker.create_pool("attn", SPEC)
        attacker.create_group("g", {"layer_num": 3, "entries": [
            {"name": "kv", "pool": "attn", "anchor": True}]})
        raises(kvhost.PermissionDenied, pools.adopt_group, victim, "g",
               naming=("group 'g' already exists", "entry 'kv' (pool 'attn')",
                       "refusing to adopt it"))


def test_own_protected_pools_are_adopted(daemon):
    with client(daemon, TOKEN) as first, client(daemon, TOKEN) as second:
        a = mha(first, "kv")
        b = mha(second, "kv", host_size_tokens=8)  # sizes are the creator's
        assert a.size == b.size == SIZE and b.info["owner_protected"], b.info
        slots = a.alloc(8)
        assert b.available_size() == SIZE - 8
        assert a.free(slots) == 8
        la = sglang.LogicalHostPool("full", SIZE, PS, client=first, tensors=False)
        lb = sglang.LogicalHostPool("full", SIZE, PS, client=second, tensors=False)
        assert la.size == lb.size == SIZE
        # A group of the client's own pools is adopted too.
        spec = {"layer_num": 3, "entries": [{"name": "kv", "pool": "kv", "anchor": True}]}
        first.create_group("g", spec)
        assert pools.adopt_group(second, "g")["entries"][0]["pool"] == "kv"
        # Its own client reads the token from KVHOST_OWNER_TOKEN.
        os.environ["KVHOST_OWNER_TOKEN"] = TOKEN
        try:
            own = sglang.MHATokenToKVPoolHost(
                "kv", address=daemon.address, layout="page_first", page_size=PS,
                layer_num=LAYERS, head_num=HEADS, head_dim=DIM, host_size_tokens=SIZE,
                tensors=False)
        finally:
            del os.environ["KVHOST_OWNER_TOKEN"]
        assert own.size == SIZE
        own.close()


def test_names_with_nul_are_refused(daemon):
    bad = "p\x00q"
    with client(daemon, TOKEN) as c:
        c.create_pool("p", SPEC)
        held = c.alloc("p", 8, numpy=False)
        page = c.get_data_page("p", held[0])
        c.set_from_flat_data_page("p", held[0], bytes(range(256)) * (len(page) // 256))
        before = (c.get_pool("p"), c.get_data_page("p", held[0]))
        naming = (repr(bad), "NUL")
        calls = [
            (c.create_pool, bad, SPEC), (c.get_pool, bad), (c.delete_pool, bad),
            (c.available_size, bad), (c.alloc, bad, 4), (c.alloc_batch, bad, [4]),
            (c.free, bad, held), (c.get_page_buffer_meta, bad, held[:PS]),
            (c.get_data_page, bad, held[0]),
            (c.set_from_flat_data_page, bad, held[0], bytes(len(page))),
            (c.read_pages, bad, held[:1]), (c.write_pages, bad, held[:1], [bytes(len(page))]),
            (c.create_group, bad, {"layer_num": 3, "entries": [{"name": "kv", "pool": "p"}]}),
            (c.get_group, bad), (c.delete_group, bad), (c.shm_device_pool, bad, 16),
            (mha, c, bad),
        ]
        for call, *args in calls:
            raises(kvhost.InvalidArgument, call, *args, naming=naming)
        raises(kvhost.InvalidArgument, c.create_pool, "q", '{"kind":"MHA"}\x00{}',
               naming=("spec",))
        dev = c.shm_device_pool("p", 16)
        raises(kvhost.InvalidArgument, c.attach_shm, bad, dev, naming=naming)
        dev.close()
        with c.async_calls() as calls_async:
            raises(kvhost.InvalidArgument, calls_async.alloc, bad, 4, naming=naming)
        raises(kvhost.InvalidArgument, client, daemon, "tok\x00en", naming=("owner_token",))
        after = (c.get_pool("p"), c.get_data_page("p", held[0]))
        assert after == before, "a refused call changed pool 'p'"
        assert [p["name"] for p in c.list_pools()] == ["p"], c.list_pools()
        assert c.free("p", held) == 8
