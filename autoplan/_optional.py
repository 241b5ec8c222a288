"""Optional dependencies: the one place that says which pip extra adds each.

A plain ``pip install autoplan`` plans, estimates, compares clusters and emits
training scripts; the extras add capabilities (Hugging Face models, figures,
notebooks).  :func:`require` imports an optional package or raises
:class:`~autoplan.errors.MissingDependencyError` with the line that installs it.

Examples
--------
>>> require("json", "JSON records").__name__     # an installed module comes back
'json'
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

__all__ = ["EXTRAS", "require", "install_hint"]

#: The pip extra of ``pyproject.toml`` that installs each optional package.
EXTRAS: dict[str, str] = {"matplotlib": "plots", "transformers": "hf"}


def install_hint(package: str) -> str:
    """``pip install 'autoplan[EXTRA]'``, and the bare package as an alternative."""
    extra = EXTRAS.get(package)
    if extra is None:
        return f"pip install {package}"
    return f"pip install 'autoplan[{extra}]' (or: pip install {package})"


def require(package: str, what: str) -> ModuleType:
    """Import ``package`` for ``what``, a plural noun phrase ("the HTML report's figures":
    the message reads "the HTML report's figures need matplotlib, ...").

    Raises
    ------
    MissingDependencyError
        When ``package`` is not installed; the message names what needs it and how
        to install it.  A package that is installed but fails to import raises its
        own error.
    """
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != package.split(".")[0]:
            raise       # the package is there; one of its own imports is missing
        raise MissingDependencyError(f"{what} need {package}, which is not installed: "
                                     f"{install_hint(package)}", package=package) from None
