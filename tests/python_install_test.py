#!/usr/bin/env python3
"""Installing the kvhost Python package as python/README.md says, offline,
into plain venvs (`python3 -m venv`, no system site packages), and using it
with no KVHOST_* variable set:

1. `pip install --no-index ./python` from the checkout, built beside a
   build (KVHOST_BUILD_DIR at install time only): the package bundles the
   library and loads it from its own directory; the quickstart of
   python/README.md runs in that venv twice in a row against one kvhostd.
2. `cmake --install BUILD --prefix VENV`, then the package built from a copy
   of python/ away from any checkout or build (nothing to bundle): it loads
   VENV/lib/libkvhost_c.so.1.
3. `pip install --no-index -e ./python`: the checkout's package, which
   reports where it loaded the library from.

  usage: python_install_test.py KVHOSTD LIBKVHOST_C SOURCE_DIR BUILD_DIR CMAKE
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvhost_testing import Daemon  # noqa: E402 (the same private kvhostd)

#: What the installed package prints: where it loaded the library from.
PROBE = "import kvhost._lib as l; print(l.library_path())"


def clean_env():
    """The environment with no KVHOST_* variable, no PYTHONPATH, and pip told
    to stay offline."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVHOST_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def run(cmd, cwd, env=None):
    done = subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def plain_venv(path, tmp):
    run([sys.executable, "-m", "venv", path], tmp)
    cfg = open(os.path.join(path, "pyvenv.cfg")).read()
    assert "include-system-site-packages = false" in cfg, cfg
    return os.path.join(path, "bin", "python")


def quickstart(src):
    text = open(os.path.join(src, "python", "README.md")).read()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def check_bundled(tmp, kvhostd, build, src):
    py = plain_venv(os.path.join(tmp, "v1"), tmp)
    env = clean_env()
    env["KVHOST_BUILD_DIR"] = build  # at install time only
    run([py, "-m", "pip", "install", "--no-index", os.path.join(src, "python")], tmp, env)
    loaded = run([py, "-c", PROBE], tmp).strip()
    site = run([py, "-c", "import kvhost, os; print(os.path.dirname(kvhost.__file__))"],
               tmp).strip()
    assert loaded == os.path.join(site, "libkvhost_c.so.1"), (loaded, site)
    daemon = Daemon(kvhostd)
    try:
        code = quickstart(src).replace("unix:///run/kvhost/kvhost.sock", daemon.address)
        script = os.path.join(tmp, "quickstart.py")
        with open(script, "w") as f:
            f.write(code + "\nprint('quickstart done')\n")
        for attempt in (1, 2):  # idempotent: the second run starts as the first
            out = run([py, script], tmp)
            assert "quickstart done" in out, (attempt, out)
        listed = run([py, "-c", "import kvhost, sys; c = kvhost.Client(sys.argv[1], "
                      "session=False); print([p['name'] for p in c.list_pools()], "
                      "c.daemon_status()['attachments'])", daemon.address], tmp)
        assert listed.strip() == "[] 0", listed  # the quickstart left nothing behind
    finally:
        daemon.cleanup()
    print("ok   pip install ./python bundles the library; the quickstart runs twice")


def check_cmake_install(tmp, build, src, cmake):
    venv = os.path.join(tmp, "v2")
    py = plain_venv(venv, tmp)
    run([cmake, "--install", build, "--prefix", venv], tmp)
    copy = os.path.join(tmp, "copy", "python")  # no checkout around it, no build beside it
    shutil.copytree(os.path.join(src, "python"), copy,
                    ignore=shutil.ignore_patterns("__pycache__", "libkvhost_c.so*"))
    run([py, "-m", "pip", "install", "--no-index", copy], tmp)
    wheel_tag = run([py, "-c", "import importlib.metadata as m; "
                     "print(m.distribution('kvhost').read_text('WHEEL'))"], tmp)
    assert "Tag: py3-none-any" in wheel_tag, wheel_tag  # nothing was bundled
    loaded = run([py, "-c", PROBE], tmp).strip()
    assert loaded == os.path.join(venv, "lib", "libkvhost_c.so.1"), loaded
    print("ok   after cmake --install into the venv's prefix, the package finds the library")


def check_editable(tmp, src):
    py = plain_venv(os.path.join(tmp, "v3"), tmp)
    run([py, "-m", "pip", "install", "--no-index", "-e", os.path.join(src, "python")], tmp)
    where = run([py, "-c", "import kvhost; print(kvhost.__file__)"], tmp).strip()
    assert where == os.path.join(src, "python", "kvhost", "__init__.py"), where
    print("ok   pip install -e ./python imports the checkout's package")


def main():
    if len(sys.argv) != 6:
        print(__doc__)
        return 2
    try:
        import ensurepip  # noqa: F401, PLC0415 (python3 -m venv needs it)
    except ImportError:  # Debian's python3 without python3-venv
        print("SKIP: python3 -m venv needs ensurepip (Debian package python3-venv)")
        return 77
    kvhostd, lib_path, src, build = (os.path.abspath(a) for a in sys.argv[1:5])
    cmake = sys.argv[5]
    build_of_lib = os.path.dirname(os.path.dirname(lib_path))  # <build>/lib/libkvhost_c.so
    tmp = tempfile.mkdtemp(prefix="kvhost-py-install-")
    try:
        check_bundled(tmp, kvhostd, build_of_lib, src)
        check_cmake_install(tmp, build, src, cmake)
        check_editable(tmp, src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
