#!/usr/bin/env python3
"""Test files per module: which modules of server/, client/ and common/ have none.

Usage: scripts/module_tests.py [--strict] [--list]
  A module is a .cc or .cu file under server/, client/ or common/, named by
  its stem (server/transfer/attachments.cc is "attachments"); its test file is
  tests/<stem>_test.{cc,c,py,sh} (the README's "one test file per module",
  LevelDB's habit: STYLE.md). main.cc files are programs, not modules.
  The modules still without one are listed in scripts/modules_without_tests.txt
  (one path a line, '#' comments), the debt written down:
  default   prints the count and the modules lacking a test file that the
            list does not name (a report; exits 0);
  --list    also prints every module without a test file;
  --strict  exits 1 when a module lacks a test file and is not listed, or the
            list names one that has a test file now or no longer exists (so
            the list only shrinks). scripts/test.sh's rooms phase runs this.
"""
import os
import sys

ROOTS = ("server", "client", "common")
EXTS = (".cc", ".cu")
TEST_EXTS = (".cc", ".c", ".py", ".sh")
ALLOW = os.path.join("scripts", "modules_without_tests.txt")


def modules():
    out = []
    for root in ROOTS:
        for dirpath, _, names in os.walk(root):
            for name in names:
                if name.endswith(EXTS) and name != "main.cc":
                    out.append(os.path.join(dirpath, name))
    return sorted(out)


def has_test(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    return any(os.path.exists(os.path.join("tests", stem + "_test" + e)) for e in TEST_EXTS)


def allowed():
    if not os.path.exists(ALLOW):
        return set()
    with open(ALLOW, encoding="utf-8") as f:
        return {l.split("#")[0].strip() for l in f if l.split("#")[0].strip()}


def main(argv):
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    strict = "--strict" in argv
    mods = modules()
    lacking = [m for m in mods if not has_test(m)]
    allow = allowed()
    unlisted = [m for m in lacking if m not in allow]
    stale = sorted(m for m in allow if m not in lacking)
    if "--list" in argv:
        for m in lacking:
            print(("listed   " if m in allow else "MISSING  ") + m)
    for m in [] if "--list" in argv else unlisted:
        print(f"MISSING  {m}: no tests/<stem>_test.* (add one, or list it in {ALLOW})")
    for m in stale:
        print(f"STALE    {m}: listed in {ALLOW} but it has a test file or is gone; drop the line")
    print(f"== module tests: {len(mods) - len(lacking)} of {len(mods)} modules have a test file; "
          f"{len(lacking)} without ({len(unlisted)} not listed), {len(stale)} stale list entries")
    return 1 if (strict and (unlisted or stale)) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
