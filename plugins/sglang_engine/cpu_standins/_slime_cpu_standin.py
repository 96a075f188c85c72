"""What the stand-in packages are made of (see README.md): modules whose every attribute is `Unavailable`.

Importing `torchvision.anything` succeeds and gives a `StandinModule`; `from torchvision.x import y` gives an
`Unavailable` placeholder that can be passed around, compared, hashed and have attributes taken (as the
libraries do at import time, e.g. `InterpolationMode.BICUBIC` in a table), but raises `RuntimeError` naming
the missing package as soon as it is called, iterated or subclassed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class Unavailable:
    """A name from a package that is not installed; any real use of it raises."""

    def __init__(self, qualified_name: str) -> None:
        self._qualified_name = qualified_name

    def _refuse(self) -> RuntimeError:
        package = self._qualified_name.split(".", 1)[0]
        return RuntimeError(
            f"{self._qualified_name} was used, but {package} is not installed: slime-rl put a CPU stand-in in its "
            "place so that SGLang's text-only CPU path imports (slime/plugins/sglang_engine/cpu_standins). Install a "
            f"real {package} built for this torch to use this feature."
        )

    def __getattr__(self, name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self._qualified_name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def __iter__(self) -> Any:
        raise self._refuse()

    def __mro_entries__(self, bases: tuple) -> tuple:
        raise self._refuse()

    def __repr__(self) -> str:
        return f"<unavailable {self._qualified_name}>"


class StandinModule(types.ModuleType):
    """A module of a package that is not installed: every public attribute is an `Unavailable`."""

    def __getattr__(self, name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{self.__name__}.{name}")


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every submodule of the stand-in packages as a `StandinModule` package."""

    def __init__(self, packages: frozenset[str]) -> None:
        self._packages = packages

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".", 1)[0] not in self._packages or "." not in fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(package: str) -> None:
    """Make every `package.sub.module` importable as a stand-in (called by the package's `__init__`)."""
    for finder in sys.meta_path:
        if isinstance(finder, _StandinFinder):
            finder._packages = finder._packages | {package}
            return
    sys.meta_path.insert(0, _StandinFinder(frozenset({package})))
