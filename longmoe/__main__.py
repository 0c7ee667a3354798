"""`python -m longmoe`.

`python -m` puts the working directory first on sys.path. Run from the folder that holds a clone
named `longmoe`, that clone (a folder without `__init__.py`) imports as a namespace package ahead
of the installed package, and its top-level folders (bench/, backends/, tuning/) then stand in
for our subpackages. Before anything else of longmoe is imported, such entries leave sys.path
(for this process and the ranks it spawns, which inherit it) and `longmoe` is imported again.
Nothing here may import longmoe before that.
"""

import os
import sys


def _shadows(entry: str) -> bool:
    """True when `entry` holds a folder named longmoe that is no regular package."""
    folder = os.path.join(entry or os.getcwd(), "longmoe")
    return os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "__init__.py"))


def _import_the_package():
    shadowing = [p for p in sys.path if _shadows(p)]
    if not shadowing:
        return
    sys.path[:] = [p for p in sys.path if p not in shadowing]
    pkg = sys.modules.get("longmoe")
    if pkg is not None and getattr(pkg, "__file__", None) is None:  # the namespace stand-in
        for name in [m for m in sys.modules if m == "longmoe" or m.startswith("longmoe.")]:
            del sys.modules[name]


_import_the_package()

from longmoe.cli import main  # noqa: E402

sys.exit(main())
