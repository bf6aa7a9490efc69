"""A stand-in for sglang's CUDA kernel package (sgl_kernel, the sglang-kernel wheel)
where it is not installed: the GPU machine's engine set (scripts/engine_wheels_gpu.sh)
cannot carry it (hundreds of MB, built for torch 2.14 while the machine has 2.11).

sglang imports it at module level wherever torch.cuda.is_available() (its host pools'
transfer kernels, quantization ops, ...), so on a GPU none of sglang's memory-pool
modules import without it. Here every ``sgl_kernel`` module imports, and every name
in one is a callable that raises RuntimeError naming itself: kvhost's pools move the
bytes through kvhostd, so a test that reaches one of sglang's own copy kernels fails,
naming the kernel, instead of passing on sglang's path.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ROOT = "sgl_kernel"


class _Missing:
    """A name of the stand-in: calling it (or anything under it) raises."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} was called: sgl_kernel is a stand-in here "
                           f"(tests/sgl_kernel_standin.py); kvhost's pools must not reach "
                           f"sglang's own kernels")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == ROOT or name.startswith(ROOT + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install():
    """Puts the stand-in in place unless sgl_kernel is installed; True if it did."""
    if importlib.util.find_spec(ROOT) is not None:
        return False
    sys.meta_path.append(_Finder())
    return True
