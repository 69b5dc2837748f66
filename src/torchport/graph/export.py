"""Exported programs on the device: ``torch.export`` unchanged, plus :func:`load` onto
another device.

``torch.export.export(model_on_device, (x,))``, ``ep.run_decompositions()`` (Core ATen),
``torch.export.save`` and ``torch.export.load(...).module()(x)`` work on a torchport device
as on CUDA: the program's fake tensors carry the device, the archive stores each weight's
bytes (copied to the host) with its device, and loading puts them back there.

What PyTorch lacks is ``torch.load``'s ``map_location``: ``torch.export.load`` recreates
every tensor on the device it was saved from, which fails where that device is absent (a
program saved on ``sim:1`` loaded where one device is visible, or exported on a CUDA
machine and deployed on the vendor's device), and
``torch.export.passes.move_to_device_pass`` moves a program only once it is loaded (and
aborts the process on a CUDA program's fake tensors in a build without CUDA). :func:`load`
moves the archive's records instead: the weights go straight to the new device, and the
devices written in the graph (``torch.arange(n, device=x.device)``'s) are the new ones.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from typing import IO, Any

import torch
from torch.export import ExportedProgram

__all__ = ["load"]

Location = torch.device | str | Mapping[str, str]


def load(f: str | os.PathLike[str] | IO[bytes], device: Location, *,
         extra_files: dict[str, Any] | None = None,
         expected_opset_version: dict[str, int] | None = None) -> ExportedProgram:
    """``torch.export.load(f)`` with every tensor of the program on ``device``.

    ``device``: where the weights, constants, example inputs and the devices written in the
    graph go (``"sim:1"``), or a mapping from the saved devices to new ones
    (``{"cuda:0": "sim:0"}``; devices not named stay), as ``move_to_device_pass`` takes.
    The saved devices need not exist here. The archive is read into memory once.
    """
    if not isinstance(device, Mapping):
        device = str(torch.device(device))  # a bad name raises here, as torch.device says
        targets = {device}
    else:
        device = {str(torch.device(k)): str(torch.device(v)) for k, v in device.items()}
        targets = set(device.values())
    for target in targets:
        # a missing device raises its own error here (torch.export.load would swallow it)
        torch.empty(0, device=target)
    return torch.export.load(_relocated(f, device), extra_files=extra_files,
                             expected_opset_version=expected_opset_version)


def _new_device(saved: str, device: str | Mapping[str, str]) -> str:
    return device.get(saved, saved) if isinstance(device, Mapping) else device


def _relocated(f: str | os.PathLike[str] | IO[bytes],
               device: str | Mapping[str, str]) -> io.BytesIO:
    """A copy of the archive with its tensors recorded on the new devices: the devices in
    the graph and in the weights' and constants' metadata, and the pickled tensors (example
    inputs, tensor subclasses)."""
    from torch.export.pt2_archive._package import PT2ArchiveReader, PT2ArchiveWriter
    from torch.export.pt2_archive.constants import (
        CONSTANTS_DIR,
        SAMPLE_INPUTS_DIR,
        WEIGHTS_DIR,
    )

    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    reader = PT2ArchiveReader(f)
    names = [n for n in reader.get_file_names() if not n.startswith(".data/")]
    pickled = {n for n in names if n.startswith(SAMPLE_INPUTS_DIR)}
    rewritten: dict[str, bytes] = {}
    for name in names:
        if not name.endswith(".json"):
            continue
        doc = json.loads(reader.read_string(name))
        _move_devices(doc, device)
        rewritten[name] = json.dumps(doc).encode()
        if name.startswith((WEIGHTS_DIR, CONSTANTS_DIR)):
            directory = WEIGHTS_DIR if name.startswith(WEIGHTS_DIR) else CONSTANTS_DIR
            pickled |= {directory + p["path_name"] for p in doc.get("config", {}).values()
                        if p.get("use_pickle") and p.get("tensor_meta") is not None}
    out = io.BytesIO()
    with PT2ArchiveWriter(out) as writer:
        for name in names:
            if name in rewritten:
                data = rewritten[name]
            elif name in pickled:
                data = _repickled(reader.read_bytes(name), device)
            else:
                data = reader.read_bytes(name)
            writer.write_bytes(name, data)
    out.seek(0)
    return out


def _move_devices(doc: Any, device: str | Mapping[str, str]) -> None:
    """Every device of a serialized program (``schema.Device``: a tensor's ``device``, a
    ``device=`` argument's ``as_device``) moved, in place."""
    if isinstance(doc, list):
        for item in doc:
            _move_devices(item, device)
    elif isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("device", "as_device") and isinstance(value, dict) and "type" in value:
                new = torch.device(_new_device(_device_str(value), device))
                value["type"], value["index"] = new.type, new.index
            else:
                _move_devices(value, device)


def _device_str(d: Mapping[str, Any]) -> str:
    return d["type"] if d.get("index") is None else f"{d['type']}:{d['index']}"


def _repickled(data: bytes, device: str | Mapping[str, str]) -> bytes:
    """A ``torch.save`` payload with its tensors on the new devices."""
    if not data:
        return data
    location: Any = dict(device) if isinstance(device, Mapping) else device
    try:
        value = torch.load(io.BytesIO(data), map_location=location, weights_only=True)
    except Exception:  # as torch.export.load: script objects need the full unpickler
        value = torch.load(io.BytesIO(data), map_location=location, weights_only=False)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
