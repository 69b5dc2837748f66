/* The C entry of a vendor's out= kernel (torchport's kernel API for kernels written in C or
 * C++): declared with KernelSet.c_out_kernel("add.out", fn) in Python, where fn is the
 * function's address (a ctypes function of the vendor's library). torchport derives the
 * functional and in-place overloads as for a Python out_kernel and calls the function with
 * ready outputs, from C++ without Python (or through ctypes where torchport's C++ library is
 * not built): the same arguments either way.
 *
 * Include it from the path torchport.ops.c_kernels.HEADER gives; it needs DLPack's header
 * (ATen/dlpack.h, shipped with torch, or dlpack/dlpack.h). Plain C, no torch symbol used. */
#ifndef TORCHPORT_KERNEL_H_
#define TORCHPORT_KERNEL_H_

#if defined(__has_include)
#if __has_include(<dlpack/dlpack.h>)
#include <dlpack/dlpack.h>
#else
#include <ATen/dlpack.h>
#endif
#else
#include <dlpack/dlpack.h>
#endif

#include <stddef.h>
#include <stdint.h>

#define TORCHPORT_KERNEL_ABI 1

/* What an argument holds (TorchportArg.kind). */
enum {
  TORCHPORT_ARG_NONE = 0,        /* an optional argument not given */
  TORCHPORT_ARG_TENSOR = 1,      /* tensor */
  TORCHPORT_ARG_INT = 2,         /* i (also an integer Scalar) */
  TORCHPORT_ARG_FLOAT = 3,       /* f[0] (also a floating Scalar) */
  TORCHPORT_ARG_BOOL = 4,        /* i: 0 or 1 (also a bool Scalar) */
  TORCHPORT_ARG_COMPLEX = 5,     /* f[0] + f[1] i (a complex Scalar) */
  TORCHPORT_ARG_TENSOR_LIST = 6, /* tensors[0 .. count) */
  TORCHPORT_ARG_INT_LIST = 7,    /* ints[0 .. count) */
  TORCHPORT_ARG_FLOAT_LIST = 8,  /* floats[0 .. count) */
  TORCHPORT_ARG_STRING = 9,      /* str (count bytes, NUL-terminated) */
  TORCHPORT_ARG_DTYPE = 10       /* dtype (a ScalarType argument: sum's dtype=) */
};

/* One argument of the out= overload, in its schema's order (the out= tensors last).
 * A tensor's data is the runtime's address of its first element (storage offset included;
 * byte_offset is 0); device.device_type is kDLExtDev with the logical device index, or kDLCPU
 * for a CPU scalar tensor (a Python number the dispatcher wrapped: `x + 2`). Strides are in
 * elements. Everything is valid for the call only. */
typedef struct TorchportArg {
  int32_t kind;
  int32_t count;
  const char* name; /* the schema's name: "self", "other", "alpha", "out" */
  DLTensor tensor;
  const DLTensor* tensors;
  int64_t i;
  double f[2];
  const int64_t* ints;
  const double* floats;
  const char* str;
  DLDataType dtype;
} TorchportArg;

/* One call. stream: the runtime's handle of the device's current stream (what the Python
 * runtime's streams are: launch there). A failure's message goes into error (error_size
 * bytes, NUL-terminated; torchport raises it as a RuntimeError naming the op). */
typedef struct TorchportCall {
  int32_t abi; /* TORCHPORT_KERNEL_ABI */
  int32_t nargs;
  const TorchportArg* args;
  int32_t device;
  int64_t stream;
  char* error;
  size_t error_size;
} TorchportCall;

/* What the kernel returns. */
enum {
  TORCHPORT_OK = 0,
  TORCHPORT_DECLINE = 1, /* not this input (nothing written): the op takes its next path */
  TORCHPORT_ERROR = 2    /* failed: the message in call->error */
};

typedef int32_t (*TorchportKernel)(const TorchportCall* call);

#endif /* TORCHPORT_KERNEL_H_ */
