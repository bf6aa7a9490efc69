"""pytest's setup for the Python package's tests (tests/python_*_test.py).

Where things are: $KVHOST_TEST_KVHOSTD, $KVHOST_LIBRARY and
$KVHOST_TEST_SOURCE_DIR, as tests/pytest_run.py (ctest) sets them; without
them, this checkout and its build/ (so `pytest tests/python_async_test.py`
works from a built checkout). The checkout's python/ goes first on sys.path,
so the tests import the package they test.

One fixture starts kvhostd: `daemon`, a fresh host-backend kvhostd on a
private socket and shm dir for each test (kvhost_testing.Daemon), stopped and
removed after it; a failed test's report carries that kvhostd's log. Its
flags come from the `kvhostd_flags` fixture: none, or the `kvhostd_flags`
marker's (``pytestmark = pytest.mark.kvhostd_flags("--session-timeout=500ms")``);
a module may override the fixture (python_l3_test.py: a memcached tier).
"""
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("KVHOST_TEST_SOURCE_DIR") or os.path.dirname(TESTS)
KVHOSTD = os.environ.get("KVHOST_TEST_KVHOSTD") or os.path.join(SOURCE_DIR, "build", "bin",
                                                                "kvhostd")
os.environ.setdefault("KVHOST_LIBRARY", os.path.join(SOURCE_DIR, "build", "lib",
                                                     "libkvhost_c.so.1"))
sys.path.insert(0, os.path.join(SOURCE_DIR, "python"))
sys.path.insert(0, TESTS)

from kvhost_testing import Daemon  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "kvhostd_flags(*flags): kvhostd flags of `daemon`")


@pytest.fixture
def kvhostd_flags(request):
    marker = request.node.get_closest_marker("kvhostd_flags")
    return list(marker.args) if marker else []


@pytest.fixture
def daemon(kvhostd_flags):
    d = Daemon(KVHOSTD, kvhostd_flags)
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def source_dir():
    return SOURCE_DIR


@pytest.fixture
def lib_path():
    return os.environ["KVHOST_LIBRARY"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    d = item.funcargs.get("daemon") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(d, Daemon):
        report.sections.append(("kvhostd log", d.log()))
