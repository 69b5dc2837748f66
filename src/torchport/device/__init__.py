"""The device as PyTorch and a CUDA user see it, below the op layer.

``device_module`` is ``torch.<device>`` (devices, memory, RNG, mirroring ``torch.cuda``);
``streams`` gives streams and events (through the C++ device guard); ``forking`` raises
CUDA's error in a process forked after the device was used; ``accelerator_memory``
answers ``torch.accelerator``'s memory API; ``sharing`` passes device tensors to other
processes; ``profiling`` gives ``torch.profiler`` device time; ``serialization`` and
``tensor_types`` make checkpoints and ``.data =`` behave as on CUDA. Each feature module is
installed for a backend as it registers (:mod:`torchport.features`). It imports
:mod:`torchport.memory` and :mod:`torchport.core`, never the op layer.
"""
