#!/usr/bin/env python3
"""The L3 tier from Python (kvhost.Client.l3_* over kvhost_l3_*) against a
kvhostd started with --l3-memcached on a local memcached server.

l3_store / l3_exist / l3_fetch move pages byte-exact between two pools by
key (str or bytes keys), a key never stored is a MISS outcome, not an
exception; the detached calls return a ticket that l3_wait returns (waiting or
polling, again when asked again); refusals (key / index counts, an index twice, an
unknown pool, a wrong owner token, a ticket of another pool) raise the
daemon's code and store or write nothing; a kvhostd without the tier says
which flag it lacks. Skipped without a memcached binary. Run by
tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

import kvhost
import kvhost_testing as pkg  # its client and raises

SPEC = {"kind": "MHA", "layout": "LAYER_FIRST", "dtype": "BF16", "page_size": 4,
        "layer_num": 3, "head_num": 2, "head_dim": 8, "size_tokens": 64}
PAGE_BYTES = 3 * 4 * 2 * 2 * 8 * 2  # layers x tokens x K,V x heads x dim x bf16


def raises(cls, fn, *args, naming=None, **kw):
    return pkg.raises(cls, fn, *args, naming=naming, **kw)


def fill(c, pool, slots, seed):
    pages = []
    for i, s in enumerate(slots):
        data = bytes((seed * 31 + i * 7 + b) % 251 + 1 for b in range(PAGE_BYTES))
        c.set_from_flat_data_page(pool, s, data)
        pages.append(data)
    return pages


def firsts(c, pool, pages):
    slots = c.alloc(pool, pages * 4, numpy=False)
    return slots[::4]


def test_store_exist_fetch(daemon, run):
    with pkg.client(daemon) as c:
        c.create_pool("a", SPEC)
        c.create_pool("b", SPEC)
        src = firsts(c, "a", 3)
        data = fill(c, "a", src, 1)
        keys = [f"{run}/k{i}" for i in range(2)] + [f"{run}/k2".encode()]
        stored = c.l3_store("a", src, keys)
        assert stored.good_pages == 3, stored
        assert stored.outcomes == [kvhost.PageOutcome.STORED] * 3, stored
        assert c.l3_exist("b", keys) == 3
        assert c.l3_exist("b", [keys[0], f"{run}/never", keys[2]]) == 1
        dst = firsts(c, "b", 4)
        before = c.get_data_page("b", dst[3])
        got = c.l3_fetch("b", list(reversed(keys)) + [f"{run}/never"], dst)
        assert got.good_pages == 3, got
        assert got.outcomes == [kvhost.PageOutcome.HIT] * 3 + [kvhost.PageOutcome.MISS], got
        for i in range(3):
            assert c.get_data_page("b", dst[i]) == data[2 - i], i
        assert c.get_data_page("b", dst[3]) == before


def test_detached(daemon, run):
    with pkg.client(daemon) as c:
        c.create_pool("a", SPEC)
        c.create_pool("q", SPEC)
        src = firsts(c, "a", 2)
        data = fill(c, "a", src, 2)
        keys = [f"{run}/d{i}" for i in range(2)]
        ticket = c.l3_start_store("a", src, keys)
        assert ticket > 0
        raises(kvhost.NotFound, c.l3_wait, "q", ticket, naming=str(ticket))
        result = c.l3_wait("a", ticket)
        assert result.good_pages == 2 and result.outcomes == [kvhost.PageOutcome.STORED] * 2
        assert c.l3_wait("a", ticket) == result, "a second wait gives the same results"
        dst = firsts(c, "a", 2)
        ticket = c.l3_start_fetch("a", keys, dst)
        deadline = time.monotonic() + 20
        while True:
            result = c.l3_wait("a", ticket, poll=True)
            if result is not None:
                break
            assert time.monotonic() < deadline, "the detached fetch never finished"
            time.sleep(0.005)
        assert result.good_pages == 2 and result.outcomes == [kvhost.PageOutcome.HIT] * 2
        assert [c.get_data_page("a", s) for s in dst] == data


def test_refusals(daemon, run):
    with pkg.client(daemon, owner_token="l3-owner") as owner, pkg.client(daemon) as stranger:
        owner.create_pool("p", SPEC)
        src = firsts(owner, "p", 2)
        keys = [f"{run}/r{i}" for i in range(2)]
        raises(ValueError, owner.l3_store, "p", src, keys[:1], naming="1 keys for 2 indices")
        raises(kvhost.InvalidArgument, owner.l3_fetch, "p", keys, [src[0], src[0]],
               naming=f"indices[1] = {src[0]}")
        raises(kvhost.InvalidArgument, owner.l3_store, "p", src, [keys[0], b""],
               naming="keys[1] is empty")
        raises(kvhost.NotFound, owner.l3_store, "nope", src, keys, naming="nope")
        raises(kvhost.PermissionDenied, stranger.l3_store, "p", src, keys, naming="'p'")
        raises(kvhost.InvalidArgument, owner.l3_exist, "p", ["x" * 113], naming="113")
        raises(kvhost.PermissionDenied, stranger.l3_exist, "p", keys, naming="'p'")
        assert owner.l3_exist("p", keys) == 0, "a refused call stored something"
        ticket = owner.l3_start_store("p", src, keys)
        raises(kvhost.PermissionDenied, stranger.l3_wait, "p", ticket, naming="'p'")
        assert owner.l3_wait("p", ticket).good_pages == 2


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def memcached():
    """A memcached server on a free loopback port, and the fleet secret's
    file (--l3-secret-file: 0600, as kvhostd requires)."""
    binary = shutil.which("memcached") or ("/usr/bin/memcached"
                                           if os.access("/usr/bin/memcached", os.X_OK) else None)
    if binary is None:
        pytest.skip("no memcached binary (Debian package memcached)")
    port = free_port()
    args = [binary, "-p", str(port), "-U", "0", "-l", "127.0.0.1", "-m", "64"]
    if os.geteuid() == 0:
        args += ["-u", "root"]
    server = subprocess.Popen(args)
    secret_dir = tempfile.mkdtemp(prefix="kvhost-l3-")
    secret = os.path.join(secret_dir, "l3.secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"python l3 test fleet secret, 32 bytes or more")
    os.close(fd)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "memcached did not listen"
                time.sleep(0.02)
        yield port, secret
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(secret_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def run():
    """This run's prefix of keys (memcached outlives a test)."""
    return f"{os.getpid()}-{time.time_ns()}"


@pytest.fixture
def kvhostd_flags(request, memcached):
    """kvhostd with the tier on that server, unless the test's marker says."""
    marker = request.node.get_closest_marker("kvhostd_flags")
    if marker is not None:
        return list(marker.args)
    port, secret = memcached
    return [f"--l3-memcached=127.0.0.1:{port}", f"--l3-secret-file={secret}"]


@pytest.mark.kvhostd_flags()
def test_no_tier(daemon):
    with pkg.client(daemon) as c:
        raises(kvhost.FailedPrecondition, c.l3_exist, "p", ["a"], naming="--l3-memcached")
