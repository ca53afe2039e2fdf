"""Prints pip constraints that pin each of pyproject.toml's dependencies to its floor (``>=X`` -> ``==X``).

`make test-oldest` installs with them, so each floor is a version the fast tests passed on, and moving a floor in
pyproject.toml is all it takes to test the new one. Extras keep their newest versions. Standard library only: it
runs before anything is installed.
"""

import re
import sys
from pathlib import Path

# [project]'s dependency list, by hand: tomllib is Python 3.11+, and this runs on the machine's python3
text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
block = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
for line in re.findall(r'^\s*"([^"]+)"', block, flags=re.M):
    name = re.match(r"[A-Za-z0-9_.-]+", line).group()
    floors = re.findall(r">=\s*([^,;\s\]]+)", line)
    if len(floors) != 1:
        sys.exit(f"{line!r} in pyproject.toml needs exactly one '>=' floor for make test-oldest")
    print(f"{name}=={floors[0]}")  # pip's constraints take no [extras]
