"""Names a package hands out on first use, without importing their modules up front.

A package whose entry points pull in heavy stacks (torch.distributed's tensor, FSDP and
pipelining code; matplotlib) lists them in a name -> module mapping and gets its module
``__getattr__`` and ``__dir__`` (PEP 562) from :func:`lazy_names`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Iterable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: str, lazy: Mapping[str, str], public: Iterable[str] = ()
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for its ``lazy`` names.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    lazy : mapping of str to str
        Attribute name -> the module that defines it, relative to ``package``
        (``".runtime"``) or absolute.
    public : iterable of str
        The package's ``__all__``: ``dir(package)`` lists these besides its globals.

    Returns
    -------
    (__getattr__, __dir__)
        ``__getattr__(name)`` imports the name's module, keeps the value in the
        package's namespace (the next lookup does not come back here) and returns it;
        any other name raises :class:`AttributeError`.

    Examples
    --------
    In a package's ``__init__.py``::

        __getattr__, __dir__ = lazy_names(__name__, {"parallelize": ".runtime"}, __all__)
    """
    public = tuple(public)

    def __getattr__(name: str) -> Any:
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
