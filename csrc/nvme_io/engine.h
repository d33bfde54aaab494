// Direct I/O engine of the device store (MemAscend, arXiv 2505.23254, "direct NVMe engine").
//
// One Engine owns one file descriptor (a raw block device or one preallocated regular file),
// opened with O_DIRECT, and one io_uring of `queue_depth` entries. A job (one tensor's bytes at
// one device offset) is split into requests of at most `request_bytes`; requests of all jobs share
// the ring, so up to `queue_depth` of them are in flight at once. Callers submit from any thread:
// submit() only queues requests. One worker thread is the ring's only issuer (set up with
// IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN where the kernel has them, 6.1+): it
// fills the ring from the pending queue, submits and sleeps in one io_uring_enter until a
// completion or a kick from submit() (an eventfd whose read it keeps armed in the ring), reaps
// completions and resubmits the rest of a short transfer. (libaio: submit() issues, the worker
// reaps.) Memory that is not aligned for O_DIRECT (or a length that is not a
// multiple of the block) goes through bounce buffers (at most `queue_depth` of `request_bytes`,
// allocated on first need); aligned memory is transferred in place.
//
// Replaces DeepSpeed's csrc/aio (libaio, file-per-tensor, opened per request, whose read path
// aborts on a block device because it sizes the file with stat()). No torch dependency: the pybind
// layer (bindings.cpp) passes addresses and keeps tensors alive through the job's keep-alive token.
#pragma once

#include <libaio.h>
#include <liburing.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace memascend::nvme_io {

// An OS call failed; carries errno so the bindings raise OSError(errno, message).
class SystemError : public std::runtime_error {
 public:
  SystemError(int err, const std::string& what) : std::runtime_error(what), errno_value(err) {}
  int errno_value;
};

enum class OpKind : int { kRead = 0, kWrite = 1 };

struct EngineConfig {
  std::string path;                      // block device node or regular file
  unsigned queue_depth = 32;             // io_uring entries = requests in flight at most
  std::size_t request_bytes = 8u << 20;  // largest single request; a multiple of align_bytes
  bool enable_direct = true;             // O_DIRECT (bypass the page cache)
  std::string backend = "auto";          // "io_uring", "libaio", or "auto" (io_uring, else libaio)
  bool enable_exclusive = true;          // O_EXCL on block devices (EBUSY when mounted/claimed),
                                         // flock(LOCK_EX) on files (EBUSY when another store has it)
};

// Outcome of one job, returned by Engine::wait.
struct JobResult {
  std::int64_t job_id = 0;
  int error = 0;                   // 0, or the positive errno of the first failed request
  bool short_transfer = false;     // a request moved 0 bytes (end of file/device) before finishing
  std::uint64_t error_offset = 0;  // device byte offset of the first failure
  std::uint64_t bytes_done = 0;    // bytes of the job transferred without error
  bool has_crc = false;            // crc32c below is valid (asked for, and no error)
  std::uint32_t crc32c = 0;        // CRC32C of the job's nbytes (written or read)
};

class Engine {
 public:
  explicit Engine(const EngineConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue a transfer of `nbytes` between host memory `buf` and device byte `offset`.
  // `offset` must be a multiple of align_bytes(); the device range [offset, offset +
  // round_up(nbytes, align_bytes())) must lie inside size_bytes(). For a write the tail of the last
  // block past nbytes is written as zeros. With `want_crc`, the CRC32C of the buffer is computed
  // on the calling threads: for a write by submit(), after its requests are queued, while they are
  // in flight; for a read by wait(), over each leading run of completed requests while the rest
  // are in flight. `keep_alive` is held until the job is waited for (the bindings put the tensor
  // owning `buf` there).
  // Throws std::invalid_argument on a misaligned or out-of-range request, std::logic_error after
  // close().
  std::int64_t submit(OpKind op, void* buf, std::size_t nbytes, std::uint64_t offset, bool want_crc,
                      std::shared_ptr<void> keep_alive = nullptr);

  // Block until job `job_id` has finished and return its result; each job is waited for once.
  // Throws std::out_of_range for an unknown (or already waited) id.
  JobResult wait(std::int64_t job_id);

  // Whether job `job_id` has finished (wait() will not block).
  bool done(std::int64_t job_id);

  // Number of jobs submitted and not yet waited for.
  std::size_t outstanding();

  // Drain everything in flight, stop the worker, close the descriptor. Idempotent.
  void close();

  std::uint64_t size_bytes() const { return size_bytes_; }
  std::size_t logical_block_bytes() const { return logical_block_bytes_; }
  std::size_t align_bytes() const { return align_bytes_; }
  bool is_block_device() const { return is_block_device_; }
  unsigned queue_depth() const { return config_.queue_depth; }
  std::size_t request_bytes() const { return config_.request_bytes; }
  bool direct() const { return config_.enable_direct; }
  // "io_uring" or "libaio": the kernel interface in use.
  const char* backend() const { return use_uring_ ? "io_uring" : "libaio"; }
  // Whether the ring was set up SINGLE_ISSUER | DEFER_TASKRUN (false on libaio and before 6.1).
  bool single_issuer() const { return use_uring_ && single_issuer_; }
  std::size_t bounce_bytes_allocated();

 private:
  struct Job;
  struct Request {
    Job* job;
    unsigned char* user;     // job memory this request covers
    std::size_t user_bytes;  // bytes of job memory covered
    std::size_t io_bytes;    // bytes moved on the device (user_bytes rounded up to the block)
    std::uint64_t offset;    // device byte offset of the request's first byte
    std::size_t done_bytes = 0;
    std::size_t index = 0;   // position of the request in its job
    int bounce = -1;         // bounce slot in use, or -1 for in-place
    bool needs_bounce = false;
    iocb cb{};               // libaio control block (must live until the request completes)
  };
  struct Job {
    std::int64_t id;
    OpKind op;
    unsigned char* buf;
    std::size_t nbytes;
    bool want_crc;
    std::size_t remaining;  // requests not finished
    bool finished = false;
    bool crc_pending = false;  // a write's checksum is still being computed by its submitter
    bool waited = false;       // a wait() for it is in progress (it erases the job when done)
    std::vector<unsigned char> request_done;  // reads with a checksum: which requests completed
    JobResult result;
    std::shared_ptr<void> keep_alive;
  };

  // Sets up the ring (queue_depth + 1 entries); returns 0 or a negative errno.
  int init_ring();
  // Wakes the io_uring worker from io_uring_enter (an eventfd write its armed read completes on).
  void kick_worker();
  void worker_loop();
  void worker_loop_aio();
  void submit_aio_locked(std::vector<Request*>& batch);
  void issue_pending_locked();
  void complete_locked(Request* req, int res);
  void finish_request_locked(Request* req);
  // Whether the waiters must be woken after this batch of completions (clears the flag).
  bool take_wake_locked();

  EngineConfig config_;
  int fd_ = -1;
  std::uint64_t size_bytes_ = 0;
  std::size_t logical_block_bytes_ = 512;
  std::size_t align_bytes_ = 4096;
  bool is_block_device_ = false;

  io_uring ring_{};
  bool ring_ready_ = false;
  bool use_uring_ = true;
  // Set up SINGLE_ISSUER | DEFER_TASKRUN | R_DISABLED: the worker enables the ring, which binds it
  // to the worker as its only issuer.
  bool single_issuer_ = false;
  // io_uring: only the worker thread touches the submission queue. submit() queues requests in
  // pending_ and, when the worker may be asleep with room in the ring, writes kick_fd_ (an
  // eventfd); the worker keeps a read of it armed in the ring, so the write completes that read.
  int kick_fd_ = -1;
  std::uint64_t kick_buf_ = 0;
  bool kick_armed_ = false;  // the worker's read of kick_fd_ is in the ring (worker only)
  bool kicked_ = false;      // a kick is written and its completion not yet reaped (under mu_)
  io_context_t aio_ctx_ = nullptr;
  std::thread worker_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request*> pending_;
  unsigned in_flight_ = 0;
  bool stopping_ = false;
  bool closed_ = false;
  std::int64_t next_id_ = 1;
  std::unordered_map<std::int64_t, std::shared_ptr<Job>> jobs_;
  std::vector<unsigned char*> bounce_;  // slots, allocated on first need
  std::vector<int> free_bounce_;
  // Set under mu_ when a completion may let a waiter return (a job that a wait() is in progress for
  // finished, or its checksummed read advanced; the engine drained): the worker wakes the waiters
  // only then, not after every completion.
  bool wake_waiters_ = false;
};

// posix_memalign'ed block of `nbytes` (rounded up to `align_bytes`); release with free().
void* aligned_alloc_bytes(std::size_t nbytes, std::size_t align_bytes);

}  // namespace memascend::nvme_io
