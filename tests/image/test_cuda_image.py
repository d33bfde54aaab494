"""Builds the CUDA image for real here (no GPU, no registry: a debootstrap base, PyPI's CUDA torch and
NVIDIA's nvcc wheels) and checks what it carries (opt-in: -m image).

The ops must be compiled with CUDA (memascend's overflow check with its ``.cu`` kernel for the listed
architectures, DeepSpeed's fused Adam), the runtime stage must hold no compiler (nvcc included), and
the image's own smoke (every op imports without a compiler or a driver) passes on this GPU-less host,
where a fine-tune stops with one line (DeepSpeed would have to JIT-build its ops for the CPU)."""

from __future__ import annotations

import json
import os

import pytest

from tests.image.test_image_build import _FINETUNE, _JIT_MARKERS, _run, ensure_image, working_container

TAG = os.environ.get("MEMASCEND_TEST_CUDA_IMAGE", "localhost/memascend:cuda")

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.root]


@pytest.fixture(scope="module")
def cuda_container(request):
    """A working container of the CUDA image (built unless it exists), with the seccomp profile that
    lets DeepSpeed's aio wait for completions; removed afterwards."""
    ensure_image(request, "cuda", TAG, "build-ops: memascend overflow_check WITH_CUDA, deepspeed fused_adam prebuilt",
                 30)
    with working_container(TAG, "--security-opt", "seccomp=unconfined") as name:
        yield name


_CUDA_FACTS = r"""
import glob, json, os, subprocess
import torch
import memascend.ops.overflow_check as oc, memascend.ops.pinned_arena as pa
from deepspeed.git_version_info import installed_ops
import deepspeed.ops.adam as adam
overflow = oc.load()
fused = glob.glob(os.path.join(os.path.dirname(adam.__file__), "fused_adam_op*.so"))
facts = {
    "torch": torch.__version__, "cuda": torch.version.cuda,
    "overflow_with_cuda": bool(overflow.WITH_CUDA), "overflow_file": overflow.__file__,
    "overflow_sm_90": b"sm_90" in open(overflow.__file__, "rb").read(),
    "arena_file": pa.load().__file__,
    "fused_adam_prebuilt": bool(installed_ops.get("fused_adam")), "fused_adam_files": fused,
    "fused_adam_sm_90": any(b"sm_90" in open(f, "rb").read() for f in fused),
    "nvcc": glob.glob("/opt/memascend/venv/**/bin/nvcc", recursive=True),
}
print(json.dumps(facts))
"""


def test_cuda_image_ops_carry_cuda_and_no_compiler(cuda_container):
    run = _run(cuda_container, "python", "-c", _CUDA_FACTS)
    assert run.returncode == 0, run.stderr[-4000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["torch"].startswith("2.13.0") and facts["cuda"] == "13.0", facts
    assert facts["overflow_with_cuda"] and facts["overflow_sm_90"], facts
    assert facts["overflow_file"].startswith("/opt/memascend/prebuilt/"), facts
    assert facts["arena_file"].startswith("/opt/memascend/prebuilt/"), facts
    assert facts["fused_adam_prebuilt"] and facts["fused_adam_files"] and facts["fused_adam_sm_90"], facts
    assert facts["nvcc"] == [], facts
    assert _run(cuda_container, "sh", "-c", "command -v g++ gcc cc c++ nvcc").stdout.strip() == ""


def test_cuda_image_without_a_gpu_stops_with_one_line(cuda_container):
    """On a host without a GPU, DeepSpeed falls back to its CPU accelerator and would JIT-build every op
    (it loads prebuilt ops only on the accelerator they were built for), which the image cannot: no
    compiler. The run stops before anything heavy with one line naming the fix, not a ninja traceback.
    (The CPU image's tests run the fine-tune smoke; this image's ops need a GPU.)"""
    run = _run(cuda_container, *_FINETUNE, timeout=900, user="0:0")
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-4000:]
    assert "built for the cuda accelerator" in errors[0] and "--gpus all" in errors[0], errors
    assert "Traceback" not in run.stderr and not [m for m in _JIT_MARKERS if m in run.stdout + run.stderr]
