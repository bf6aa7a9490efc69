#!/usr/bin/env python3
"""Runs one Python test module under pytest, as ctest does: with this
interpreter (the system's python3, without numpy, torch or sglang, as the
package's users may have it) and pytest from the engine venv's pytest-path
(scripts/engine_venv.sh; tests/engine_env.py finds it). Exits 77 (ctest's
skip) naming the command that builds it when it is missing, or fails under
KVHOST_REQUIRE_ENGINES=1 (scripts/test.sh).

  usage: pytest_run.py KVHOSTD LIBKVHOST_C SOURCE_DIR TEST_FILE [PYTEST_ARGS...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_env  # noqa: E402

#: pytest's exit code when it collected no test: a wrong file, not a pass.
NO_TESTS = 5


def main():
    if len(sys.argv) < 5:
        print(__doc__)
        return 2
    kvhostd, lib, src, test_file = (os.path.abspath(a) for a in sys.argv[1:5])
    path = engine_env.pytest_path(src)
    if path is None:
        return engine_env.missing("pytest (python/requirements-engines.txt)")
    sys.path.insert(0, path)
    import pytest  # noqa: PLC0415 (from the path above)
    os.environ.update(KVHOST_TEST_KVHOSTD=kvhostd, KVHOST_LIBRARY=lib,
                      KVHOST_TEST_SOURCE_DIR=src)
    rc = pytest.main([test_file, "-p", "no:cacheprovider", "-rs", "-v", *sys.argv[5:]])
    return 1 if rc == NO_TESTS else int(rc)


if __name__ == "__main__":
    sys.exit(main())
