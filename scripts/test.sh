#!/usr/bin/env bash
# Install what is needed, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# docs/API.md's curl session is run by the tests (tests/integration/test_api_docs.py).
if ! command -v curl >/dev/null || ! command -v jq >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl jq >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
