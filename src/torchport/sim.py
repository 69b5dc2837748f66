"""``import torchport.sim`` registers the sim device and ``torch.sim``."""

from torchport.backends.sim import BACKEND, SimRuntime, runtime  # noqa: F401
