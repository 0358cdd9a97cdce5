"""Where the field's load generators (and other engines run from their own venvs) are installed.

Apart from :mod:`prefixcache.bench.field` so that a module that only needs the folder (``venv_engine``) does not
import the field benchmark, which imports the speed benchmark that imports it back.
"""

from __future__ import annotations

import os
from pathlib import Path

VENVS_ENV = "PREFIXCACHE_FIELD_VENVS"


def venvs_dir() -> Path:
    """Where the tools' venvs live: ``$PREFIXCACHE_FIELD_VENVS``, else ``.venv-field`` beside ``.venv`` in this
    checkout, else ``~/.cache/prefixcache/field-venvs`` (an installed wheel)."""
    if os.environ.get(VENVS_ENV):
        return Path(os.environ[VENVS_ENV])
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".venv-field"
    return Path.home() / ".cache" / "prefixcache" / "field-venvs"
