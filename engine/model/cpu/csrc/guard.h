// What every native entry point uses so that a bad call is a Python RuntimeError, never a
// crash: ARG_CHECK for its arguments (on the calling thread, before any parallel region), and
// RegionErrors around the work of a parallel region (no exception may leave one).
// native_build hashes this header into the fingerprint of every source that includes it.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>

namespace radixkv {

// A rejected argument, as a std::runtime_error (pybind11 raises it as RuntimeError). Not
// TORCH_CHECK: a c10::Error walks the whole native stack for a backtrace as it is made, one
// more piece of machinery that has to work on every machine for a bad argument to stay an
// error; this one only unwinds our own frames up to the binding.
template <typename... Parts>
[[noreturn]] inline void reject(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

#define ARG_CHECK(cond, ...)                      \
  do {                                            \
    if (!(cond)) ::radixkv::reject(__VA_ARGS__);  \
  } while (0)

// The first exception thrown by any thread of a parallel call, kept and rethrown on the
// calling thread after the call. An exception that escapes a helper thread ends the process
// (std::terminate), and an item left half done would leave its phase unfinished: so each item
// runs inside ``run``, which never throws, and once one has failed the rest are skipped (the
// call's output is discarded anyway).
class RegionErrors {
 public:
  template <typename F>
  void run(F&& work) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }

  // After the call (its last phase's end orders every thread's writes before this).
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr first_;
};

// Calls above this many threads are refused: a team that large would only queue for the cores.
constexpr long kMaxThreads = 1024;

}  // namespace radixkv
