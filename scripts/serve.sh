#!/usr/bin/env bash
# Quick start: install what is needed, then run the server with a working default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/agentbox serve "$@"
