// ruvllm CPU kernels: the thread pool and the split of the quantized products over it (cpu_pool.h).
// Built for the baseline ISA of the target architecture.
#include <chrono>
#include <cstdlib>

#include "cpu_isa.h"
#include "cpu_pool.h"

namespace {

std::atomic<int> g_threads{0};
std::atomic<int> g_pool_threads{0};  // nonzero once the pool has started

}  // namespace

namespace ruvllm {

Pool& Pool::get() {
  static std::atomic<Pool*> pool{nullptr};
  static std::mutex create;
  Pool* p = pool.load(std::memory_order_acquire);
  if (p == nullptr || p->pid_ != getpid()) {
    std::lock_guard<std::mutex> lk(create);
    p = pool.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != getpid()) {
      p = new Pool();
      pool.store(p, std::memory_order_release);
    }
  }
  return *p;
}

Pool::Pool() {
  int n = g_threads.load() > 0 ? g_threads.load() : static_cast<int>(std::thread::hardware_concurrency());
  if (n < 1) n = 1;
  if (n > 256) n = 256;
  g_pool_threads.store(n);
  const char* spin = std::getenv("RUVLLM_JAX_NATIVE_SPIN_US");
  spin_us_ = spin ? std::atoi(spin) : 50;
  for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  for (auto& t : workers_) t.detach();
}

void Pool::loop() {
  uint64_t seen = 0;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    if (gen == seen) {
      const auto start = std::chrono::steady_clock::now();
      while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
        // Yield rather than pause: XLA's own threads may need this core between our calls.
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
          std::unique_lock<std::mutex> lk(mu_);
          cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          gen = generation_.load(std::memory_order_acquire);
          break;
        }
      }
    }
    seen = gen;
    work_on(gen);
  }
}

namespace {

// How a product of `rows` activation rows and `work` multiply-adds is split: parts (runs of every
// matrix's panels or row blocks), and XLA's pool as helpers or not. One part per thread, except for
// calls of kHelperRows rows or more: kPartsPerThread per thread with helpers (see the pool), so that
// whichever threads are on the cores take the parts.
constexpr int kPartsPerThread = 4;

struct Split {
  int parts = 1;
  ffi::ThreadPool* helpers = nullptr;
};

Split product_split(int64_t rows, int64_t work, ffi::ThreadPool* xla_pool) {
  const int threads = Pool::get().threads();
  if (work < (int64_t{1} << 16) || threads == 1) return {};
  if (rows < kHelperRows || xla_pool == nullptr) return {threads, nullptr};
  return {threads * kPartsPerThread, xla_pool};
}

}  // namespace

void run_split(const RowActs& x, ffi::ThreadPool* xla_pool, const std::vector<RowMatrix>& mats) {
  const KernelTable* kt = kernels();
  int64_t total = 0;
  for (const auto& m : mats) total += m.N;
  const Split split = product_split(x.M, total * x.K * x.M, xla_pool);
  const int parts = split.parts;
  Pool::get().run(
      [&](int part) {
        for (const auto& m : mats) {
          const int64_t blocks = (m.N + 3) / 4;
          const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
          kt->w8a8_rows(x, m, std::min(m.N, b0 * 4), std::min(m.N, b1 * 4));
        }
      },
      parts, split.helpers);
}

void run_group_split(const GroupActs& x, ffi::ThreadPool* xla_pool, const std::vector<GroupMatrix>& mats,
                     const std::vector<KMatrix>& kmats) {
  const KernelTable* kt = kernels();
  int64_t work = 0;
  for (const auto& m : mats) work += m.N * x.K * x.M;
  for (const auto& m : kmats) work += m.N * x.K * x.M;
  Pool& pool = Pool::get();
  const Split split = product_split(x.M, work, xla_pool);
  const int parts = split.parts;
  auto run_part = [&](int part) {
    for (const auto& m : mats) {
      if (m.panel) {
        const int64_t panels = m.N / 16;
        kt->panel_rows(x, m, panels * part / parts, panels * (part + 1) / parts);
        continue;
      }
      const int64_t blocks = (m.N + 1) / 2;
      const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
      kt->group_rows(x, m, std::min(m.N, b0 * 2), std::min(m.N, b1 * 2));
    }
    for (const auto& m : kmats) {
      const int64_t panels = m.N / 16;
      kt->kpanel_rows(x, m, panels * part / parts, panels * (part + 1) / parts);
    }
  };
  pool.run(run_part, parts, split.helpers);
}

void run_expert_split(const std::vector<ExpertPanels>& items, int64_t rows, ffi::ThreadPool* xla_pool) {
  const KernelTable* kt = kernels();
  int64_t total = 0, work = 0;
  for (const auto& it : items) {
    total += it.panels;
    work += it.panels * 16 * it.x.K * it.x.M;
  }
  if (total == 0) return;
  const Split split = product_split(rows, work, xla_pool);
  const int parts = static_cast<int>(std::min<int64_t>(split.parts, total));
  // Part p takes panels [total p / parts, total (p + 1) / parts) of the sequence; a panel's arithmetic
  // does not depend on which part runs it, so the split never changes a result.
  auto run_part = [&](int part) {
    const int64_t u0 = total * part / parts, u1 = total * (part + 1) / parts;
    int64_t base = 0;
    for (const auto& it : items) {
      const int64_t a = std::max(u0, base) - base, b = std::min(u1, base + it.panels) - base;
      if (a < b) {
        if (it.k != nullptr) kt->kpanel_rows(it.x, *it.k, a, b);
        else kt->panel_rows(it.x, *it.g, a, b);
      }
      base += it.panels;
      if (base >= u1) break;
    }
  };
  Pool::get().run(run_part, parts, split.helpers);
}

void run_expert_row_split(const std::vector<ExpertRows>& items, int64_t rows, ffi::ThreadPool* xla_pool) {
  const KernelTable* kt = kernels();
  int64_t total = 0, work = 0;
  for (const auto& it : items) {
    total += (it.m.N + 3) / 4;
    work += it.m.N * it.x.K * it.x.M;
  }
  if (total == 0) return;
  const Split split = product_split(rows, work, xla_pool);
  const int parts = static_cast<int>(std::min<int64_t>(split.parts, total));
  auto run_part = [&](int part) {
    const int64_t u0 = total * part / parts, u1 = total * (part + 1) / parts;
    int64_t base = 0;
    for (const auto& it : items) {
      const int64_t blocks = (it.m.N + 3) / 4;
      const int64_t a = std::max(u0, base) - base, b = std::min(u1, base + blocks) - base;
      if (a < b) kt->w8a8_rows(it.x, it.m, std::min(it.m.N, a * 4), std::min(it.m.N, b * 4));
      base += blocks;
      if (base >= u1) break;
    }
  };
  Pool::get().run(run_part, parts, split.helpers);
}

}  // namespace ruvllm

// -- the thread count (called from ruvllm_jax.native) ------------------------------------------------

// Sets the pool's thread count before it starts; returns the count it has (n, or the count the pool
// already started with).
extern "C" int ruvllm_set_threads(int n) {
  g_threads.store(n);
  const int started = g_pool_threads.load();
  return started != 0 ? started : n;
}

extern "C" int ruvllm_threads() { return ruvllm::Pool::get().threads(); }
