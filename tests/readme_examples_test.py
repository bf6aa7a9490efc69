#!/usr/bin/env python3
"""Runs every kvhostctl and grpcurl example of the given Markdown files, as
written and in their order, against a fresh kvhostd (host backend) per file.

An example is a command in a ```sh block that starts with `kvhostctl ` or
`grpcurl ` (continued over lines by a trailing backslash or an open quote);
`S=...` lines are kept too. The socket path /run/kvhost/kvhost.sock becomes
the test daemon's; `kvhostctl` is this build's, `grpcurl` is
tests/grpcurl_lite (the subset of grpcurl the docs use, reflection-driven).
A trailing comment decides what counts as success:
  * "fails with CODE"  the example must exit non-zero with CODE in stderr;
  * "not run by the tests"  skipped (it needs another machine), and listed;
  * a `watch` without --count runs until stopped: alive after 3 s is success.
Every other example must exit 0 within 120 s.

  readme_examples_test.py --kvhostd K --kvhostctl C --grpcurl G FILE.md...
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SOCKET = "/run/kvhost/kvhost.sock"


def examples(path):
    """[(line number, command text)] of the file's sh blocks, in order."""
    out = []
    in_block = False
    pending, start = None, 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_block = line.strip() == "```sh" if not in_block else False
            pending = None
            continue
        if not in_block:
            continue
        if pending is None:
            stripped = line.strip()
            if not (stripped.startswith("kvhostctl ") or stripped.startswith("grpcurl ")
                    or stripped == "kvhostctl" or re.match(r"^S=\S+$", stripped)):
                continue
            pending, start = stripped, number
        else:
            pending += "\n" + line
        if pending.endswith("\\") or open_quote(pending):
            continue
        out.append((start, pending))
        pending = None
    return out


def open_quote(text):
    """Whether `text` ends inside a single-quoted string (comments ignored)."""
    quoted = False
    for line in text.split("\n"):
        for i, c in enumerate(line):
            if c == "'":
                quoted = not quoted
            elif c == "#" and not quoted and (i == 0 or line[i - 1] in " \t"):
                break
    return quoted


def comment_of(command):
    """The trailing shell comment (outside quotes), or ''."""
    quoted = False
    for i, c in enumerate(command):
        if c == "'":
            quoted = not quoted
        elif c == "#" and not quoted and (i == 0 or command[i - 1] in " \t"):
            return command[i + 1:].strip()
    return ""


class Daemon:
    def __init__(self, kvhostd):
        self.dir = tempfile.mkdtemp(prefix="kvhost-readme-")
        self.shm = tempfile.mkdtemp(prefix="kvhost-readme-", dir="/dev/shm")
        self.socket = os.path.join(self.dir, "kvhost.sock")
        self.log = open(os.path.join(self.dir, "kvhostd.log"), "w")
        self.proc = subprocess.Popen(
            [kvhostd, f"--listen=unix://{self.socket}", f"--shm-dir={self.shm}",
             "--backend=host"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("kvhostd did not start:\n" + self.read_log())
            time.sleep(0.05)

    def read_log(self):
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = "killed after 60 s"
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)
        return code


def run_file(path, args):
    daemon = Daemon(args.kvhostd)
    work = tempfile.mkdtemp(prefix="kvhost-readme-work-")
    prelude = (f"kvhostctl() {{ '{args.kvhostctl}' --server=unix://{daemon.socket} \"$@\"; }}\n"
               f"grpcurl() {{ '{args.grpcurl}' \"$@\"; }}\n")
    env_lines = []
    failures, skipped, ran = [], [], 0
    try:
        for number, command in examples(path):
            where = f"{os.path.basename(path)}:{number}"
            text = command.replace(SOCKET, daemon.socket)
            if re.match(r"^S=\S+$", text):
                env_lines.append(text)
                continue
            comment = comment_of(command)
            if "not run by the tests" in comment:
                skipped.append(where)
                print(f"-- {where}: skipped ({comment})")
                continue
            expect = re.search(r"fails with ([A-Z_]+)", comment)
            live = re.search(r"\bkvhostctl\s+watch\b", command) and "--count" not in command
            script = prelude + "\n".join(env_lines) + "\n" + text + "\n"
            print(f"-- {where}: {command.splitlines()[0]}", flush=True)
            ran += 1
            try:
                proc = subprocess.run(["bash", "-c", script], cwd=work, capture_output=True,
                                      text=True, timeout=3 if live else 120)
            except subprocess.TimeoutExpired:
                if live:
                    continue
                failures.append(f"{where}: timed out after 120 s: {command}")
                continue
            if expect:
                code = expect.group(1)
                codes = {code, "".join(w.capitalize() for w in code.split("_"))}
                if proc.returncode == 0 or not any(c in proc.stderr for c in codes):
                    failures.append(f"{where}: expected failure {code}, got exit "
                                    f"{proc.returncode}: {proc.stderr.strip()}\n  {command}")
            elif proc.returncode != 0 or live:
                failures.append(f"{where}: exit {proc.returncode}: "
                                f"{(proc.stderr or proc.stdout).strip()[:2000]}\n  {command}")
    finally:
        code = daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    if code != 0:
        failures.append(f"{path}: kvhostd exited {code} on SIGTERM after the examples")
    print(f"== {path}: {ran} examples run, {len(skipped)} skipped, {len(failures)} failed")
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvhostd", required=True)
    parser.add_argument("--kvhostctl", required=True)
    parser.add_argument("--grpcurl", required=True)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    args.kvhostd = os.path.abspath(args.kvhostd)
    args.kvhostctl = os.path.abspath(args.kvhostctl)
    args.grpcurl = os.path.abspath(args.grpcurl)
    failures = []
    for path in args.files:
        failures += run_file(path, args)
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
