"""Integrations with libraries that choose a device from a fixed list of vendors.

Each module makes one family of libraries treat the torchport device as they treat a GPU,
by the libraries' own mechanisms where those exist and by small, recorded, reversible
patches where they do not (:mod:`torchport.integrations.huggingface`).
"""
