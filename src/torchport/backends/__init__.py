"""Backends shipped with torchport: ``sim`` (the simulated accelerator), ``reference`` (a
discrete, asynchronous device with a handful of numpy kernels) and ``opencl``; and
``host_memory``, the C copies a runtime over host memory gives torchport
(``Runtime.native_copies``)."""
