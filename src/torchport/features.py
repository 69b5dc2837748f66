"""Optional layers that extend the device module; imported when a backend registers.

Each line imports a module whose ``@device_module.extend`` functions add names
to ``torch.<device>`` (streams, amp, ...). Append-only: one line per layer.
"""

FEATURE_MODULES: list[str] = [
    "torchport.distributed",
    "torchport.streams",
    "torchport.amp",
    "torchport.transfer_env",
    "torchport.storage",
    "torchport.sharing",
    "torchport.parallel_comm",
    "torchport.integrations.huggingface",
    "torchport.debug.env",
]
