#!/usr/bin/env python3
"""kvhost.AsyncCalls (python/kvhost/async_calls.py) against a real kvhostd.

Each check gets a fresh kvhostd (host backend) and submits alloc / free /
backup / load without blocking: the futures complete in submission order
(a whole-pool alloc starves the one behind it), from the executor thread;
each failure is the package's exception with the code and message the
synchronous call raises; ``completed`` and ``submitted`` count; a backup and
a load move rows byte for byte; leaving the ``with`` block waits for every
call while close(wait=False) cancels the queued ones (each future completed,
the cancelled ones after every one that ran); a future's callback may close
its own AsyncCalls; closing the client closes it; asyncio awaits a future.
Run by tests/pytest_run.py (ctest), or by pytest from a built checkout.
"""
import asyncio
import concurrent.futures
import threading
import time

import kvhost

SPEC = {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16", "page_size": 4,
        "layer_num": 3, "head_num": 2, "head_dim": 8, "size_tokens": 64}
ROW_BYTES = 2 * 8 * 2  # head_num * head_dim * sizeof(bf16)
WAIT_S = 30


def client(daemon, **kw):
    kw.setdefault("session", False)
    kw.setdefault("timeout", 10)
    return kvhost.Client(daemon.address, wait_ready=20, **kw)


def error_of(fn, *args, **kw):
    """The KvhostError fn(*args, **kw) raises."""
    try:
        fn(*args, **kw)
    except kvhost.KvhostError as e:
        return e
    raise AssertionError(f"{fn.__name__} did not raise")


def completed_reaches(calls, n):
    """Polls calls.completed up to n (it counts a call just after its future
    completed); True once it did."""
    deadline = time.monotonic() + WAIT_S
    while calls.completed < n and time.monotonic() < deadline:
        time.sleep(0.001)
    return calls.completed >= n


def same_error(future, sync_error, cls):
    """The future failed as the synchronous call did: class, code, message."""
    e = future.exception(timeout=WAIT_S)
    assert type(e) is cls and type(sync_error) is cls, (e, sync_error)
    assert e.code == sync_error.code == cls.CODE, (e.code, sync_error.code)
    assert e.message == sync_error.message, (e.message, sync_error.message)


def test_futures_complete_in_order(daemon):
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        calls = c.async_calls()
        assert isinstance(calls, kvhost.AsyncCalls)
        order, threads = [], set()

        def note(i):
            def done(_future):
                order.append(i)
                threads.add(threading.get_ident())
            return done

        whole = calls.alloc("p", 64, numpy=False)
        starved = calls.alloc("p", 4)
        unknown = calls.alloc("nope", 4)
        partial = calls.alloc("p", 3)
        futures = [whole, starved, unknown, partial]
        for i, f in enumerate(futures):
            f.add_done_callback(note(i))
        assert calls.submitted == 4
        slots = whole.result(timeout=WAIT_S)
        assert isinstance(slots, list) and len(slots) == 64, slots
        assert isinstance(starved.exception(timeout=WAIT_S), kvhost.ResourceExhausted)
        same_error(unknown, error_of(c.alloc, "nope", 4), kvhost.NotFound)
        assert "nope" in unknown.exception().message
        same_error(partial, error_of(c.alloc, "p", 3), kvhost.InvalidArgument)
        freed = calls.free("p", slots)
        assert freed.result(timeout=WAIT_S) == 64
        concurrent.futures.wait(futures, timeout=WAIT_S)
        assert order == [0, 1, 2, 3], order
        assert threading.get_ident() not in threads, "a future completed on the caller's thread"
        assert completed_reaches(calls, 5) and calls.completed == calls.submitted == 5, \
            (calls.completed, calls.submitted)
        # A double free, and its synchronous twin.
        same_error(calls.free("p", slots[:4]), error_of(c.free, "p", slots[:4]),
                   kvhost.FailedPrecondition)
        assert c.get_pool("p")["available_tokens"] == 64
        # Bad arguments raise at once; nothing is submitted.
        for bad in (lambda: calls.alloc(7, 4), lambda: calls.alloc("p", -4),
                    lambda: calls.free("p", [1.5])):
            try:
                bad()
            except (TypeError, ValueError):
                pass
            else:
                raise AssertionError("a bad argument was submitted")
        assert calls.submitted == 6
        calls.close()
        assert calls.closed and calls.completed == 0
        try:
            calls.alloc("p", 4)
        except ValueError:
            pass
        else:
            raise AssertionError("a closed AsyncCalls took a call")


def fill(dev, rows):
    for c, comp in enumerate(dev.components):
        for layer in range(dev.layers):
            view = dev.layer_view(comp.name, layer)
            for r in rows:
                view[r * ROW_BYTES:(r + 1) * ROW_BYTES] = bytes(
                    (1 + (c * 131 + layer * 31 + r * 7 + b) % 251) for b in range(ROW_BYTES))


def test_backup_and_load_move_the_bytes(daemon):
    with client(daemon, session=True) as c:
        c.create_pool("p", SPEC)
        with c.shm_device_pool("p", 16) as dev, c.attach_shm("p", dev) as att, \
                c.async_calls() as calls:
            fill(dev, range(8))
            slots = calls.alloc("p", 8).result(timeout=WAIT_S)
            backed_up = calls.backup(att, slots, range(8), wait=True)
            loaded = calls.load(att, slots, range(8, 16))
            ticket = backed_up.result(timeout=WAIT_S)
            assert isinstance(ticket, kvhost.Ticket) and ticket.done, ticket
            load_ticket = loaded.result(timeout=WAIT_S)
            assert isinstance(load_ticket, kvhost.Ticket) and load_ticket.id != ticket.id
            load_ticket.wait(WAIT_S)
            for comp in dev.components:
                for layer in range(dev.layers):
                    view = dev.layer_view(comp.name, layer)
                    assert bytes(view[:8 * ROW_BYTES]) == bytes(
                        view[8 * ROW_BYTES:16 * ROW_BYTES]), (comp.name, layer)
            # A device row out of range: the daemon's refusal, as the sync call's.
            sync = error_of(att.backup, slots[:1], [99])
            same_error(calls.backup(att, slots[:1], [99]), sync, type(sync))
            assert "99" in sync.message, sync.message


def test_close_waits_or_cancels(daemon):
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        # Leaving the block waits for every call.
        with c.async_calls() as calls:
            futures = [calls.alloc("nope", 4) for _ in range(300)]
        assert all(f.done() for f in futures)
        assert all(isinstance(f.exception(), kvhost.NotFound) for f in futures)
        # close(wait=False): the queued ones are Cancelled, after every one that ran.
        calls = c.async_calls()
        futures = [calls.alloc("nope", 4) for _ in range(3000)]
        calls.close(wait=False)
        done, not_done = concurrent.futures.wait(futures, timeout=WAIT_S)
        assert not not_done, f"{len(not_done)} futures never completed"
        kinds = [type(f.exception()) for f in futures]
        assert set(kinds) <= {kvhost.NotFound, kvhost.Cancelled}, set(kinds)
        first = kinds.index(kvhost.Cancelled) if kvhost.Cancelled in kinds else len(kinds)
        assert first < len(kinds), "every call ran before the close"
        assert all(k is kvhost.Cancelled for k in kinds[first:]), "a call ran after a cancel"
        e = futures[-1].exception()
        assert e.code == kvhost.StatusCode.CANCELLED and "closed" in e.message, e
        # Closing the client closes its AsyncCalls (queued calls cancelled).
        calls = c.async_calls()
        calls.alloc("p", 4).result(timeout=WAIT_S)
    assert calls.closed


def test_a_future_callback_may_close_its_async_calls(daemon):
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        calls = c.async_calls()
        first = calls.alloc("p", 4)
        later = [calls.alloc("nope", 4) for _ in range(200)]
        first.add_done_callback(lambda _f: calls.close(wait=False))
        first.result(timeout=WAIT_S)
        _, not_done = concurrent.futures.wait(later, timeout=WAIT_S)
        assert not not_done, f"{len(not_done)} futures never completed"
        assert all(isinstance(f.exception(), (kvhost.NotFound, kvhost.Cancelled))
                   for f in later)
        assert calls.closed


def test_asyncio_awaits_a_future(daemon):
    with client(daemon) as c:
        c.create_pool("p", SPEC)
        with c.async_calls() as calls:
            async def scheduler():
                slots = await asyncio.wrap_future(calls.alloc("p", 8, numpy=False))
                return await asyncio.wrap_future(calls.free("p", slots))
            assert asyncio.run(scheduler()) == 8
