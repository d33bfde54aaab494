#include "engine.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>

#include "crc32c.h"

namespace memascend::nvme_io {
namespace {

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// io_uring_enable_rings: liburing 2.3 declares it but its shared library does not export it.
int enable_ring(io_uring* ring) {
  const long rc = ::syscall(__NR_io_uring_register, ring->ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0);
  return rc < 0 ? -errno : 0;
}

}  // namespace

void* aligned_alloc_bytes(std::size_t nbytes, std::size_t align_bytes) {
  void* p = nullptr;
  const std::size_t n = round_up(std::max<std::size_t>(nbytes, 1), align_bytes);
  const int rc = posix_memalign(&p, align_bytes, n);
  if (rc != 0) throw SystemError(rc, "posix_memalign of " + std::to_string(n) + " bytes failed");
  return p;
}

Engine::Engine(const EngineConfig& config) : config_(config) {
  if (config_.queue_depth < 1 || config_.queue_depth > 4096)
    throw std::invalid_argument("queue_depth must be in [1, 4096], got " + std::to_string(config_.queue_depth));
  if (config_.request_bytes == 0) throw std::invalid_argument("request_bytes must be > 0");

  struct stat st {};
  if (::stat(config_.path.c_str(), &st) != 0)
    throw SystemError(errno, "cannot stat " + config_.path + ": " + errno_text(errno));
  is_block_device_ = S_ISBLK(st.st_mode);
  if (!is_block_device_ && !S_ISREG(st.st_mode))
    throw std::invalid_argument(config_.path + " is neither a block device nor a regular file");

  int flags = O_RDWR | O_CLOEXEC;
  if (config_.enable_direct) flags |= O_DIRECT;
  // O_EXCL on a block device makes the kernel refuse it while mounted or claimed (md, dm, another
  // exclusive opener): a guard that holds for as long as the store keeps the device open.
  if (is_block_device_ && config_.enable_exclusive) flags |= O_EXCL;
  fd_ = ::open(config_.path.c_str(), flags);
  if (fd_ < 0) {
    const int err = errno;
    if (err == EBUSY)
      throw SystemError(err, config_.path + " is in use (mounted, part of RAID/LVM, or opened exclusively)");
    if (err == EINVAL && config_.enable_direct)
      throw SystemError(err, config_.path + ": the filesystem does not support O_DIRECT (tmpfs?)");
    throw SystemError(err, "cannot open " + config_.path + ": " + errno_text(err));
  }

  // A regular file has no O_EXCL claim: an advisory lock keeps two stores (two ranks pointed at
  // one file by mistake) from interleaving their extents.
  if (!is_block_device_ && config_.enable_exclusive && ::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    if (err == EWOULDBLOCK)
      throw SystemError(EBUSY, config_.path + " is in use (locked by another store)");
    throw SystemError(err, "flock " + config_.path + ": " + errno_text(err));
  }

  if (is_block_device_) {
    std::uint64_t size = 0;
    int lbs = 0;
    if (::ioctl(fd_, BLKGETSIZE64, &size) != 0 || ::ioctl(fd_, BLKSSZGET, &lbs) != 0) {
      const int err = errno;
      ::close(fd_);
      throw SystemError(err, "ioctl BLKGETSIZE64/BLKSSZGET on " + config_.path + ": " + errno_text(err));
    }
    size_bytes_ = size;
    logical_block_bytes_ = static_cast<std::size_t>(lbs);
  } else {
    size_bytes_ = static_cast<std::uint64_t>(st.st_size);
    logical_block_bytes_ = 512;
  }
  // 4 KiB covers the logical block of every NVMe namespace format and of the filesystems a
  // preallocated file may live on; a larger logical block wins.
  align_bytes_ = std::max<std::size_t>(logical_block_bytes_, 4096);
  config_.request_bytes = round_up(config_.request_bytes, align_bytes_);

  if (config_.backend != "auto" && config_.backend != "io_uring" && config_.backend != "libaio") {
    ::close(fd_);
    throw std::invalid_argument("backend must be auto, io_uring or libaio, got " + config_.backend);
  }
  int uring_rc = -ENOSYS;
  if (config_.backend != "libaio") uring_rc = init_ring();
  if (uring_rc == 0) {
    ring_ready_ = true;
  } else if (config_.backend == "io_uring") {
    ::close(fd_);
    throw SystemError(-uring_rc, "io_uring_queue_init(" + std::to_string(config_.queue_depth) +
                                     ") failed: " + errno_text(-uring_rc) +
                                     " (io_uring disabled by sysctl or seccomp? try backend='libaio')");
  } else {
    use_uring_ = false;
    const int rc = io_setup(static_cast<int>(config_.queue_depth), &aio_ctx_);
    if (rc < 0) {
      ::close(fd_);
      throw SystemError(-rc, "neither io_uring (" + errno_text(-uring_rc) + ") nor libaio io_setup (" +
                                 errno_text(-rc) + ") is usable");
    }
  }
  bounce_.assign(config_.queue_depth, nullptr);
  for (int i = static_cast<int>(config_.queue_depth) - 1; i >= 0; --i) free_bounce_.push_back(i);
  if (!use_uring_) {
    worker_ = std::thread([this] { worker_loop_aio(); });
    return;
  }
  // A ring set up for a single issuer is bound to the task that enables it: the worker.
  std::promise<int> enabled;
  std::future<int> enabled_rc = enabled.get_future();
  worker_ = std::thread([this, enabled = std::move(enabled)]() mutable {
    const int rc = single_issuer_ ? enable_ring(&ring_) : 0;
    enabled.set_value(rc);
    if (rc == 0) worker_loop();
  });
  const int rc = enabled_rc.get();
  if (rc != 0) {
    worker_.join();
    io_uring_queue_exit(&ring_);
    ring_ready_ = false;
    ::close(kick_fd_);
    ::close(fd_);
    throw SystemError(-rc, "io_uring_enable_rings failed: " + errno_text(-rc));
  }
}

int Engine::init_ring() {
  kick_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (kick_fd_ < 0) return -errno;
  // One entry more than the queue depth: the worker's read of the kick eventfd.
  const unsigned entries = config_.queue_depth + 1;
  // Only the worker thread submits: the kernel may skip the locking a ring shared between
  // submitters needs (SINGLE_ISSUER) and run completion work when the worker waits for it
  // instead of interrupting whatever the CPU runs (DEFER_TASKRUN). Kernels before 6.1 refuse
  // the flags with EINVAL: a plain ring works the same way, only without those savings.
  io_uring_params params{};
  params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_R_DISABLED;
  int rc = io_uring_queue_init_params(entries, &ring_, &params);
  if (rc == -EINVAL) {
    params = io_uring_params{};
    rc = io_uring_queue_init_params(entries, &ring_, &params);
  } else if (rc == 0) {
    single_issuer_ = true;
  }
  if (rc != 0) {
    ::close(kick_fd_);
    kick_fd_ = -1;
  }
  return rc;
}

Engine::~Engine() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; close() only throws on programming errors.
  }
}

std::int64_t Engine::submit(OpKind op, void* buf, std::size_t nbytes, std::uint64_t offset, bool want_crc,
                            std::shared_ptr<void> keep_alive) {
  if (offset % align_bytes_ != 0)
    throw std::invalid_argument("offset " + std::to_string(offset) + " is not a multiple of " +
                                std::to_string(align_bytes_) + " bytes");
  const std::size_t padded = config_.enable_direct ? round_up(nbytes, align_bytes_) : nbytes;
  if (offset > size_bytes_ || padded > size_bytes_ - offset)
    throw std::invalid_argument("range [" + std::to_string(offset) + ", " + std::to_string(offset + padded) +
                                ") lies beyond the end of " + config_.path + " (" + std::to_string(size_bytes_) +
                                " bytes)");
  if (nbytes > 0 && buf == nullptr) throw std::invalid_argument("null buffer");

  auto job = std::make_shared<Job>();
  job->op = op;
  job->buf = static_cast<unsigned char*>(buf);
  job->nbytes = nbytes;
  job->want_crc = want_crc;
  job->keep_alive = std::move(keep_alive);
  // A write's checksum is computed below, after its requests are queued, while they are in flight
  // (the device only reads the buffer); wait() does not return before it is stored.
  const bool crc_after_queue = want_crc && op == OpKind::kWrite && nbytes > 0;
  job->crc_pending = crc_after_queue;

  std::vector<Request*> reqs;
  const bool mem_aligned = reinterpret_cast<std::uintptr_t>(buf) % align_bytes_ == 0;
  for (std::size_t pos = 0; pos < nbytes; pos += config_.request_bytes) {
    auto* r = new Request();
    r->job = job.get();
    r->index = reqs.size();
    r->user = job->buf + pos;
    r->user_bytes = std::min(config_.request_bytes, nbytes - pos);
    r->offset = offset + pos;
    if (config_.enable_direct) {
      r->io_bytes = round_up(r->user_bytes, align_bytes_);
      r->needs_bounce = !mem_aligned || r->io_bytes != r->user_bytes;
    } else {
      r->io_bytes = r->user_bytes;
    }
    reqs.push_back(r);
  }
  job->remaining = reqs.size();
  if (want_crc && op == OpKind::kRead) job->request_done.assign(reqs.size(), 0);

  std::int64_t id = 0;
  bool kick = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) {
      for (auto* r : reqs) delete r;
      throw std::logic_error("engine for " + config_.path + " is closed");
    }
    id = next_id_++;
    job->id = id;
    job->result.job_id = id;
    if (reqs.empty()) {
      job->finished = true;
      if (want_crc) job->result.crc32c = 0;
    }
    jobs_.emplace(id, job);
    for (auto* r : reqs) pending_.push_back(r);
    if (!use_uring_) {
      issue_pending_locked();
    } else if (!reqs.empty() && !kicked_ && in_flight_ < config_.queue_depth) {
      // The worker may be asleep in io_uring_enter with room in the ring: wake it. (With the
      // ring full it wakes on the next completion and takes the new requests then.)
      kicked_ = true;
      kick = true;
    }
  }
  if (kick) kick_worker();
  if (crc_after_queue) {
    const std::uint32_t crc = crc32c(0, buf, nbytes);
    std::lock_guard<std::mutex> lk(mu_);
    job->result.crc32c = crc;
    job->crc_pending = false;
  }
  if (reqs.empty() || crc_after_queue) cv_.notify_all();
  return id;
}

void Engine::issue_pending_locked() {
  std::vector<Request*> aio_batch;
  while (!pending_.empty() && in_flight_ < config_.queue_depth) {
    Request* r = pending_.front();
    if (r->needs_bounce && r->bounce < 0) {
      if (free_bounce_.empty()) break;  // keep submission order: wait for a slot
      const int slot = free_bounce_.back();
      if (bounce_[slot] == nullptr) bounce_[slot] = static_cast<unsigned char*>(
                                        aligned_alloc_bytes(config_.request_bytes, align_bytes_));
      free_bounce_.pop_back();
      r->bounce = slot;
      if (r->job->op == OpKind::kWrite) {
        std::memcpy(bounce_[slot], r->user, r->user_bytes);
        std::memset(bounce_[slot] + r->user_bytes, 0, r->io_bytes - r->user_bytes);
      }
    }
    unsigned char* mem = (r->bounce >= 0 ? bounce_[r->bounce] : r->user) + r->done_bytes;
    const std::size_t len = r->io_bytes - r->done_bytes;
    const std::uint64_t off = r->offset + r->done_bytes;
    if (use_uring_) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      if (r->job->op == OpKind::kWrite) {
        io_uring_prep_write(sqe, fd_, mem, static_cast<unsigned>(len), off);
      } else {
        io_uring_prep_read(sqe, fd_, mem, static_cast<unsigned>(len), off);
      }
      io_uring_sqe_set_data(sqe, r);
    } else {
      if (r->job->op == OpKind::kWrite) {
        io_prep_pwrite(&r->cb, fd_, mem, len, static_cast<long long>(off));
      } else {
        io_prep_pread(&r->cb, fd_, mem, len, static_cast<long long>(off));
      }
      r->cb.data = r;
      aio_batch.push_back(r);
    }
    pending_.pop_front();
    ++in_flight_;
  }
  // io_uring: the worker (the only caller there) submits the prepared entries with its next
  // io_uring_enter.
  if (!use_uring_) submit_aio_locked(aio_batch);
}

void Engine::kick_worker() {
  const std::uint64_t one = 1;
  // The eventfd counter cannot overflow here (one kick in flight at a time), so the write
  // only fails on a closed descriptor, which close() rules out before it joins the worker.
  [[maybe_unused]] const ssize_t n = ::write(kick_fd_, &one, sizeof(one));
}

void Engine::complete_locked(Request* r, int res) {
  --in_flight_;
  Job* job = r->job;
  if (res == -EINTR || res == -EAGAIN) {
    pending_.push_front(r);
    return;
  }
  if (res < 0) {
    if (job->result.error == 0 && !job->result.short_transfer) {
      job->result.error = -res;
      job->result.error_offset = r->offset + r->done_bytes;
    }
    finish_request_locked(r);
    return;
  }
  if (res == 0) {
    if (job->result.error == 0 && !job->result.short_transfer) {
      job->result.short_transfer = true;
      job->result.error_offset = r->offset + r->done_bytes;
    }
    finish_request_locked(r);
    return;
  }
  r->done_bytes += static_cast<std::size_t>(res);
  if (r->done_bytes < r->io_bytes) {
    // A partial transfer (signal, device limits): the rest goes again, still block-aligned.
    if (config_.enable_direct && r->done_bytes % logical_block_bytes_ != 0) {
      if (job->result.error == 0 && !job->result.short_transfer) {
        job->result.short_transfer = true;
        job->result.error_offset = r->offset + r->done_bytes;
      }
      finish_request_locked(r);
      return;
    }
    pending_.push_front(r);
    return;
  }
  if (job->op == OpKind::kRead && r->bounce >= 0) std::memcpy(r->user, bounce_[r->bounce], r->user_bytes);
  job->result.bytes_done += r->user_bytes;
  if (!job->request_done.empty()) job->request_done[r->index] = 1;
  finish_request_locked(r);
}

void Engine::finish_request_locked(Request* r) {
  if (r->bounce >= 0) free_bounce_.push_back(r->bounce);
  Job* job = r->job;
  delete r;
  if (--job->remaining == 0) job->finished = true;
  // A waited job: its wait() returns when it finishes, and a checksummed read's waiter checksums
  // each leading run of requests as it completes. (wait() erases the job before it returns.)
  if (job->waited && (job->finished || !job->request_done.empty())) wake_waiters_ = true;
}

bool Engine::take_wake_locked() {
  const bool wake = wake_waiters_ || (in_flight_ == 0 && pending_.empty());
  wake_waiters_ = false;
  return wake;
}

void Engine::worker_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    issue_pending_locked();
    if (!kick_armed_) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // the ring has queue_depth + 1 entries
      io_uring_prep_read(sqe, kick_fd_, &kick_buf_, sizeof(kick_buf_), 0);
      io_uring_sqe_set_data(sqe, &kick_buf_);
      kick_armed_ = true;
    }
    const bool wake = take_wake_locked();
    const bool stop = stopping_;
    lk.unlock();
    if (wake || stop) cv_.notify_all();
    if (stop) return;
    // Submit what issue_pending_locked prepared and sleep until a completion (or a kick).
    const int rc = io_uring_submit_and_wait(&ring_, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lk.lock();
    unsigned head = 0;
    unsigned seen = 0;
    io_uring_cqe* cqe = nullptr;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      void* data = io_uring_cqe_get_data(cqe);
      if (data == &kick_buf_) {
        kick_armed_ = false;
        kicked_ = false;
      } else {
        complete_locked(static_cast<Request*>(data), cqe->res);
      }
      ++seen;
    }
    io_uring_cq_advance(&ring_, seen);
  }
}

void Engine::submit_aio_locked(std::vector<Request*>& batch) {
  std::size_t next = 0;
  while (next < batch.size()) {
    std::vector<iocb*> cbs;
    for (std::size_t i = next; i < batch.size(); ++i) cbs.push_back(&batch[i]->cb);
    const int rc = io_submit(aio_ctx_, static_cast<long>(cbs.size()), cbs.data());
    if (rc > 0) {
      next += static_cast<std::size_t>(rc);
      continue;
    }
    if (rc == -EAGAIN || rc == -EINTR || rc == 0) {
      // The kernel took none now: put the rest back in order; completions will resubmit them.
      for (std::size_t i = batch.size(); i-- > next;) {
        pending_.push_front(batch[i]);
        --in_flight_;
      }
      return;
    }
    for (std::size_t i = next; i < batch.size(); ++i) complete_locked(batch[i], rc);
    return;
  }
}

void Engine::worker_loop_aio() {
  std::vector<io_event> events(config_.queue_depth);
  for (;;) {
    timespec timeout{0, 100 * 1000 * 1000};  // libaio has no wake-up entry: poll for close()
    const int n = io_getevents(aio_ctx_, 1, static_cast<long>(events.size()), events.data(), &timeout);
    bool stop = false;
    bool wake = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (int i = 0; i < n; ++i) {
        auto* r = static_cast<Request*>(events[i].data);
        complete_locked(r, static_cast<int>(static_cast<long>(events[i].res)));
      }
      issue_pending_locked();
      stop = stopping_ && in_flight_ == 0;
      wake = take_wake_locked();
    }
    if (wake || stop) cv_.notify_all();
    if (stop) return;
  }
}

JobResult Engine::wait(std::int64_t job_id) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second->waited)
    throw std::out_of_range("unknown or already waited job id " + std::to_string(job_id));
  std::shared_ptr<Job> job = it->second;  // alive while the lock is dropped below
  job->waited = true;
  Job* j = job.get();
  if (j->want_crc && j->op == OpKind::kRead) {
    // Checksum the job's leading requests as they complete, while the later ones are in flight.
    std::uint32_t crc = 0;
    std::size_t covered = 0;  // requests checksummed
    for (;;) {
      std::size_t k = covered;
      while (k < j->request_done.size() && j->request_done[k]) ++k;
      if (k > covered && j->result.error == 0 && !j->result.short_transfer) {
        const std::size_t begin = covered * config_.request_bytes;
        const std::size_t end = std::min(j->nbytes, k * config_.request_bytes);
        lk.unlock();
        crc = crc32c(crc, j->buf + begin, end - begin);
        lk.lock();
        covered = k;
        continue;
      }
      if (j->finished) break;
      cv_.wait(lk);
    }
    j->result.crc32c = crc;
  } else {
    cv_.wait(lk, [j] { return j->finished && !j->crc_pending; });
  }
  jobs_.erase(job_id);
  lk.unlock();
  JobResult r = j->result;
  r.has_crc = j->want_crc && r.error == 0 && !r.short_transfer;
  if (!r.has_crc) r.crc32c = 0;
  return r;
}

bool Engine::done(std::int64_t job_id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) throw std::out_of_range("unknown or already waited job id " + std::to_string(job_id));
  return it->second->finished && !it->second->crc_pending;
}

std::size_t Engine::outstanding() {
  std::lock_guard<std::mutex> lk(mu_);
  return jobs_.size();
}

std::size_t Engine::bounce_bytes_allocated() {
  std::lock_guard<std::mutex> lk(mu_);
  std::size_t n = 0;
  for (auto* b : bounce_)
    if (b != nullptr) n += config_.request_bytes;
  return n;
}

void Engine::close() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    cv_.wait(lk, [this] { return in_flight_ == 0 && pending_.empty(); });
    stopping_ = true;
  }
  if (use_uring_ && worker_.joinable()) kick_worker();
  if (worker_.joinable()) worker_.join();
  if (ring_ready_) io_uring_queue_exit(&ring_);
  ring_ready_ = false;
  if (kick_fd_ >= 0) ::close(kick_fd_);
  kick_fd_ = -1;
  if (aio_ctx_ != nullptr) io_destroy(aio_ctx_);
  aio_ctx_ = nullptr;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  for (auto*& b : bounce_) {
    std::free(b);
    b = nullptr;
  }
  jobs_.clear();
}

}  // namespace memascend::nvme_io
