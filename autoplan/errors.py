"""The one exception hierarchy of autoplan.

Every error a user can meet derives from :class:`AutoplanError`.  Each message
says what was wrong and what to do about it.  The search catches only
:class:`InfeasiblePlan` (a candidate that does not fit) and counts it.
"""

from __future__ import annotations

__all__ = [
    "AutoplanError",
    "ConfigError",
    "RecordError",
    "TraceError",
    "InputError",
    "ProfileError",
    "UnknownProfileError",
    "StrategyError",
    "InfeasiblePlan",
    "PlanMismatchError",
    "CheckpointError",
    "UserCodeError",
    "MissingDependencyError",
]


class AutoplanError(Exception):
    """Base class of every error raised by autoplan."""


class ConfigError(AutoplanError, ValueError):
    """An argument or option cannot work as given."""


class RecordError(AutoplanError, ValueError):
    """A serialized record (JSON) is malformed: a missing, unknown or ill-typed field.

    ``path`` names the offending field, e.g. ``layers[3].tp.linears[0].role``.
    """

    def __init__(self, message: str, path: str = "") -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class TraceError(AutoplanError):
    """A model could not be captured.

    ``module_path`` names the submodule where tracing broke and ``source_line``
    the line of user code, when they are known.
    """

    def __init__(self, message: str, *, module_path: str | None = None,
                 source_line: str | None = None) -> None:
        self.module_path = module_path
        self.source_line = source_line
        super().__init__(message)


class InputError(TraceError, ValueError):
    """Missing or mismatched example inputs (names the argument and expected shape)."""


class ProfileError(AutoplanError, ValueError):
    """A hardware profile is malformed: names the file, the field path and what was expected."""

    def __init__(self, message: str, *, file: str | None = None, path: str = "") -> None:
        self.file = file
        self.path = path
        where = ":".join(p for p in (file or "", path) if p)
        super().__init__(f"{where}: {message}" if where else message)


class UnknownProfileError(ProfileError, KeyError):
    """A profile name that is not shipped; the message lists the available ones."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0] if self.args else ""


class StrategyError(AutoplanError, ValueError):
    """A parallel layout whose degrees do not fit the world, model or batch."""


class InfeasiblePlan(AutoplanError):
    """No layout fits: says the memory it would need, what binds, and what would help."""

    def __init__(self, message: str, *, required_bytes: float | None = None,
                 available_bytes: float | None = None, binding: str | None = None) -> None:
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes
        self.binding = binding
        super().__init__(message)


class PlanMismatchError(AutoplanError, ValueError):
    """A plan that does not match the model or the world it is applied to."""


class CheckpointError(AutoplanError):
    """A checkpoint that is missing, partial or corrupt."""


class UserCodeError(AutoplanError):
    """The user's own code failed: a model file that does not import, or a factory or
    model that raises.  ``file`` and ``line`` point into that code (the innermost frame
    there), so the message reads as the user's error, not autoplan's."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None) -> None:
        self.file = file
        self.line = line
        super().__init__(message)


class MissingDependencyError(AutoplanError, ImportError):
    """An optional package a feature needs is not installed; the message gives the
    ``pip install`` line that adds it.  ``package`` is the missing import name."""

    def __init__(self, message: str, *, package: str) -> None:
        self.package = package
        super().__init__(message)
