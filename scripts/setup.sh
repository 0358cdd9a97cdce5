#!/usr/bin/env bash
# Creates .venv with everything prefixcache needs and fetches the default model (once).
# torch==2.13.0 is pinned first: on this kind of machine pip takes its CPU build from local disk;
# elsewhere it comes from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
python -m prefixcache fetch
