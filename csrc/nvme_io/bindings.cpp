// pybind11 bindings of the direct I/O engine (logic in engine.cpp, checksum in crc32c.cpp).
// A submitted tensor is kept alive by its job until Engine.wait returns for that job.
#include <torch/extension.h>

#include <cstdint>
#include <memory>

#include "crc32c.h"
#include "engine.h"

namespace py = pybind11;
using memascend::nvme_io::Engine;
using memascend::nvme_io::EngineConfig;
using memascend::nvme_io::JobResult;
using memascend::nvme_io::OpKind;
using memascend::nvme_io::SystemError;

namespace {

std::size_t checked_nbytes(const torch::Tensor& t, int64_t nbytes) {
  TORCH_CHECK(t.device().is_cpu(), "tensor must be on the CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "tensor must be contiguous");
  const auto have = static_cast<int64_t>(t.nbytes());
  if (nbytes < 0) return static_cast<std::size_t>(have);
  TORCH_CHECK(nbytes <= have, "nbytes ", nbytes, " exceeds the tensor's ", have, " bytes");
  return static_cast<std::size_t>(nbytes);
}

int64_t submit(Engine& e, OpKind op, const torch::Tensor& t, uint64_t offset, int64_t nbytes, bool want_crc) {
  const std::size_t n = checked_nbytes(t, nbytes);
  auto keep = std::make_shared<torch::Tensor>(t);
  void* ptr = t.data_ptr();
  py::gil_scoped_release no_gil;
  return e.submit(op, ptr, n, offset, want_crc, std::static_pointer_cast<void>(keep));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memascend direct I/O engine: io_uring + O_DIRECT on a raw block device or one file";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const SystemError& e) {
      py::object err = py::module_::import("builtins").attr("OSError")(e.errno_value, e.what());
      PyErr_SetObject(PyExc_OSError, err.ptr());
    }
  });

  py::class_<JobResult>(m, "JobResult", "Outcome of one submitted job (see Engine.wait).")
      .def_readonly("job_id", &JobResult::job_id)
      .def_readonly("error", &JobResult::error, "0, or the positive errno of the first failed request")
      .def_readonly("short_transfer", &JobResult::short_transfer,
                    "a request moved 0 bytes (end of device/file) before the job finished")
      .def_readonly("error_offset", &JobResult::error_offset, "device byte offset of the first failure")
      .def_readonly("bytes_done", &JobResult::bytes_done, "bytes transferred without error")
      .def_readonly("has_crc", &JobResult::has_crc, "crc32c is valid (asked for, and no error)")
      .def_readonly("crc32c", &JobResult::crc32c, "CRC32C of the job's bytes");

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
                                             "io_uring + O_DIRECT engine over one block device or file.")
      .def(py::init([](const std::string& path, unsigned queue_depth, std::size_t request_bytes,
                       bool enable_direct, bool enable_exclusive, const std::string& backend) {
             EngineConfig c;
             c.path = path;
             c.queue_depth = queue_depth;
             c.request_bytes = request_bytes;
             c.enable_direct = enable_direct;
             c.enable_exclusive = enable_exclusive;
             c.backend = backend;
             return std::make_shared<Engine>(c);
           }),
           py::arg("path"), py::arg("queue_depth") = 32, py::arg("request_bytes") = std::size_t{8} << 20,
           py::arg("enable_direct") = true, py::arg("enable_exclusive") = true, py::arg("backend") = "auto",
           "Open `path` (O_RDWR|O_DIRECT; O_EXCL on block devices, flock on files) with an io_uring of `queue_depth` "
           "entries (backend 'auto': io_uring, else libaio); jobs are split into requests of `request_bytes` (rounded up to align_bytes). "
           "Raises OSError (EBUSY when a block device is mounted or claimed, or a file is locked by "
           "another engine) or ValueError.")
      .def(
          "submit_write",
          [](Engine& e, const torch::Tensor& t, uint64_t offset, int64_t nbytes, bool want_crc) {
            return submit(e, OpKind::kWrite, t, offset, nbytes, want_crc);
          },
          py::arg("tensor"), py::arg("offset"), py::arg("nbytes") = -1, py::arg("want_crc") = false,
          "Queue a write of the first `nbytes` (-1: all) of a contiguous CPU tensor to device byte "
          "`offset` (a multiple of align_bytes); returns the job id.")
      .def(
          "submit_read",
          [](Engine& e, const torch::Tensor& t, uint64_t offset, int64_t nbytes, bool want_crc) {
            return submit(e, OpKind::kRead, t, offset, nbytes, want_crc);
          },
          py::arg("tensor"), py::arg("offset"), py::arg("nbytes") = -1, py::arg("want_crc") = false,
          "Queue a read of `nbytes` (-1: the tensor's size) from device byte `offset` into a "
          "contiguous CPU tensor; returns the job id.")
      .def("wait", &Engine::wait, py::arg("job_id"), py::call_guard<py::gil_scoped_release>(),
           "Block until the job finishes; returns its JobResult (each job is waited for once).")
      .def("done", &Engine::done, py::arg("job_id"), "Whether the job has finished.")
      .def("outstanding", &Engine::outstanding, "Jobs submitted and not yet waited for.")
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>(),
           "Drain in-flight requests, stop the worker, close the descriptor (idempotent).")
      .def_property_readonly("size_bytes", &Engine::size_bytes)
      .def_property_readonly("logical_block_bytes", &Engine::logical_block_bytes)
      .def_property_readonly("align_bytes", &Engine::align_bytes)
      .def_property_readonly("is_block_device", &Engine::is_block_device)
      .def_property_readonly("queue_depth", &Engine::queue_depth)
      .def_property_readonly("request_bytes", &Engine::request_bytes)
      .def_property_readonly("direct", &Engine::direct)
      .def_property_readonly("backend", &Engine::backend, "'io_uring' or 'libaio'")
      .def_property_readonly("single_issuer", &Engine::single_issuer,
                             "True when the worker thread is the ring's only issuer (IORING_SETUP_SINGLE_ISSUER | "
                             "DEFER_TASKRUN, Linux 6.1+); False on libaio or an older kernel")
      .def_property_readonly("bounce_bytes_allocated", &Engine::bounce_bytes_allocated);

  m.def(
      "crc32c",
      [](const torch::Tensor& t, int64_t nbytes, uint32_t crc) {
        const std::size_t n = checked_nbytes(t, nbytes);
        const void* p = t.data_ptr();
        py::gil_scoped_release no_gil;
        return memascend::nvme_io::crc32c(crc, p, n);
      },
      py::arg("tensor"), py::arg("nbytes") = -1, py::arg("crc") = 0,
      "CRC32C of the first `nbytes` (-1: all) of a contiguous CPU tensor, continuing `crc`.");
  m.def(
      "crc32c_bytes",
      [](py::bytes data, uint32_t crc) {
        std::string_view v(data);
        return memascend::nvme_io::crc32c(crc, v.data(), v.size());
      },
      py::arg("data"), py::arg("crc") = 0, "CRC32C of a bytes object, continuing `crc`.");
  m.def("crc32c_hardware", &memascend::nvme_io::crc32c_hardware, "Whether SSE4.2 crc32 is used.");
  m.def(
      "aligned_empty",
      [](int64_t nbytes, int64_t align_bytes) {
        TORCH_CHECK(nbytes >= 0, "nbytes must be >= 0");
        TORCH_CHECK(align_bytes > 0 && (align_bytes & (align_bytes - 1)) == 0, "align_bytes must be a power of 2");
        void* p = memascend::nvme_io::aligned_alloc_bytes(static_cast<std::size_t>(nbytes),
                                                          static_cast<std::size_t>(align_bytes));
        return torch::from_blob(p, {nbytes}, [](void* q) { std::free(q); },
                                torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU));
      },
      py::arg("nbytes"), py::arg("align_bytes") = 4096,
      "Uninitialized uint8 CPU tensor of `nbytes` whose data is `align_bytes`-aligned (O_DIRECT "
      "transfers it in place, without bounce buffers). Not pinned/locked.");
}
