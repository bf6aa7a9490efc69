#!/usr/bin/env python3
"""kvhostd tells systemd its state (Type=notify): READY=1 once it serves, STOPPING=1 on SIGTERM.

This test plays the service manager: it binds a unix datagram socket, starts the built
kvhostd with NOTIFY_SOCKET naming it (host backend, a private socket and shm dir), waits
for READY=1, checks that the socket then answers, sends SIGTERM, and expects STOPPING=1
and exit status 0.
  usage: sd_notify_test.py KVHOSTD
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 20


def parse(datagram):
    """sd_notify's message: newline-separated VAR=value lines."""
    fields = {}
    for line in datagram.decode().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


def wait_for(notify, key, proc):
    """Messages until one sets `key`; fails on timeout or when kvhostd exits first."""
    deadline = time.monotonic() + TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        try:
            fields = parse(notify.recv(4096))
        except socket.timeout:
            if proc.poll() is not None:
                break
            continue
        print(f"notify: {fields}")
        seen.append(fields)
        if key in fields:
            return fields
    raise AssertionError(f"no {key}=1 (waited up to {TIMEOUT_S} s; got {seen}; "
                         f"kvhostd exit status {proc.poll()})")


def main():
    kvhostd = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="kvhost-notify.")
    shm = tempfile.mkdtemp(prefix="kvhost-notify.", dir="/dev/shm")
    proc = None
    try:
        notify_path = os.path.join(tmp, "notify.sock")
        listen_path = os.path.join(tmp, "kvhost.sock")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        notify.settimeout(0.2)
        env = dict(os.environ, NOTIFY_SOCKET=notify_path)
        log = open(os.path.join(tmp, "log"), "w+")
        proc = subprocess.Popen(
            [kvhostd, "--backend=host", f"--listen=unix://{listen_path}", f"--shm-dir={shm}"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = wait_for(notify, "READY", proc)
            assert ready["READY"] == "1", ready
            assert ready.get("STATUS", "").startswith("serving on unix://" + listen_path), ready
            # READY=1 promises a listener that accepts calls.
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(listen_path)
            client.close()

            proc.send_signal(signal.SIGTERM)
            stopping = wait_for(notify, "STOPPING", proc)
            assert stopping["STOPPING"] == "1", stopping
            assert "SIGTERM" in stopping.get("STATUS", ""), stopping
            code = proc.wait(timeout=TIMEOUT_S)
            assert code == 0, f"kvhostd exited with {code}"
            assert not os.path.exists(listen_path), "kvhostd left its socket behind"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            print(log.read(), end="")
            log.close()
            notify.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print("sd_notify ok: READY=1 after start, STOPPING=1 on SIGTERM, exit 0")


if __name__ == "__main__":
    main()
