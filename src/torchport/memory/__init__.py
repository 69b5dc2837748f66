"""Device memory: the caching allocator and the tensors over its blocks.

``allocator`` is the caching allocator (CUDA-named statistics, OOM, stream-ordered reuse;
its pools in C++ where the library loads), with ``blocks`` (sizes, pools, blocks),
``allocator_stats`` (statistics, snapshots) and ``native_allocator`` (the glue to the C++
pools) beside it; ``tensors`` turns blocks into real torch tensors and host views;
``qtensors`` gives quantized tensors their shells; ``storage`` resizes a device storage in
place; ``pinned`` gives page-locked host memory. It imports :mod:`torchport.core` and the
vendor's :mod:`torchport.runtime`, nothing above.
"""
