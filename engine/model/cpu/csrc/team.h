// The helper threads our kernels split a call over, made for a machine shared with other work.
//
// An OpenMP region ends at a barrier that every thread of its team must reach: when another
// process holds the core a worker was on, the whole call waits for the scheduler to give that
// worker a turn (milliseconds), and a decode step makes a few hundred such calls. Beside two
// busy processes on two cores, decode fell to a quarter of its quiet speed that way, worse
// than one thread alone. Here the calling thread works on its own call from the first item to
// the last; a helper takes items only while it is running, and nothing waits for a helper that
// has not arrived. The only wait left is for an item a helper has already taken (items are
// small), and that wait yields the core, which may be the helper's.
//
// A call is a few phases in order (stage the rows, then the products; or scores, values, sums);
// a phase's items are claimed one at a time from a counter, and the next phase starts once
// every item of this one is done. Which thread runs an item never changes what it computes:
// callers give each item a fixed piece of the output.
//
// One team per calling thread (the engine loop's), grown to the threads a call asks for; its
// helpers spin a moment after a call (the next one comes within microseconds in a pass), then
// sleep on a futex, and end with the thread that owns them. A forked child has no helpers and
// runs every call alone.
#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "guard.h"

namespace radixkv {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// How long a helper keeps looking for the next call before it sleeps: a decode pass makes its
// calls back to back, with tens of microseconds of Python between them. A helper that finds
// it was descheduled while looking (a gap of kPreempted between two glances at the clock)
// sleeps at once: the core is contended, spinning only spends our share of it, and a thread
// woken from sleep is given the core sooner than one that used up its turn. Both can be set
// with RADIXKV_HELPER_SPIN_US (0: sleep at once).
constexpr auto kHelperSpin = std::chrono::microseconds(200);
constexpr auto kPreempted = std::chrono::microseconds(100);
constexpr int kMaxPhases = 4;

// Work, as the calling thread describes it to a team: ``items[p]`` items in phase p, each run
// as ``body(phase, item, worker)`` (worker: 0 for the caller, 1..threads-1 for helpers, for
// per-worker scratch).
class Job {
 public:
  virtual ~Job() = default;
  virtual void body(int phase, int64_t item, int worker) = 0;
  int phases = 0;
  int64_t items[kMaxPhases] = {};
  int threads = 1;  // at most this many workers, the caller included

  // Items of every phase, in order, as worker ``w``: returns when the last phase is done.
  void take_part(int w) noexcept {
    for (int p = 0; p < phases; ++p) {
      for (int64_t i = claimed_[p].fetch_add(1); i < items[p]; i = claimed_[p].fetch_add(1)) {
        errors_.run([&] { body(p, i, w); });
        done_[p].fetch_add(1, std::memory_order_release);
      }
      // Every item of the phase taken; wait for those still running elsewhere.
      for (int spins = 0; done_[p].load(std::memory_order_acquire) < items[p]; ++spins) {
        if (spins < 64) cpu_relax();
        else sched_yield();
      }
    }
  }

  void rethrow() const { errors_.rethrow(); }

 private:
  std::atomic<int64_t> claimed_[kMaxPhases] = {};
  std::atomic<int64_t> done_[kMaxPhases] = {};
  RegionErrors errors_;
};

// A Job from a lambda ``body(phase, item, worker)``.
template <typename F>
class LambdaJob final : public Job {
 public:
  explicit LambdaJob(F& f) : f_(f) {}
  void body(int phase, int64_t item, int worker) override { f_(phase, item, worker); }

 private:
  F& f_;
};

class Team {
 public:
  Team() = default;
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  ~Team() {
    if (getpid() != owner_) {  // a forked child: the helpers are the parent's, not ours
      new std::vector<std::thread>(std::move(helpers_));  // never joined, never destroyed
      return;
    }
    stop_.store(true);
    generation_.fetch_add(1);
    futex_wake(&generation_);
    for (auto& helper : helpers_) helper.join();
  }

  // Runs ``job`` with up to job.threads workers; returns when every item is done, then
  // rethrows the first exception an item raised.
  void run(Job& job) {
    if (getpid() != owner_) {  // a forked child: no helper of this team exists here
      job.take_part(0);
      job.rethrow();
      return;
    }
    if (job.threads > 1) grow(job.threads - 1);
    current_.store(&job);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) futex_wake(&generation_);
    job.take_part(0);
    // Closed: a helper that has not looked at the job yet never will; wait for those inside
    // (they are at most finishing the phase loop's last check).
    current_.store(nullptr);
    for (int spins = 0; inside_.load() != 0; ++spins) {
      if (spins < 64) cpu_relax();
      else sched_yield();
    }
    job.rethrow();
  }

 private:
  static void futex_wake(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
            nullptr, 0);
  }

  void grow(int helpers) {
    helpers = std::min<int>(helpers, static_cast<int>(kMaxThreads) - 1);
    while (static_cast<int>(helpers_.size()) < helpers) {
      const int worker = static_cast<int>(helpers_.size()) + 1;
      helpers_.emplace_back([this, worker] { help(worker); });
    }
  }

  void help(int worker) {
    uint32_t seen = generation_.load();
    while (true) {
      uint32_t now = wait_for_change(seen);
      if (stop_.load()) return;
      seen = now;
      inside_.fetch_add(1);
      Job* job = current_.load();
      if (job != nullptr && worker < job->threads) job->take_part(worker);
      inside_.fetch_sub(1);
    }
  }

  // Spins a moment, then sleeps until the generation moves past ``seen``.
  uint32_t wait_for_change(uint32_t seen) {
    auto last = std::chrono::steady_clock::now();
    const auto until = last + spin_;
    for (int spins = 0;; ++spins) {
      const uint32_t now = generation_.load();
      if (now != seen) return now;
      if ((spins & 63) == 63) {
        const auto clock = std::chrono::steady_clock::now();
        if (clock > until || clock - last > kPreempted) break;
        last = clock;
      }
      cpu_relax();
    }
    while (true) {
      sleepers_.fetch_add(1);
      uint32_t now = generation_.load();
      if (now == seen) {
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, seen,
                nullptr, nullptr, 0);
        now = generation_.load();
      }
      sleepers_.fetch_sub(1);
      if (now != seen) return now;
    }
  }

  std::atomic<uint32_t> generation_{0};
  std::atomic<Job*> current_{nullptr};
  std::atomic<int> inside_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> helpers_;
  const pid_t owner_ = getpid();
  const std::chrono::microseconds spin_ = spin_from_environment();

  static std::chrono::microseconds spin_from_environment() {
    const char* text = std::getenv("RADIXKV_HELPER_SPIN_US");
    if (text == nullptr || *text == '\0') return kHelperSpin;
    char* end = nullptr;
    const long us = std::strtol(text, &end, 10);
    return *end == '\0' && us >= 0 ? std::chrono::microseconds(us) : kHelperSpin;
  }
};

// The calling thread's team (made on its first parallel call).
inline Team& my_team() {
  thread_local Team team;
  return team;
}

// ``body(phase, item, worker)`` for ``items[p]`` items of each phase p, in phase order, on the
// calling thread and up to ``threads - 1`` helpers. A single-threaded call runs inline.
template <typename F>
void run_phases(int threads, std::initializer_list<int64_t> items, F&& body) {
  LambdaJob<F> job(body);
  job.phases = static_cast<int>(items.size());
  ARG_CHECK(job.phases <= kMaxPhases, "at most ", kMaxPhases, " phases");
  std::copy(items.begin(), items.end(), job.items);
  job.threads = std::max(1, threads);
  if (job.threads == 1) {
    job.take_part(0);
    job.rethrow();
    return;
  }
  my_team().run(job);
}

}  // namespace radixkv
