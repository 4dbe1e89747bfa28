#!/usr/bin/env bash
# Regenerates the Python code of E2B's envd services (proto/envd) that agentbox serves:
# messages by protoc-gen-py (protobuf-py), Connect stubs by protoc-gen-connectrpc. The output is
# committed (src/agentbox/server/e2b/wire); a run needs only PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/pip" install -q grpcio-tools "protoc-gen-py==0.7.*" "protoc-gen-connectrpc==0.13.*"
out=src/agentbox/server/e2b/wire
rm -rf "$out/process" "$out/filesystem"
PATH="$tools/bin:$PATH" "$tools/bin/python" -m grpc_tools.protoc -I proto/envd \
  --py_out="$out" --connectrpc_out="$out" process/process.proto filesystem/filesystem.proto
echo '"""Generated code of E2B'"'"'s envd Connect services (proto/envd; scripts/gen-envd.sh)."""' \
  > "$out/__init__.py"
