"""``TORCHPORT_TRANSFER=1``: enable :mod:`torchport.transfer` when a backend registers.

Listed in :mod:`torchport.features`, so it is imported during backend
registration; importing :mod:`torchport.transfer` then (no backend active yet)
hooks the device module, and transfer turns on as the device module is made.
"""

from torchport import settings

if settings.get("TORCHPORT_TRANSFER"):
    import torchport.transfer  # noqa: F401
