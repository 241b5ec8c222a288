"""Finding hardware profiles by name: the folders searched, in order, and loading
(cached by path, modification time and size)."""

from __future__ import annotations

import difflib
import os
from functools import lru_cache
from pathlib import Path

import yaml

from ..errors import ProfileError, UnknownProfileError
from .profile_records import CompositeProfile, Profile
from .profile_yaml import _YamlLoader, parse_profile

__all__ = ["PROFILES_ENV", "HOME_ENV", "shipped_profiles_dir", "user_profiles_dir", "profile_dirs",
           "available_profiles", "find_profile_file", "load_profile"]

#: Environment variable naming extra profile folders (``os.pathsep``-separated).
PROFILES_ENV = "AUTOPLAN_PROFILES"

#: Environment variable naming the user's autoplan folder (default ``~/.autoplan``);
#: its ``profiles/`` subfolder holds the profiles the user wrote or measured.
HOME_ENV = "AUTOPLAN_HOME"


# --------------------------------------------------------------------------- discovery


def shipped_profiles_dir() -> Path:
    """The shipped profiles: ``autoplan/_profiles`` in an installed wheel, else the
    checkout's top-level ``profiles/`` folder (an editable install or ``PYTHONPATH``).

    The wheel's folder is built from ``profiles/`` (``setup.py`` maps it), so the
    two are never separate copies to keep in step.
    """
    package = Path(__file__).resolve().parent.parent
    packaged = package / "_profiles"
    return packaged if packaged.is_dir() else package.parent / "profiles"


def user_profiles_dir() -> Path:
    """``$AUTOPLAN_HOME/profiles`` (default ``~/.autoplan/profiles``): the user's own profiles."""
    home = os.environ.get(HOME_ENV, "").strip()
    return (Path(home).expanduser() if home else Path.home() / ".autoplan") / "profiles"


def profile_dirs() -> list[Path]:
    """Folders searched for profiles, first match wins: ``$AUTOPLAN_PROFILES`` entries,
    the user's folder (:func:`user_profiles_dir`), then the shipped one."""
    extra = [Path(p) for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p.strip()]
    return [*extra, user_profiles_dir(), shipped_profiles_dir()]


def _profile_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for directory in profile_dirs():
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix in (".yaml", ".yml") and path.is_file() and not path.name.startswith("."):
                found.setdefault(path.stem, path)
    return found


def available_profiles() -> list[str]:
    """Names of every profile that :func:`load_profile` can find, sorted."""
    return sorted(_profile_files())


def _looks_like_path(name_or_path: str | os.PathLike[str]) -> bool:
    text = os.fspath(name_or_path)
    return (isinstance(name_or_path, os.PathLike) or os.sep in text or "/" in text
            or text.endswith((".yaml", ".yml")))


def find_profile_file(name_or_path: str | os.PathLike[str]) -> Path:
    """The file of a profile given by name or by path.

    Raises
    ------
    UnknownProfileError
        For an unknown name: lists the available profiles and suggests the closest.
    ProfileError
        For a path that does not exist.
    """
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise ProfileError("no such profile file", file=str(path))
        return path
    files = _profile_files()
    name = os.fspath(name_or_path)
    if name in files:
        return files[name]
    close = difflib.get_close_matches(name, list(files), n=3, cutoff=0.4)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    searched = ", ".join(str(d) for d in profile_dirs())
    raise UnknownProfileError(
        f"unknown profile {name!r}.{hint} Available: {', '.join(sorted(files)) or '(none)'} "
        f"(searched {searched}; add folders with ${PROFILES_ENV}, or pass a path to a .yaml file)")


@lru_cache(maxsize=128)
def _load_file(path: str, mtime_ns: int, size: int) -> Profile | CompositeProfile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read the file ({exc.strerror})", file=path) from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"not a YAML profile: byte {exc.start} is not UTF-8 text", file=path) from None
    try:
        data = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(f"not valid YAML{where}: {problem}", file=path) from None
    return parse_profile(data, file=path)


def load_profile(name_or_path: str | os.PathLike[str]) -> Profile | CompositeProfile:
    """Load a profile by name (see :func:`available_profiles`) or from a YAML file.

    Loaded files are cached by path, modification time and size.

    Examples
    --------
    >>> load_profile("v100-sxm2-32gb").device.resolve_dtype("bf16")
    'fp16'
    """
    path = find_profile_file(name_or_path)
    stat = path.stat()
    profile = _load_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if not _looks_like_path(name_or_path) and profile.name != os.fspath(name_or_path):
        raise ProfileError(f"the file is found by the name {os.fspath(name_or_path)!r} but declares "
                           f"name {profile.name!r}; rename the file or the profile",
                           file=str(path), path="name")
    return profile
