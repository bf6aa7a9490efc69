"""The engine venv for tests that run against a real engine (sglang).

scripts/engine_venv.sh builds it from python/requirements-engines.txt at
$KVHOST_ENGINE_ROOT/venv-<first 12 hex of the file's sha256> (default root
/var/cache/kvhost). A test calls :func:`enter` first: it re-executes the test
under that venv's python, or exits 77 (ctest's skip) naming the command that
builds it. With KVHOST_REQUIRE_ENGINES=1 (scripts/test.sh, so CI) a missing
venv fails instead of skipping.
"""
import hashlib
import os
import sys

SKIP = 77


def _venv(source_dir):
    """The engine venv's directory for this checkout, or None if not built."""
    req = os.path.join(source_dir, "python", "requirements-engines.txt")
    with open(req, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    root = os.environ.get("KVHOST_ENGINE_ROOT", "/var/cache/kvhost")
    venv = os.path.join(root, f"venv-{digest}")
    return venv if os.path.exists(os.path.join(venv, ".complete")) else None


def venv_python(source_dir):
    """The engine venv's python for this checkout, or None if not built."""
    venv = _venv(source_dir)
    return None if venv is None else os.path.join(venv, "bin", "python")


def pytest_path(source_dir):
    """The directory holding pytest and its dependencies alone (no numpy,
    torch or sglang beside them), for any python3 >= 3.9 to put on its path
    (tests/pytest_run.py); None if the engine venv is not built."""
    venv = _venv(source_dir)
    return None if venv is None else os.path.join(venv, "pytest-path")


def missing(what):
    """ctest's skip (77) naming the command that builds the engine venv, or a
    failure (1) under KVHOST_REQUIRE_ENGINES=1."""
    msg = f"the engine venv is not built ({what}); run scripts/engine_venv.sh"
    if os.environ.get("KVHOST_REQUIRE_ENGINES") == "1":
        print(f"FAIL: {msg}", flush=True)
        return 1
    print(f"SKIP: {msg}", flush=True)
    return SKIP


def enter(source_dir):
    """Runs the calling script under the engine venv (returns there)."""
    python = venv_python(source_dir)
    if python is not None and os.path.realpath(sys.prefix) == os.path.realpath(
            os.path.dirname(os.path.dirname(python))):
        return
    if python is None:
        sys.exit(missing("python/requirements-engines.txt: sglang and torch"))
    os.execv(python, [python, os.path.abspath(sys.argv[0]), *sys.argv[1:]])


def enter_with(source_dir, module):
    """enter(), then python/ on the path; exits as missing() says when the
    engine venv has no `module` (pinned in python/requirements-engines.txt)."""
    import importlib.util  # noqa: PLC0415
    enter(source_dir)
    if importlib.util.find_spec(module) is None:
        sys.exit(missing(f"it has no {module}, which python/requirements-engines.txt pins"))
    sys.path.insert(0, os.path.join(source_dir, "python"))
