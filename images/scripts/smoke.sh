#!/usr/bin/env bash
# The image's own smoke check, run as the last build step: the package imports, every op loads
# from the prebuilt folder without a compiler, and `memascend doctor` runs.
set -euo pipefail
if command -v g++ gcc c++ cc >/dev/null 2>&1; then
  echo "smoke: a compiler is present in the runtime image" >&2
  exit 1
fi
python -c 'import memascend'
python - <<'PY'
import importlib, pkgutil
import torch  # noqa: F401 - the ops link against libtorch
import memascend.ops
for m in pkgutil.iter_modules(memascend.ops.__path__):
    if m.name != "build" and not m.name.startswith("_"):
        mod = importlib.import_module(f"memascend.ops.{m.name}").load()
        print(f"smoke: op {m.name} loaded from {mod.__file__}")
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
AsyncIOBuilder().load(verbose=False)
CPUAdamBuilder().load(verbose=False)
print("smoke: deepspeed async_io and cpu_adam load without a compiler")
PY
# Doctor: the checks that depend on the host (memlock, devices, GPU) are the run's business; here
# it must run and find libaio/liburing and every op; its table goes to the build log.
memascend doctor --no-gpu --json > /tmp/doctor.json || true
python - <<'PY'
import json
report = json.load(open("/tmp/doctor.json"))
by_name = {c["name"]: c for c in report["checks"]}
for c in report["checks"]:
    print(f"smoke: doctor {c['name']}: {c['status']} - {c['detail']}")
bad = [n for n, c in by_name.items() if (n.startswith("op ") and c["status"] != "pass") or (n in ("libaio", "liburing") and c["status"] not in ("pass", "warn"))]
assert not bad, f"doctor: not ready in the image: {bad}"
PY
rm -f /tmp/doctor.json
