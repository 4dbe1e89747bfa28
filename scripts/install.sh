#!/usr/bin/env bash
# Installs everything agentbox needs on Debian 12 (run as root) and builds .venv.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
[ -x /usr/bin/python3 ] || need_apt+=(python3)
command -v mkfs.ext4 >/dev/null || need_apt+=(e2fsprogs)
command -v losetup >/dev/null || need_apt+=(mount)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v ps >/dev/null || need_apt+=(procps)
# Templates are root filesystems built from Debian packages (no Docker, no registry).
command -v mmdebstrap >/dev/null || need_apt+=(mmdebstrap)
command -v node >/dev/null || need_apt+=(nodejs)
PY=${PYTHON:-python3}
if ! "$PY" -c "import ensurepip, venv" 2>/dev/null; then
  need_apt+=(python3-venv)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "agentbox: missing system packages: ${need_apt[*]} (run as root to install them)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The isolation tiers beyond `process`: `container` runs runc, `gvisor` runs runsc (their
# recommends, CRIU among them, are not needed).
need_oci=()
command -v runc >/dev/null || need_oci+=(runc)
command -v runsc >/dev/null || need_oci+=(runsc)
if [ ${#need_oci[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "agentbox: the container and gvisor tiers need: ${need_oci[*]} (run as root)" >&2
  else
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_oci[@]}" >/dev/null
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.agentbox-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
