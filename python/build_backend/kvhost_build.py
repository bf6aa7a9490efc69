"""kvhost's PEP 517 build backend: the wheel of a pure-Python package, from
the standard library alone.

Why not setuptools: ``pip install ./python`` must work offline in a plain
``python3 -m venv``, whose setuptools (65 on Python 3.11) cannot make a wheel
without the ``wheel`` package (``invalid command 'bdist_wheel'``). This
backend needs nothing installed (``requires = []``), so pip's isolated build
environment has nothing to download.

What it builds, from pyproject.toml's [project] table:

- a wheel of every file of the ``kvhost`` package (sources, py.typed), and
  libkvhost_c.so.1 inside it when a build has one (kvhost._lib.
  build_tree_candidates: $KVHOST_LIBRARY, $KVHOST_BUILD_DIR/lib, the
  checkout's build/lib), so the installed package loads the library it was
  built beside without an environment variable; such a wheel is tagged for
  this platform (it holds machine code), else ``py3-none-any``;
- an editable wheel (``pip install -e``): a .pth naming this directory;
- an sdist of this directory's sources.

The wheels are for installing here, not for an index: the library links the
system's gRPC and protobuf shared libraries.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent.parent  # python/: pyproject.toml, kvhost/
PACKAGE = "kvhost"
#: Reproducible archives: every member gets this time (1980-01-01, zip's epoch).
_EPOCH = (1980, 1, 1, 0, 0, 0)


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib  # noqa: PLC0415 (3.11's standard library)
        return tomllib
    import tomli  # type: ignore[import-not-found]  # noqa: PLC0415 (asked for below)
    return tomli


def _project() -> Dict[str, Any]:
    with open(HERE / "pyproject.toml", "rb") as f:
        return dict(_toml().load(f)["project"])


def _requires() -> List[str]:
    return [] if sys.version_info >= (3, 11) else ["tomli>=1.1"]


def get_requires_for_build_wheel(config_settings: Any = None) -> List[str]:
    return _requires()


def get_requires_for_build_editable(config_settings: Any = None) -> List[str]:
    return _requires()


def get_requires_for_build_sdist(config_settings: Any = None) -> List[str]:
    return _requires()


def _metadata(project: Dict[str, Any]) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}",
             f"Version: {project['version']}", f"Summary: {project['description']}",
             f"Requires-Python: {project['requires-python']}"]
    lines += [f"Classifier: {c}" for c in project.get("classifiers", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    lines.append("Description-Content-Type: text/markdown")
    readme = (HERE / str(project["readme"])).read_text()
    return "\n".join(lines) + "\n\n" + readme


def _entry_points(project: Dict[str, Any]) -> str:
    out = []
    for group, points in project.get("entry-points", {}).items():
        out.append(f"[{group}]")
        out += [f"{name} = {target}" for name, target in points.items()]
        out.append("")
    return "\n".join(out)


def _bundled_library() -> Optional[Tuple[Path, str]]:
    """The library a build beside this checkout made, and the name it has in
    the package, found the way the package itself looks for a build's
    (kvhost._lib, the one home of that search); None when there is none."""
    sys.path.insert(0, str(HERE))
    try:
        from kvhost import _lib  # noqa: PLC0415 (this source tree's, on sys.path here)
    finally:
        sys.path.remove(str(HERE))
    for place in _lib.build_tree_candidates():
        if os.path.isfile(place):
            return Path(place).resolve(), _lib.SONAME
    return None


class _Wheel:
    """A wheel being written: each file's bytes, and RECORD at the end."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED)
        self.record: List[Tuple[str, str, str]] = []

    def add(self, name: str, data: bytes, mode: int = 0o644) -> None:
        info = zipfile.ZipInfo(name, _EPOCH)
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        self.record.append((name, "sha256=" + digest.decode(), str(len(data))))

    def close(self, record_name: str) -> None:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerows(self.record + [(record_name, "", "")])
        info = zipfile.ZipInfo(record_name, _EPOCH)
        info.external_attr = 0o100644 << 16
        self.zip.writestr(info, text.getvalue())
        self.zip.close()


def _package_files() -> List[Path]:
    root = HERE / PACKAGE
    return sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and not p.name.startswith("libkvhost_c.so") and p.suffix != ".pyc")


def _write_wheel(directory: str, editable: bool) -> str:
    project = _project()
    name, version = project["name"], project["version"]
    library = None if editable else _bundled_library()
    if library is None:
        tag = "py3-none-any"
    else:
        tag = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
    filename = f"{name}-{version}-{tag}.whl"
    dist_info = f"{name}-{version}.dist-info"
    wheel = _Wheel(Path(directory) / filename)
    if editable:
        wheel.add(f"__editable__.{name}.pth", (str(HERE) + "\n").encode())
    else:
        for path in _package_files():
            wheel.add(path.relative_to(HERE).as_posix(), path.read_bytes())
        if library is not None:
            path, soname = library
            wheel.add(f"{PACKAGE}/{soname}", path.read_bytes(), 0o755)
    wheel.add(f"{dist_info}/METADATA", _metadata(project).encode())
    wheel.add(f"{dist_info}/WHEEL",
              (f"Wheel-Version: 1.0\nGenerator: kvhost_build\n"
               f"Root-Is-Purelib: {'false' if library else 'true'}\nTag: {tag}\n").encode())
    points = _entry_points(project)
    if points:
        wheel.add(f"{dist_info}/entry_points.txt", points.encode())
    wheel.close(f"{dist_info}/RECORD")
    return filename


def build_wheel(wheel_directory: str, config_settings: Any = None,
                metadata_directory: Optional[str] = None) -> str:
    return _write_wheel(wheel_directory, editable=False)


def build_editable(wheel_directory: str, config_settings: Any = None,
                   metadata_directory: Optional[str] = None) -> str:
    return _write_wheel(wheel_directory, editable=True)


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    project = _project()
    base = f"{project['name']}-{project['version']}"
    filename = f"{base}.tar.gz"
    files = [HERE / "pyproject.toml", HERE / project["readme"], Path(__file__).resolve()]
    files += _package_files()
    with tarfile.open(Path(sdist_directory) / filename, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            tar.add(path, arcname=f"{base}/{path.relative_to(HERE).as_posix()}", recursive=False)
        pkg_info = _metadata(project).encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return filename
