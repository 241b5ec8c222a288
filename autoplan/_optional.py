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

import logging

__all__ = ["EXTRAS", "require", "install_hint", "quiet_torchao"]

#: The pip extra of ``pyproject.toml`` that installs each optional package.
EXTRAS: dict[str, str] = {"matplotlib": "plots", "transformers": "hf", "torchao": "fp8"}


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


class _DropMessages(logging.Filter):
    """Drops the records of one logger whose message contains any of ``parts``."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(p in message for p in self.parts)


_QUIET: list[tuple[str, _DropMessages]] = []


def quiet_torchao() -> None:
    """Keep what torchao logs when it is imported off the console: its CUDA kernels
    (``_C*.so``), which a CPU wheel cannot load ("Failed to load ..."), and torch's
    deprecation of its enums' pytree registration.  transformers imports torchao when it
    is installed (the ``fp8`` extra), so every command that builds a Hugging Face model
    would print them.  Only these messages of these two loggers are dropped; idempotent.
    """
    if _QUIET:
        return
    for name, parts in (("torchao", ("Failed to load",)),
                        ("torch.utils._pytree", ("is an Enum subclass and is now natively",))):
        f = _DropMessages(*parts)
        logging.getLogger(name).addFilter(f)
        _QUIET.append((name, f))
