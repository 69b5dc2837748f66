"""What test_ipc.py's child processes run (spawn and forkserver children import this module,
which registers the sim as a script using the device would)."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torchport.sim  # noqa: F401  (registers the device)


def child_write(t: torch.Tensor) -> None:
    """The write a child makes to a shared tensor (the parent replays it on CPU copies)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.mul_(3).add_(1)


def parent_write(t: torch.Tensor) -> None:
    """The write the parent makes afterwards (the child must see it)."""
    if t.dtype == torch.bool:
        t[::2] = True
    else:
        t.sub_(2)


def exchange(tensors: dict[str, torch.Tensor], writes: list[str], to_parent: Any,
             to_child: Any) -> None:
    """Report what the shared tensors hold, write some, see the parent's writes, release."""
    to_parent.put(("seen", {k: t.cpu() for k, t in tensors.items()},
                   torch.sim.memory_allocated()))
    for k in writes:
        child_write(tensors[k])
    torch.sim.synchronize()  # (events do not cross processes: synchronise, then signal)
    to_parent.put(("wrote",))
    assert to_child.get() == "parent wrote"
    to_parent.put(("seen", {k: t.cpu() for k, t in tensors.items()}, 0))
    assert to_child.get() == "release"
    held = torch.sim.memory_allocated()
    tensors.clear()
    gc.collect()
    to_parent.put(("released", held, torch.sim.memory_allocated()))
    assert to_child.get() == "bye"


def queue_reader(inq: Any, outq: Any) -> None:
    """Each tensor from ``inq``: its values, its storage's address here, and itself sent
    back (shared again by this receiver), until None (it keeps them until it exits)."""
    held = []
    while True:
        t = inq.get()
        if t is None:
            return
        held.append(t)
        outq.put((t.device.type, t.cpu(), t.untyped_storage().data_ptr(), t))


class Net(nn.Module):
    """mnist_hogwild's shape, small: two layers over synthetic data."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def hogwild_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 16, generator=g)
    return x, (x[:, :4].argmax(1))


def hogwild_train(rank: int, model: Net, steps: int) -> None:
    """One Hogwild worker: SGD on the shared parameters, in place, on the device."""
    x, y = (v.to("sim") for v in hogwild_data(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    torch.sim.synchronize()


def receive_error(inq: Any, outq: Any) -> None:
    """What receiving a device tensor raises here (a forked child of a device user)."""
    try:
        inq.get()
        outq.put(("no error", ""))
    except Exception as e:  # noqa: BLE001  (reported to the parent)
        outq.put((type(e).__name__, str(e)))


def event_exchange(t: torch.Tensor, to_parent: Any, to_child: Any) -> None:
    """The producer/consumer pattern of CUDA's interprocess events, both ways: wait for the
    parent's event before reading ``t``, then write it and hand the parent an event of ours
    instead of synchronising."""
    handle = to_child.get()
    ev = torch.sim.Event.from_ipc_handle(t.device, handle)
    torch.sim.current_stream().wait_event(ev)
    to_parent.put(("queried", ev.query()))
    to_parent.put(("read", t.cpu()))  # ordered after the parent's work by the wait
    t.mul_(2)
    mine = torch.sim.Event(interprocess=True)
    mine.record()
    to_parent.put(("recorded", mine.ipc_handle()))
    assert to_child.get() == "bye"  # (the event lives until the parent saw it)
