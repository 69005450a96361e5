"""Prints every requirement of pyproject.toml (runtime and extras), one a line."""

import sys
import tomllib

with open(sys.argv[1], "rb") as handle:
    project = tomllib.load(handle)["project"]
requirements = list(project["dependencies"])
for extra in project.get("optional-dependencies", {}).values():
    requirements += extra
# The editable install skips build isolation, so its backend is needed here too.
print("\n".join(["setuptools>=68", "wheel", *requirements]))
