#!/usr/bin/env bash
# Debian packages the project needs on a fresh machine. Idempotent: installs only what is missing.
#   libibverbs1   mooncake's store.so and mooncake_master link it, even for TCP
#   the linter    shellcheck, for `make lint`
#   slurm + munge + mariadb  the emulated 8-node cluster used by the Slurm tests
set -euo pipefail
want=(libibverbs1 shellcheck)
if [ "${HPCTOOLKIT_NO_SLURM:-0}" != 1 ]; then
  want+=(slurm-wlm slurmdbd munge mariadb-server)
fi
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages: ${missing[*]} (run as root or install them)" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
