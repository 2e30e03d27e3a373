"""Run by `agentstack env import` in the new package: loads the verifiers environment
the way the server will, and prints what it found as one JSON line after a marker
(anything the environment prints itself comes before it)."""

import json
from pathlib import Path

from server.bridge import ENV, describe

facts = describe(ENV)

# The copied environment's own dependencies, when it is a project with a pyproject.toml.
facts["dependencies"] = []
pyproject = Path("source/pyproject.toml")
if pyproject.is_file():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = None
    if tomllib is not None:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        facts["dependencies"] = [str(d) for d in project.get("dependencies", [])]

print("AGENTSTACK_PROBE " + json.dumps(facts), flush=True)
