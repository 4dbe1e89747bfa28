#!/usr/bin/env bash
# Quick start: install what is needed, then run the server with a working default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The default template (a minimal Debian) is built first, with its progress, where this
# server will look for it. Without a mirror the server still starts and says why: the `host`
# template needs no build, and `serve` tries the default again at start-up.
setup=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --data-dir | --template-dir) setup+=("${args[i]}" "${args[i + 1]:-}") ;;
    --default-template) setup+=(--template "${args[i + 1]:-}") ;;
    --data-dir=* | --template-dir=*) setup+=("${args[i]}") ;;
    --default-template=*) setup+=(--template "${args[i]#*=}") ;;
  esac
done
.venv/bin/agentbox setup "${setup[@]}" ||
  echo "agentbox: the default template is not ready; serve tries again at start-up" >&2
exec .venv/bin/agentbox serve "$@"
