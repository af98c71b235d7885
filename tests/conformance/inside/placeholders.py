"""Import placeholders for packages that cannot load on a CPU-only machine.

Only packages SGLang imports at module level but never calls on the paths under test get one
(torchvision's wheels are CUDA builds that fail beside the CPU torch; `sgl_kernel` has no CPU build on
the package index). Any use of a placeholder raises, naming the package, so a path that does call one
fails loudly instead of being silently faked.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class PlaceholderUsed(RuntimeError):
    pass


class _Missing:
    """Stands for any attribute of a placeholder module: usable as a name, a base class or a decorator
    target at import time; calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise PlaceholderUsed(f"{self._name} was called, but it is an import placeholder on this CPU-only machine")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (type(self._name.rsplit(".", 1)[-1], (), {"__module__": self._name}),)


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers asks placeholders' versions: the oldest keeps it off them
        return module

    def exec_module(self, module):
        return None


def install(roots: tuple[str, ...]) -> None:
    sys.meta_path.insert(0, _Finder(roots))
