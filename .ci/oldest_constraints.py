"""Prints pip constraints that pin each dependency of pyproject.toml and engine/pyproject.toml to its floor (``>=X``
-> ``==X``); the engine itself (``steadfast``) is the vendored one.

`make test-oldest` installs with them, so each floor is a version the fast tests passed on, and moving a floor in
pyproject.toml is all it takes to test the new one. Extras keep their newest versions. Standard library only: it
runs before anything is installed.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
pins: dict[str, str] = {}
for pyproject in (ROOT / "engine" / "pyproject.toml", ROOT / "pyproject.toml"):
    # [project]'s dependency list, by hand: tomllib is Python 3.11+, and this runs on the machine's python3
    block = re.search(r"^dependencies = \[(.*?)^\]", pyproject.read_text(), flags=re.S | re.M).group(1)
    for line in re.findall(r'^\s*"([^"]+)"', block, flags=re.M):
        name = re.match(r"[A-Za-z0-9_.-]+", line).group()
        floors = re.findall(r">=\s*([^,;\s\]]+)", line)
        if len(floors) != 1:
            sys.exit(f"{line!r} in {pyproject.relative_to(ROOT)} needs exactly one '>=' floor for make test-oldest")
        if name != "steadfast" and pins.setdefault(name, floors[0]) != floors[0]:
            sys.exit(f"{name}: the floors of engine/pyproject.toml and pyproject.toml differ; make them one")
for name, floor in pins.items():
    print(f"{name}=={floor}")  # pip's constraints take no [extras]
