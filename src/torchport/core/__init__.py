"""The bottom of torchport: what every layer may import and what imports nothing of torchport
but the vendor's :mod:`torchport.runtime`.

``settings`` declares every ``TORCHPORT_`` environment variable (docs/configuration.md is
generated from it); ``compat`` detects once what differs between torch releases and builds;
``contracts`` says what the layers below registration know of a backend (and its errors);
``lazy`` resolves packages' public names on first use; ``libraries`` keeps the
``torch.library`` registrations alive; ``native`` builds and loads the optional C++ device
layer (``csrc/``); ``interrupts`` carries Ctrl-C through the C++ library's Python callbacks;
``collector`` pauses the cyclic garbage collector while what lives until exit is built.
"""
