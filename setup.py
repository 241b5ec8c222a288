"""Packaging beside pyproject.toml: ships ``profiles/`` inside the wheel.

The top-level ``profiles/`` folder is the one source of truth for hardware profiles
and cost-model data.  It is mapped onto the package ``autoplan._profiles`` (and
``profiles/cost`` onto ``autoplan._profiles.cost``), so a wheel carries the YAML
files at ``autoplan/_profiles/`` without a second copy in the source tree.  In a
checkout (``pip install -e .`` or ``PYTHONPATH``) ``autoplan/_profiles`` does not
exist and the loaders read ``profiles/`` directly (see
``autoplan.hardware.profiles.shipped_profiles_dir``).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["autoplan", "autoplan.*"]),
              "autoplan._profiles", "autoplan._profiles.cost"],
    package_dir={"autoplan._profiles": "profiles"},
    package_data={"autoplan": ["py.typed"],
                  "autoplan._profiles": ["*.yaml"],
                  "autoplan._profiles.cost": ["*.yaml"]},
    # profiles measured on this machine (`autoplan profile` before it wrote to
    # $AUTOPLAN_HOME) are local files, not part of the distribution
    exclude_package_data={"autoplan._profiles": ["local-*.yaml"]},
)
