"""Prints pip constraints that pin each of pyproject.toml's dependencies to its floor (``>=X`` -> ``==X``).

`make test-oldest` installs with them, so each floor is a version the fast tests passed on, and moving a floor in
pyproject.toml is all it takes to test the new one. Extras keep their newest versions. Standard library only: it
runs before anything is installed.
"""

import re
import sys
import tomllib
from pathlib import Path

pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
for line in pyproject["project"]["dependencies"]:
    name = re.match(r"[A-Za-z0-9_.-]+", line).group()
    floors = re.findall(r">=\s*([^,;\s\]]+)", line)
    if len(floors) != 1:
        sys.exit(f"{line!r} in pyproject.toml needs exactly one '>=' floor for make test-oldest")
    print(f"{name}=={floors[0]}")  # pip's constraints take no [extras]
