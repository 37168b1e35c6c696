// ruvllm CPU kernels: the thread pool the FFI handlers split their work over, and the split of the
// quantized products (every matrix of a call in runs of row blocks or panels, one or more per thread).
//
// A small pool of worker threads of our own. XLA's intra-op pool wakes a sleeping thread for each
// task, which costs tens of microseconds; a decode step makes ~120 kernel calls, each a few hundred
// microseconds of work, so that latency would be a large part of the step. A job's parts are claimed
// (the calling thread runs whatever no worker took), so a worker without a core never holds a call
// up. These workers spin for a short while after each job (RUVLLM_JAX_NATIVE_SPIN_US, default 50)
// and then sleep, so they are hot during a step and idle between requests. The thread count is set
// from Python before the pool starts (ruvllm_set_threads: --threads / RUVLLM_THREADS, else the CPUs
// this process may use).
//
// Calls of many rows (prompt chunks, large decode batches) also hand parts to XLA's own intra-op
// threads (the FFI call's ffi::ThreadPool), as helpers that claim parts exactly as our workers do.
// While one of XLA's threads runs the call, its others have nothing to do and share the cores with
// our workers; a helper puts such a thread to work on the call instead. On a 2-core Zen 4
// (docs/performance-journal.md) a 128-token Gemma-3-270M prefill took 15-25% less time with them, a decode
// batch of 32 about 6% less, one of 16 the same, and one of 8 about 3% more, so calls of fewer than
// kHelperRows rows (every one-row decode call among them) do not use them.
#ifndef RUVLLM_CPU_POOL_H_
#define RUVLLM_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

#include "cpu_kernels.h"

#pragma GCC visibility push(hidden)  // the library's own: only its extern "C" entry points are exported
namespace ruvllm {

namespace ffi = xla::ffi;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

class Pool {
 public:
  static constexpr int kMaxParts = 0xffff;

  // The process's pool, started on first use. Never destroyed: workers may outlive static
  // destruction. A forked child has none of the parent's threads, so it builds its own pool.
  static Pool& get();
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(part) once for each part in [0, parts) (default: one per thread). Parts are claimed,
  // not assigned: the calling thread takes every part no worker has claimed yet, so a worker that is
  // not on a core (XLA's own threads may hold them) never stalls the call; the caller waits only for
  // parts a worker is running. helpers: XLA's intra-op pool, given up to threads() - 1 tasks that
  // claim parts too (one that starts after the job is over finds none left and returns).
  template <typename F>
  void run(F&& fn, int parts = 0, ffi::ThreadPool* helpers = nullptr) {
    if (parts <= 0) parts = threads();
    parts = std::min(parts, kMaxParts);
    if (workers_.empty() || parts == 1) {
      for (int p = 0; p < parts; ++p) fn(p);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);  // one job at a time (XLA may call concurrently)
    std::function<void(int)> job = fn;
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = generation_.fetch_add(1, std::memory_order_relaxed) + 1;
      claim_.store(((gen & 0xffffffffu) << 32) | (static_cast<uint64_t>(parts) << 16), std::memory_order_release);
    }
    cv_.notify_all();
    if (helpers != nullptr) {
      const int64_t n = std::min<int64_t>(helpers->num_threads(), threads()) - 1;
      for (int64_t i = 0; i < n; ++i) helpers->Schedule([this, gen] { work_on(gen); });
    }
    for (int p; (p = claim(gen)) >= 0;) {
      fn(p);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
    for (int spins = 0; done_.load(std::memory_order_acquire) != parts; ++spins) {
      if (spins < 4096) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    job_ = nullptr;
  }

 private:
  Pool();

  // The next unclaimed part of job `gen`, or -1 when none is left (or that job is over).
  int claim(uint64_t gen) {
    uint64_t v = claim_.load(std::memory_order_acquire);
    for (;;) {
      if ((v >> 32) != (gen & 0xffffffffu) || (v & 0xffff) >= ((v >> 16) & 0xffff)) return -1;
      if (claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) return static_cast<int>(v & 0xffff);
    }
  }

  void loop();

  // Runs parts of job `gen` until none is left. job_ stays set while a claimed part is unfinished.
  void work_on(uint64_t gen) {
    for (int p; (p = claim(gen)) >= 0;) {
      (*job_)(p);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  // (job generation << 32) | (parts << 16) | next part to claim, one word so that a claim checks the
  // job, its part count and the next part at once; job_ is written before it is stored.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
  std::function<void(int)>* volatile job_ = nullptr;
  int spin_us_ = 50;
  pid_t pid_ = getpid();
};

// How a product's parts are split (see cpu_pool.cc): calls of kHelperRows activation rows or more
// also hand parts to XLA's intra-op threads as helpers (prompt chunks too, cpu_ffi.cc).
constexpr int64_t kHelperRows = 16;

// w8a8_rows over every matrix, each split into equal runs of 4-row blocks across the pool's threads.
void run_split(const RowActs& x, ffi::ThreadPool* xla_pool, const std::vector<RowMatrix>& mats);

// group_rows / panel_rows over every matrix and kpanel_rows over every k-quant one, each split into
// equal runs of row blocks or panels.
void run_group_split(const GroupActs& x, ffi::ThreadPool* xla_pool, const std::vector<GroupMatrix>& mats,
                     const std::vector<KMatrix>& kmats = {});

// One expert's share of a mixture of experts' grouped product (cpu_ffi.cc, ruvllm_experts): the
// activations of the rows routed to it and one of its matrices (k-quant or plain panel layout).
struct ExpertPanels {
  GroupActs x;
  const GroupMatrix* g = nullptr;  // one of g and k is set
  const KMatrix* k = nullptr;
  int64_t panels = 0;
};

// panel_rows / kpanel_rows over every expert's matrices: their panels laid end to end and split into
// equal runs across the threads, so a step whose rows went to few experts still uses every thread
// and reads only those experts' panels. `rows`: the call's activation rows (helpers or not).
void run_expert_split(const std::vector<ExpertPanels>& items, int64_t rows, ffi::ThreadPool* xla_pool);

// The same for w8a8 experts (cpu_ffi.cc, ruvllm_experts_w8a8): an expert's rows and one of its int8
// matrices, split in blocks of 4 output rows.
struct ExpertRows {
  RowActs x;
  RowMatrix m;
};
void run_expert_row_split(const std::vector<ExpertRows>& items, int64_t rows, ffi::ThreadPool* xla_pool);

}  // namespace ruvllm
#pragma GCC visibility pop

#endif  // RUVLLM_CPU_POOL_H_
