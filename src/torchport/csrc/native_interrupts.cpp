// Ctrl-C inside the Python callbacks this library calls (the allocator's, the stream layer's,
// pinned memory's, the profiler's): torchport/core/interrupts.py says why it cannot be left to
// Python. CUDA's runtime calls are not cut half-way: the interrupt is handled once control is
// back in Python. So, while the main thread (the one Python handles signals in) is inside
// such a callback, SIGINT is held here and raised again (PyErr_SetInterrupt) once the
// callback has returned, where Python's next bytecode is the caller's:
// * a SIGINT that arrives during the callback (also between the last check C++ can make and
//   the callback's first bytecode, where Python would raise it before any try of the
//   callback's and the C function pointer's caller could only print and drop it): this
//   library's SIGINT handler, chained in front of Python's (again after signal.signal
//   replaced it, as the main thread enters a callback), holds it; a second one while one
//   is held goes to Python (a wait that never ends stays interruptible);
// * one Python saw just before (tripped, not yet handled: it would fire at the callback's
//   first bytecode) is taken from Python (PyOS_InterruptOccurred) and held the same way;
// * one the callback caught itself (torchport_interrupt_requested) is raised again after.
// No Python headers: torchport/core/interrupts.py passes the interpreter's functions.
#include <pthread.h>
#include <signal.h>

#include <atomic>

#include "native_layer.h"

namespace {

struct PythonApi {
  int (*gil_ensure)();
  void (*gil_release)(int);
  void (*set_interrupt)();
  int (*interrupt_occurred)();
};

std::atomic<const PythonApi*> api{nullptr};
pthread_t main_thread;                      // Python's main thread (set before `api`)
thread_local bool requested = false;        // a callback of this thread caught a Ctrl-C
thread_local int depth = 0;                 // callbacks the main thread is inside
thread_local bool pending = false;          // ... and an interrupt to raise after them

std::atomic<bool> in_callback{false};       // the main thread is inside a callback
std::atomic<bool> held{false};              // a SIGINT arrived meanwhile
std::atomic<bool> maybe_tripped{true};      // Python may have a SIGINT it has not handled
// SIGINT's handler before this library's (Python's): a copy per change, never freed (the
// handler may be reading the previous one on another thread).
std::atomic<const struct sigaction*> next_action{nullptr};

void on_sigint(int sig, siginfo_t* info, void* context) {
  if (in_callback.load() && !held.exchange(true)) return;  // raised after the callback
  maybe_tripped.store(true);
  const struct sigaction* next = next_action.load();
  if (next == nullptr) return;
  if (next->sa_flags & SA_SIGINFO) {
    next->sa_sigaction(sig, info, context);
  } else if (next->sa_handler != SIG_DFL && next->sa_handler != SIG_IGN) {
    next->sa_handler(sig);
  }
}

// Puts on_sigint in front of SIGINT's handler where that is a function (Python's, unless
// SIGINT is ignored or default). Checked as the main thread enters a callback, since
// Python replaces it at each signal.signal(SIGINT, ...).
void chain_handler() {
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0) return;
  if (current.sa_flags & SA_SIGINFO) {
    if (current.sa_sigaction == on_sigint) return;
  } else if (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN) {
    return;
  }
  next_action.store(new struct sigaction(current));
  struct sigaction ours = current;
  ours.sa_flags = (current.sa_flags & ~SA_RESETHAND) | SA_SIGINFO;
  ours.sa_sigaction = on_sigint;
  sigaction(SIGINT, &ours, nullptr);
}

}  // namespace

torchport::CallbackInterrupts::CallbackInterrupts() : main_(false) {
  const PythonApi* py = api.load();
  if (py == nullptr || !pthread_equal(pthread_self(), main_thread)) return;
  main_ = true;
  if (depth++ == 0) {
    chain_handler();
    in_callback.store(true);
  }
  if (maybe_tripped.exchange(false)) {
    int gil = py->gil_ensure();
    if (py->interrupt_occurred()) pending = true;
    py->gil_release(gil);
  }
}

torchport::CallbackInterrupts::~CallbackInterrupts() {
  if (!main_) return;
  if (requested) {
    requested = false;
    pending = true;
  }
  if (--depth > 0) return;
  in_callback.store(false);
  if (held.exchange(false)) pending = true;
  if (!pending) return;
  pending = false;
  if (const PythonApi* py = api.load()) {
    maybe_tripped.store(true);
    py->set_interrupt();  // needs no GIL
  }
}

// The interpreter's functions, kept by the caller for the process, and Python's main
// thread (once; later calls keep the first).
extern "C" void torchport_interrupts_enable(const PythonApi* functions, unsigned long main) {
  if (api.load() != nullptr) return;
  main_thread = static_cast<pthread_t>(main);
  const PythonApi* none = nullptr;
  api.compare_exchange_strong(none, functions);
}

// The Python callback running on this thread caught a Ctrl-C: raise it again once it returned.
extern "C" void torchport_interrupt_requested() { requested = true; }

// Whether a Ctrl-C is held for after the current callback (a second one gives up waiting).
extern "C" int torchport_interrupt_held() { return held.load() ? 1 : 0; }
