"""What the Python tests share: a private kvhostd (:class:`Daemon`), a
client of it, ``raises`` and the pool spec and row pattern most tests use.
kvhost is imported on first use, from the path tests/conftest.py (or the
script using this) put first.
"""
import os
import shutil
import subprocess
import tempfile
import time

SPEC = {"kind": "MHA", "layout": "PAGE_FIRST", "dtype": "BF16", "page_size": 4,
        "layer_num": 3, "head_num": 2, "head_dim": 8, "size_tokens": 64}
ROW_BYTES = 2 * 8 * 2  # head_num * head_dim * sizeof(bf16)


class Daemon:
    """A kvhostd on a private socket and shm dir; restart() keeps both."""

    def __init__(self, binary, extra=(), backend="host"):
        self.binary = binary
        self.extra = list(extra)  # more kvhostd flags
        self.backend = backend
        self.dir = tempfile.mkdtemp(prefix="kvhost-py-")
        self.shm = tempfile.mkdtemp(prefix="kvhost-py-", dir="/dev/shm")
        self.socket = os.path.join(self.dir, "kvhost.sock")
        self.address = f"unix://{self.socket}"
        self.log_path = os.path.join(self.dir, "kvhostd.log")
        self.proc = None
        self.start()

    def start(self):
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([self.binary, f"--listen={self.address}",
                                      f"--shm-dir={self.shm}", f"--backend={self.backend}",
                                      *self.extra],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            assert self.proc.poll() is None, "kvhostd exited during start"
            assert time.monotonic() < deadline, "kvhostd did not listen"
            time.sleep(0.01)

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None

    def restart(self):
        self.stop()
        self.start()

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def client(daemon, **kw):
    import kvhost
    kw.setdefault("session", False)
    kw.setdefault("timeout", 10)
    return kvhost.Client(daemon.address, wait_ready=20, **kw)


def raises(cls, fn, *args, naming=None, **kw):
    """fn(*args, **kw) raises cls (whose message names `naming`); returns it."""
    import kvhost
    try:
        fn(*args, **kw)
    except cls as e:
        text = str(e)
        assert naming is None or naming in text, f"{text!r} does not name {naming!r}"
        if isinstance(e, kvhost.KvhostError) and cls.CODE is not None:
            assert e.code == cls.CODE and e.code_name == cls.CODE.name, (e.code, cls)
            assert text.startswith(cls.CODE.name + ": ") and e.message in text, text
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {cls.__name__}")


def pattern(c, layer, row):
    return bytes((1 + (c * 131 + layer * 31 + row * 7 + b) % 251) for b in range(ROW_BYTES))
