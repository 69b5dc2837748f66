"""Graph mode: ``torch.compile`` and exported programs on the device."""
