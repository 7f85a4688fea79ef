"""Maps the top-level folders onto the `commitgate` namespace and finds their subpackages.

pyproject.toml holds everything else; setuptools cannot discover packages under a renamed
directory from pyproject alone, so this is the one place that does it. `client/` is not mapped
here: it is its own distribution, `commitgate-client` (client/pyproject.toml), which this one requires.
"""

from setuptools import find_packages, setup

_ROOTS = {
    "commitgate.server": "server",
    "commitgate.tools": "tools",
    "commitgate.policies": "policies",
}

# Folders of data files only (no __init__.py): declared as packages too, so setuptools ships their
# package-data without warning that they are "absent from the packages configuration".
_DATA_FOLDERS = ["commitgate.server.console.static", "commitgate.server.console.templates"]

setup(
    package_dir=_ROOTS,
    packages=[
        *(
            f"{name}.{sub}" if sub else name
            for name, folder in _ROOTS.items()
            for sub in ["", *find_packages(folder)]
        ),
        *_DATA_FOLDERS,
    ],
)
