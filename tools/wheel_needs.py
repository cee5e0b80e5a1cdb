"""What the wheels in a folder need that is neither among them nor in a list of installed names.

    python tools/wheel_needs.py .whl NAME...    # prints the missing requirements, space separated

The GPU check carries wheels a lent machine's image lacks and installs them with `--no-deps` (no
network there), so a requirement left behind fails only there, at import. This reads each
wheel's METADATA (`Requires-Dist`, markers evaluated for Python 3.12 on Linux, extras skipped)
and prints every required name that is neither carried nor in NAME... (the image's packages).
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "extra": ""}  # fmt: skip


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> tuple[str, list[str]]:
    """(the wheel's project name, the names it requires on the target)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    name = re.search(r"^Name: (.+)$", text, re.M)
    needs = []
    for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
        requirement = Requirement(line)
        if requirement.marker is None or Marker(str(requirement.marker)).evaluate(TARGET):
            needs.append(canonical(requirement.name))
    return canonical(name[1] if name else wheel.name.split("-")[0]), needs


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    folder, installed = Path(argv[0]), {canonical(n) for n in argv[1:]}
    wheels = [requirements(w) for w in sorted(folder.glob("*.whl"))]
    carried = {name for name, _ in wheels}
    missing = sorted({n for _, needs in wheels for n in needs} - carried - installed)
    print(" ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
