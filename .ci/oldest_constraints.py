"""Prints pip constraints that pin each requirement of the engine (``engine/requirements/core.txt``) and the example
(``requirements/example.txt``) to its floor (``>=X`` -> ``==X``).

`make test-oldest` installs with them, so each floor is a version the fast tests passed on, and moving a floor in a
requirements file is all it takes to test the new one. Extras keep their newest versions. Standard library only: it
runs before anything is installed.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
pins: dict[str, str] = {}
for path in (ROOT / "engine" / "requirements" / "core.txt", ROOT / "requirements" / "example.txt"):
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", line).group()
        floors = re.findall(r">=\s*([^,;\s\]]+)", line)
        if len(floors) != 1:
            sys.exit(f"{line!r} in {path.relative_to(ROOT)} needs exactly one '>=' floor for make test-oldest")
        if pins.setdefault(name, floors[0]) != floors[0]:
            sys.exit(f"{name}: two floors in the requirements files; make them one")
for name, floor in pins.items():
    print(f"{name}=={floor}")  # pip's constraints take no [extras]
