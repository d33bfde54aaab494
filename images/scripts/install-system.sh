#!/usr/bin/env bash
# Installs the system packages of one image stage.
#   install-system.sh build     Python with headers, C++ toolchain, libaio/liburing headers
#   install-system.sh runtime   Python and the libaio/liburing shared libraries only (no compilers)
# Also creates the non-root user "memascend" in group "memascend" (GID shared with the Ansible
# role nvme_raw, whose udev rule gives that group the raw NVMe partitions).
set -euo pipefail
phase=${1:?usage: install-system.sh build|runtime}
gid=${MEMASCEND_GID:-2300}
export DEBIAN_FRONTEND=noninteractive

apt-get update -qq
# Debian bookworm calls it libaio1, Ubuntu 24.04 libaio1t64.
libaio=libaio1
apt-cache show libaio1t64 >/dev/null 2>&1 && libaio=libaio1t64
pkgs=(python3 python3-venv ca-certificates "$libaio" liburing2)
if [[ $phase == build ]]; then
  pkgs+=(python3-dev python3-pip g++ make libaio-dev liburing-dev git)
fi
apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
apt-get clean
rm -rf /var/lib/apt/lists/*

if [[ $phase == runtime ]]; then
  getent group memascend >/dev/null || groupadd --system --gid "$gid" memascend
  id memascend >/dev/null 2>&1 || useradd --system --uid "$gid" --gid memascend --create-home --shell /bin/bash memascend
fi
