// pybind11 bindings of the fused inf/nan check (logic in overflow_check.cpp / _cuda.cu).
#include <torch/extension.h>

#include <stdexcept>

#include "overflow_check.h"

#ifdef MEMASCEND_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace py = pybind11;
using memascend::FloatKind;

namespace {

bool float_kind(at::ScalarType dtype, FloatKind* kind) {
  switch (dtype) {
    case at::kHalf:
      *kind = FloatKind::kF16;
      return true;
    case at::kBFloat16:
      *kind = FloatKind::kBF16;
      return true;
    case at::kFloat:
      *kind = FloatKind::kF32;
      return true;
    case at::kDouble:
      *kind = FloatKind::kF64;
      return true;
    default:
      return false;
  }
}

bool has_inf_or_nan(const torch::Tensor& t) {
  FloatKind kind{};
  if (!float_kind(t.scalar_type(), &kind)) {
    throw std::invalid_argument("has_inf_or_nan: dtype must be float16, bfloat16, float32 or float64");
  }
  if (!t.is_contiguous()) throw std::invalid_argument("has_inf_or_nan: tensor must be contiguous");
  if (t.numel() == 0) return false;
  if (t.device().is_cpu()) {
    const void* data = t.data_ptr();
    const int64_t numel = t.numel();
    py::gil_scoped_release no_gil;
    return memascend::has_inf_or_nan_cpu(data, numel, kind);
  }
#ifdef MEMASCEND_WITH_CUDA
  if (t.device().is_cuda()) {
    const c10::cuda::CUDAGuard guard(t.device());
    auto flag = torch::zeros({1}, t.options().dtype(torch::kInt32));
    const int err = memascend_launch_has_inf_or_nan(t.data_ptr(), t.numel(), static_cast<int>(kind),
                                                    flag.data_ptr<int>(),
                                                    c10::cuda::getCurrentCUDAStream().stream());
    if (err != 0) throw std::runtime_error("has_inf_or_nan: CUDA kernel launch failed, cudaError " + std::to_string(err));
    return flag.item<int>() != 0;
  }
#endif
  throw std::invalid_argument("has_inf_or_nan: unsupported device " + t.device().str());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused inf/nan check (memascend csrc/overflow_check)";
#ifdef MEMASCEND_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("has_inf_or_nan", &has_inf_or_nan, py::arg("tensor"),
        "True when a contiguous float16/bfloat16/float32/float64 tensor (CPU, or CUDA when built "
        "with CUDA) holds +-inf or nan. One pass, no temporary, early exit.");
}
