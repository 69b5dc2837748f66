// The sim's stream queues in asynchronous mode (TORCHPORT_SIM_ASYNC=1): one worker thread
// per stream runs its work in issue order. The Python queue (torchport/backends/sim/queues.py)
// ran every launch as a Python closure on a Python thread: each queued op cost a hand-off of
// the GIL each way, and the caller waited for the worker's Python as often as the worker for
// the caller's. Here the worker is a C++ thread that takes the GIL only for work given as a
// Python callable (copies, timing events, a Python kernel's launch of several ops); an op
// launched from C++ (native_queued_ops.cpp) or from a Python kernel as one ATen op
// (torchport_queue_submit_call), an event's marker and a wait for another stream run
// without it. The host's own turn (host_turn) waits for a queue without the GIL.
//
// An idle worker watches its queue briefly before it sleeps (`spin`), so that a host issuing
// tiny ops does not wake it for each; the jobs wait in a ring the host grows, and a query of a
// ticket takes no lock. Tickets count submissions; a wait is for a ticket. The
// first failure is kept, with its op's name, until a synchronising call takes it (later work
// still runs: the device stays usable); `abandon` drops what is queued (Ctrl-C, exit); `inline`
// runs new work in the caller (after the interpreter started finalising, no other thread may
// run Python). Queues live for the
// process: their threads start with the first work, block in a wait at exit and are never
// joined; a forked child starts its own.
// Switched by torchport/backends/sim/queues.py.
#if __has_include(<Python.h>)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <Python.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <algorithm>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pthread.h>

#include "native_layer.h"

namespace torchport::queues {

struct Job {
  enum Kind { kPython, kOp, kCopied, kMarker, kWaitFor } kind = kMarker;
  PyObject* fn = nullptr;  // kPython: owned reference
  std::optional<c10::OperatorHandle> op;  // kOp, kCopied: run on `stack` by its CPU kernel
  torch::jit::Stack stack;
  AliasesLater aliases;          // kOp: CPU tensors made into `stack` when it runs
  std::vector<at::Tensor> outs;  // kCopied: where its list of results goes
  Queue* other = nullptr;  // kWaitFor: until `other` completed `ticket`
  int64_t ticket = 0;
  std::string name;       // what a failure is reported under (kOp, kCopied: empty, the op's)
  int64_t number = 0;     // this job's ticket

  // Empty again for the next job its ring slot holds, its buffers kept (run() cleared the
  // stack and the results: what holds device memory).
  void reset() {
    kind = kMarker;
    aliases.clear();
    other = nullptr;
    ticket = 0;
    name.clear();
  }
};

const std::string& op_name(const Job& job) {
  return job.name.empty() && job.op ? job.op->schema().name() : job.name;
}

class Queue {
 public:
  explicit Queue(std::string label, int64_t bound, bool run_inline)
      : label_(std::move(label)), bound_(bound), inline_(run_inline) {
#ifdef PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP
    // The host and the worker each hold m_ for a few instructions per job: a thread that
    // finds it taken spins briefly rather than sleeping in the kernel at once.
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(m_.native_handle(), &attr);
    pthread_mutexattr_destroy(&attr);
#endif
    std::lock_guard<std::mutex> l(registry);
    all.push_back(this);
  }

  // A job `fill` writes where it waits, in an empty slot of the ring (no job is moved: the
  // worker runs it in its slot, whose buffers serve the next job there).
  template <class Fill>
  int64_t submit(bool bounded, Fill&& fill) {
    std::unique_lock<std::mutex> l(m_);
    if (inline_) {
      Job job;
      fill(job);
      job.number = submitted_.load(std::memory_order_relaxed) + 1;
      submitted_.store(job.number, std::memory_order_release);
      l.unlock();
      run(job);
      return job.number;
    }
    if (!started_) {  // the worker starts with the first work (and again in a forked child)
      std::thread worker([this] { loop(); });
      worker_ = worker.get_id();
      worker.detach();
      started_ = true;
    }
    if (bounded && submitted_.load() - completed_.load() >= bound_ &&
        std::this_thread::get_id() != worker_) {
      // waiting for room: without the GIL, which the worker may need for queued Python work
      const bool gil = Py_IsInitialized() && PyGILState_Check();
      PyThreadState* saved = gil ? PyEval_SaveThread() : nullptr;
      waiters_.fetch_add(1);
      done_.wait(l, [&] { return submitted_.load() - completed_.load() < bound_ || inline_; });
      waiters_.fetch_sub(1);
      if (saved) {
        l.unlock();
        PyEval_RestoreThread(saved);
        l.lock();
      }
    }
    Job& slot = next_slot();
    try {
      fill(slot);
    } catch (...) {
      slot.stack.clear();
      slot.outs.clear();
      slot.reset();
      throw;
    }
    const int64_t ticket = submitted_.load(std::memory_order_relaxed) + 1;
    slot.number = ticket;
    submitted_.store(ticket, std::memory_order_release);
    ++count_;
    // written only when it changes: a spinning worker reads its cache line
    if (!queued_.load(std::memory_order_relaxed)) queued_.store(true, std::memory_order_release);
    const bool asleep = sleeping_;
    l.unlock();
    if (asleep) work_.notify_one();  // a spinning or working worker needs no wake-up call
    return ticket;
  }

  // Has `ticket` (0: everything submitted so far) run? Waits up to `timeout_ms` (< 0: no wait).
  // (A query takes no lock: the tickets are atomics, and the worker takes the lock to
  // notify only while someone waits.)
  bool wait(int64_t ticket, int timeout_ms) {
    const int64_t target = ticket > 0 ? ticket : submitted_.load(std::memory_order_acquire);
    if (completed_.load(std::memory_order_acquire) >= target || timeout_ms < 0)
      return completed_.load(std::memory_order_acquire) >= target;
    std::unique_lock<std::mutex> l(m_);
    waiters_.fetch_add(1);
    const bool ran = done_.wait_for(l, std::chrono::milliseconds(timeout_ms),
                                    [&] { return completed_.load() >= target; });
    waiters_.fetch_sub(1);
    return ran;
  }

  int64_t submitted() const { return submitted_.load(std::memory_order_acquire); }
  int64_t completed() const { return completed_.load(std::memory_order_acquire); }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void abandon() { abandoned_.store(true); }
  bool abandoned() const { return abandoned_.load(); }
  void run_inline() {
    std::lock_guard<std::mutex> l(m_);
    inline_ = true;
    done_.notify_all();
  }

  // (name, exception) of the first failure not taken yet, or None; the GIL held.
  PyObject* take_error() {
    std::unique_lock<std::mutex> l(m_);
    if (!failed_.load()) Py_RETURN_NONE;
    failed_.store(false);
    PyObject* exc = error_;
    error_ = nullptr;
    std::string name = std::move(error_name_), message = std::move(error_message_);
    PyObject* type = error_type_;
    l.unlock();
    if (exc == nullptr) exc = PyObject_CallFunction(type, "s", message.c_str());
    if (exc == nullptr) return nullptr;
    PyObject* out = Py_BuildValue("(sN)", name.c_str(), exc);
    return out;
  }

  const std::string& label() const { return label_; }

  // fork(): no queue's lock is held across it; the child has no worker threads, and the
  // parent's queued work is not the child's (its device memory is a copy): dropped.
  static void before_fork() {
    registry.lock();
    for (Queue* q : all) q->m_.lock();
  }
  static void after_fork_parent() {
    for (Queue* q : all) q->m_.unlock();
    registry.unlock();
  }
  static void after_fork_child() {
    for (Queue* q : all) {
      // (the job at head_ may have been running in the parent's worker, half-written: left
      // as it is, not destroyed)
      if (q->count_ > 0) static_cast<void>(q->ring_[q->head_].release());
      q->ring_.clear();
      q->head_ = q->count_ = 0;
      q->queued_.store(false);
      q->sleeping_ = false;
      q->completed_.store(q->submitted_.load());
      q->started_ = false;
      new (&q->work_) std::condition_variable();
      new (&q->done_) std::condition_variable();
      q->m_.unlock();
    }
    registry.unlock();
  }

 private:
  // The worker runs the job at head_ in its slot, counted in count_ until it ran.
  void loop() {
    Job* job = nullptr;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(m_);
        if (job != nullptr) {  // the one that ran: its slot free for the host again
          head_ = (head_ + 1) % ring_.size();
          --count_;
        }
        if (count_ == 0) {
          queued_.store(false, std::memory_order_relaxed);
          l.unlock();
          spin();
          l.lock();
        }
        while (count_ == 0) {
          sleeping_ = true;
          work_.wait(l);
          sleeping_ = false;
        }
        job = ring_[head_].get();
      }
      run(*job);
      job->reset();
    }
  }

  // The slot after the queued jobs, a ring the host grows: by slots that stay where they are
  // (the worker runs the job at head_ without the lock) and keep their buffers (the worker
  // frees nothing of them: memory the host allocates and another thread frees costs both
  // threads malloc's arena lock).
  Job& next_slot() {
    if (count_ == ring_.size()) {
      std::vector<std::unique_ptr<Job>> bigger(std::max<size_t>(64, 2 * ring_.size()));
      for (size_t i = 0; i < count_; ++i) bigger[i] = std::move(ring_[(head_ + i) % ring_.size()]);
      for (size_t i = count_; i < bigger.size(); ++i) bigger[i] = std::make_unique<Job>();
      ring_.swap(bigger);
      head_ = 0;
    }
    return *ring_[(head_ + count_) % ring_.size()];
  }

  // An idle worker watches its queue for kSpin before it sleeps: a host issuing tiny ops
  // submits the next one sooner than a sleeping thread wakes (a futex call each side and a
  // context switch per op, which cost more than the ops).
  void spin() const {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 1; !queued_.load(std::memory_order_acquire); ++i) {
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }
  static constexpr std::chrono::microseconds kSpin{50};

  void run(Job& job) {
    if (!abandoned()) {
      switch (job.kind) {
        case Job::kOp:
        case Job::kCopied:
          try {
            c10::InferenceMode inference(true);  // device work knows no autograd
            if (!job.aliases.empty()) job.aliases.make(job.stack);
            job.op->redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &job.stack);
            if (job.kind == Job::kCopied) copy_results(job);
          } catch (const c10::Error& e) {
            fail(op_name(job), nullptr, e.what_without_backtrace(), python_class(e));
          } catch (const std::exception& e) {
            fail(op_name(job), nullptr, e.what());
          }
          break;
        case Job::kWaitFor: {
          // another stream's work first (an event this stream waits for); gives up when
          // either queue's work is abandoned
          while (!job.other->wait(job.ticket, 50) && !job.other->abandoned() && !abandoned()) {
          }
          break;
        }
        case Job::kPython: {
          PyGILState_STATE g = PyGILState_Ensure();
          PyObject* r = PyObject_CallNoArgs(job.fn);
          if (r == nullptr) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
            fail(job.name, value, "");  // takes `value`
            Py_XDECREF(type);
            Py_XDECREF(tb);
          }
          Py_XDECREF(r);
          PyGILState_Release(g);
          break;
        }
        case Job::kMarker:
          break;
      }
    }
    if (job.fn != nullptr) {  // the callable dies with the GIL held
      PyGILState_STATE g = PyGILState_Ensure();
      Py_CLEAR(job.fn);
      PyGILState_Release(g);
    }
    job.stack.clear();  // the CPU tensors over device memory, before the ticket completes
    job.outs.clear();
    completed_.store(job.number);
    if (waiters_.load() > 0) {
      std::lock_guard<std::mutex> l(m_);
      done_.notify_all();
    }
  }

  // Keeps the first failure; `exc` (a new reference, or null) is taken.
  // The Python class PyTorch raises a C++ error of the CPU kernel as (its
  // torch/csrc/Exceptions.h mapping), so that the report names the kernel's exception as
  // the Python worker's does; a pointer to a static type object, read without the GIL.
  static PyObject* python_class(const c10::Error& e) {
    if (dynamic_cast<const c10::IndexError*>(&e)) return PyExc_IndexError;
    if (dynamic_cast<const c10::ValueError*>(&e)) return PyExc_ValueError;
    if (dynamic_cast<const c10::TypeError*>(&e)) return PyExc_TypeError;
    if (dynamic_cast<const c10::NotImplementedError*>(&e)) return PyExc_NotImplementedError;
    return PyExc_RuntimeError;
  }

  // A kCopied job's list of results into its outputs, each of the launch's layout.
  static void copy_results(Job& job) {
    const c10::List<at::Tensor> results = job.stack.at(0).toTensorList();
    TORCH_CHECK(results.size() == job.outs.size(), op_name(job), ": the kernel gave ",
                results.size(), " results where its launch made ", job.outs.size());
    for (size_t i = 0; i < job.outs.size(); ++i) {
      const at::Tensor r = results.get(i);
      at::Tensor& out = job.outs[i];
      TORCH_CHECK(r.sizes() == out.sizes() && r.scalar_type() == out.scalar_type(), op_name(job),
                  ": the kernel gave a result of ", r.scalar_type(), " ", r.sizes(),
                  " where its launch made ", out.scalar_type(), " ", out.sizes());
      out.copy_(r);
    }
  }

  void fail(const std::string& name, PyObject* exc, const char* message,
            PyObject* type = PyExc_RuntimeError) {
    std::unique_lock<std::mutex> l(m_);
    if (failed_.load()) {
      l.unlock();
      Py_XDECREF(exc);
      return;
    }
    failed_.store(true);
    error_name_ = name;
    error_message_ = message;
    error_type_ = type;
    error_ = exc;
  }

  std::string label_;
  const int64_t bound_;
  bool inline_;
  std::mutex m_;
  std::condition_variable work_, done_;
  std::vector<std::unique_ptr<Job>> ring_;  // the queued jobs: count_ of them from head_
  size_t head_ = 0, count_ = 0;
  // a job is queued (read without m_ while spinning), on a cache line of its own
  alignas(64) std::atomic<bool> queued_{false};
  char queued_line_[63] = {};
  bool sleeping_ = false;  // the worker waits on work_
  // Tickets: submitted_ written under m_, completed_ by the one thread that runs the jobs;
  // both read without it. waiters_: threads waiting on done_.
  std::atomic<int64_t> submitted_{0}, completed_{0};
  std::atomic<int> waiters_{0};
  std::atomic<bool> abandoned_{false};
  std::atomic<bool> failed_{false};
  std::string error_name_, error_message_;
  PyObject* error_ = nullptr;
  PyObject* error_type_ = PyExc_RuntimeError;
  bool started_ = false;
  std::thread::id worker_;

  static std::mutex registry;
  static std::vector<Queue*> all;
};

std::mutex Queue::registry;
std::vector<Queue*> Queue::all;
const int registered_fork_handlers = pthread_atfork(
    Queue::before_fork, Queue::after_fork_parent, Queue::after_fork_child);

std::atomic<Queue*> defaults[64];  // by logical device index: kept once known

Queue* default_queue(int index) {
  return index >= 0 && index < 64 ? defaults[index].load(std::memory_order_acquire) : nullptr;
}

void set_default_queue(int index, Queue* q) {
  if (index >= 0 && index < 64) defaults[index].store(q, std::memory_order_release);
}

int64_t marker(Queue* q) {
  return q->submit(false, [](Job&) {});  // (an empty slot is a marker)
}

int64_t last_ticket(Queue* q) { return q->submitted(); }

bool done(Queue* q, int64_t ticket) { return q->wait(ticket, -1); }

bool host_turn(Queue* q, bool wait) {
  const int64_t target = q->submitted();
  if (!q->wait(target, -1)) {
    if (!wait) return false;
    for (;;) {
      // without the GIL (queued Python work needs it), in slices between which the main
      // thread takes a Ctrl-C, as the Python wait does
      const bool gil = Py_IsInitialized() && PyGILState_Check();
      PyThreadState* saved = gil ? PyEval_SaveThread() : nullptr;
      const bool ran = q->wait(target, 50);
      if (saved) PyEval_RestoreThread(saved);
      if (ran) break;
      const PyGILState_STATE state = PyGILState_Ensure();
      if (PyErr_CheckSignals() != 0) {
        python_error e;
        e.persist();
        PyGILState_Release(state);
        throw std::move(e);
      }
      PyGILState_Release(state);
    }
  }
  return !q->failed();
}

int64_t submit_op(Queue* q, const c10::OperatorHandle& op, torch::jit::Stack&& stack,
                  const char* name, AliasesLater&& aliases) {
  return q->submit(/*bounded=*/true, [&](Job& job) {
    job.kind = Job::kOp;
    job.op = op;
    job.stack = std::move(stack);
    job.aliases = std::move(aliases);
    if (name != nullptr) job.name = name;
  });
}

int64_t submit_op_filled(Queue* q, const c10::OperatorHandle& op,
                         c10::function_ref<void(torch::jit::Stack&, AliasesLater&)> fill) {
  return q->submit(/*bounded=*/true, [&](Job& job) {
    job.kind = Job::kOp;
    job.op = op;
    fill(job.stack, job.aliases);
  });
}

int64_t submit_copied(Queue* q, const c10::OperatorHandle& op, torch::jit::Stack&& stack,
                      std::vector<at::Tensor>&& outs) {
  return q->submit(/*bounded=*/true, [&](Job& job) {
    job.kind = Job::kCopied;
    job.op = op;
    job.stack = std::move(stack);
    job.outs = std::move(outs);
  });
}

}  // namespace torchport::queues

using torchport::queues::Job;
using torchport::queues::Queue;

extern "C" {
void* torchport_queue_new(const char* label, int64_t bound, int run_inline) {
  return new Queue(label, bound, run_inline != 0);  // lives for the process
}

// Python work (`fn()`, called with the GIL on the worker); the GIL held.
int64_t torchport_queue_submit(void* q, PyObject* fn, const char* name, int bounded) {
  return static_cast<Queue*>(q)->submit(bounded != 0, [&](Job& job) {
    job.kind = Job::kPython;
    job.name = name;
    Py_INCREF(fn);
    job.fn = fn;
  });
}

// The CPU kernel of operator `name`.`overload` on Python's (args, kwargs) -- host views of
// device memory -- queued on `q` as `label`, where it runs without the GIL as C++'s own launches do (a
// Python kernel's launch of one ATen op needs no Python on the worker); its ticket, or 0 for
// arguments the schema does not take as they are (a number in a tensor's place: the caller
// queues a Python call instead). The GIL held.
int64_t torchport_queue_submit_call(void* q, const char* name, const char* overload,
                                    PyObject* args, PyObject* kwargs, const char* label) {
  static std::mutex known_lock;
  static std::unordered_map<std::string, c10::OperatorHandle> known;  // aten's: never removed
  try {
    std::string key = std::string(name) + "." + overload;
    std::optional<c10::OperatorHandle> op;
    {
      std::lock_guard<std::mutex> l(known_lock);
      auto it = known.find(key);
      if (it != known.end()) op = it->second;
    }
    if (!op) {
      op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
      std::lock_guard<std::mutex> l(known_lock);
      known.emplace(std::move(key), *op);
    }
    auto a = pybind11::reinterpret_borrow<pybind11::tuple>(args);
    auto kw = pybind11::reinterpret_borrow<pybind11::kwargs>(kwargs);
    return torchport::queues::submit_op(
        static_cast<Queue*>(q), *op,
        torch::jit::createStackForSchema(op->schema(), a, kw, std::nullopt), label);
  } catch (pybind11::error_already_set&) {
  } catch (const std::exception&) {
  }
  PyErr_Clear();
  return 0;
}

int64_t torchport_queue_marker(void* q) { return torchport::queues::marker(static_cast<Queue*>(q)); }

int64_t torchport_queue_wait_for(void* q, void* other, int64_t ticket) {
  return static_cast<Queue*>(q)->submit(false, [&](Job& job) {
    job.kind = Job::kWaitFor;
    job.other = static_cast<Queue*>(other);
    job.ticket = ticket;
  });
}

int torchport_queue_wait(void* q, int64_t ticket, int timeout_ms) {
  return static_cast<Queue*>(q)->wait(ticket, timeout_ms) ? 1 : 0;
}

int64_t torchport_queue_submitted(void* q) { return static_cast<Queue*>(q)->submitted(); }
int64_t torchport_queue_completed(void* q) { return static_cast<Queue*>(q)->completed(); }
void torchport_queue_abandon(void* q) { static_cast<Queue*>(q)->abandon(); }
int torchport_queue_abandoned(void* q) { return static_cast<Queue*>(q)->abandoned() ? 1 : 0; }
void torchport_queue_run_inline(void* q) { static_cast<Queue*>(q)->run_inline(); }
PyObject* torchport_queue_take_error(void* q) { return static_cast<Queue*>(q)->take_error(); }
}
#else
#include <cstdint>

#include "native_layer.h"

// Without Python's headers there are no C++ queues: the allocator asks the stream layer.
namespace torchport::queues {
Queue* default_queue(int) { return nullptr; }
int64_t last_ticket(Queue*) { return 0; }
bool done(Queue*, int64_t) { return true; }
}  // namespace torchport::queues
#endif
