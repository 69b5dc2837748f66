"""Backends shipped with torchport (the reference ``sim`` accelerator)."""
