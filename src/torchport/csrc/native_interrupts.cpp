// Ctrl-C inside the Python callbacks this library calls (the allocator's, the stream layer's,
// pinned memory's, the profiler's): torchport/core/interrupts.py says why it cannot be left to
// Python. A callback that caught the KeyboardInterrupt finishes and asks for it to be raised
// again (torchport_interrupt_requested); the CallbackInterrupts around the call then raises
// SIGINT again once the callback has returned (PyErr_SetInterrupt), and Python handles it at
// the caller's next bytecode -- unless C++ calls another callback first: that callback's first
// bytecode would handle it, before any try of its own, and the interrupt would be printed and
// lost. So a CallbackInterrupts made while one raised so may still be pending runs the
// pending signal handlers itself (PyErr_CheckSignals), holds a KeyboardInterrupt over its
// callback and raises it again after.
// No Python headers: torchport/core/interrupts.py passes the interpreter's functions.
#include <atomic>

#include "native_layer.h"

namespace {

struct PythonApi {
  int (*gil_ensure)();
  void (*gil_release)(int);
  void (*err_fetch)(void**, void**, void**);
  void (*err_restore)(void*, void*, void*);
  int (*check_signals)();
  int (*exception_matches)(void*);
  void (*err_clear)();
  void (*write_unraisable)(void*);
  void (*set_interrupt)();
  void* keyboard_interrupt;
};

std::atomic<const PythonApi*> api{nullptr};
thread_local bool requested = false;  // a callback of this thread caught a Ctrl-C
thread_local bool raised = false;     // this thread raised one again, maybe not handled yet

}  // namespace

torchport::CallbackInterrupts::CallbackInterrupts() : held_(false) {
  if (!raised) return;
  raised = false;
  const PythonApi* py = api.load();
  if (py == nullptr) return;
  int gil = py->gil_ensure();
  void *type = nullptr, *value = nullptr, *traceback = nullptr;
  py->err_fetch(&type, &value, &traceback);
  if (py->check_signals() != 0) {
    if (py->exception_matches(py->keyboard_interrupt)) {
      py->err_clear();
      held_ = true;
    } else {  // another signal handler's exception: reported, as in a finaliser
      py->write_unraisable(nullptr);
    }
  }
  py->err_restore(type, value, traceback);
  py->gil_release(gil);
}

torchport::CallbackInterrupts::~CallbackInterrupts() {
  if (!held_ && !requested) return;
  requested = false;
  if (const PythonApi* py = api.load()) {
    py->set_interrupt();  // needs no GIL
    raised = true;
  }
}

// The interpreter's functions, kept by the caller for the process (once; later calls keep
// the first).
extern "C" void torchport_interrupts_enable(const PythonApi* functions) {
  const PythonApi* none = nullptr;
  api.compare_exchange_strong(none, functions);
}

// The Python callback running on this thread caught a Ctrl-C: raise it again once it returned.
extern "C" void torchport_interrupt_requested() { requested = true; }
