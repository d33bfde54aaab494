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
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import accelerator_name, installed_ops
if accelerator_name == get_accelerator()._name:
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    AsyncIOBuilder().load(verbose=False)
    CPUAdamBuilder().load(verbose=False)
    print("smoke: deepspeed async_io and cpu_adam load without a compiler")
else:
    # The CUDA image built (and smoke-checked) on a host without a GPU: DeepSpeed loads a prebuilt op
    # only on the accelerator it was built for, so import the op modules themselves: each must load
    # without a compiler and without the NVIDIA driver.
    modules = {"async_io": "deepspeed.ops.aio.async_io_op", "cpu_adam": "deepspeed.ops.adam.cpu_adam_op",
               "fused_adam": "deepspeed.ops.adam.fused_adam_op", "pin_memory": "deepspeed.ops.pin_memory.pin_memory_op"}
    built = sorted(name for name, ok in installed_ops.items() if ok)
    assert set(built) <= set(modules), f"smoke: no module known for prebuilt ops {set(built) - set(modules)}"
    import ctypes
    # async_io resolves deepspeed_pin_tensor_t from the pin_memory op, which DeepSpeed loads first with
    # RTLD_GLOBAL (op_builder/pin_memory_load.py): the same order here.
    for name in sorted(built, key=lambda n: n != "pin_memory"):
        module = importlib.import_module(modules[name])
        if name == "pin_memory":
            ctypes.CDLL(module.__file__, mode=ctypes.RTLD_GLOBAL)
    print(f"smoke: deepspeed {', '.join(built)} (built for {accelerator_name}) load without a compiler or a driver")
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
