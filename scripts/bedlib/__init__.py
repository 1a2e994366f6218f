"""scripts/bed.py's parts: ``common`` (settings, errors), ``pypi`` (versions, PyPI metadata),
``recipe`` (what an env installs), ``envs`` (building, gating and reusing envs). Stdlib only."""
