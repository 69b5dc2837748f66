"""``init_process_group(device_id=...)`` binds the device's c10d backend to a device.

PyTorch's DDP examples and Lightning's DDP pass ``device_id`` (it connects the device's
backend eagerly, and lets new groups split from it). c10d then asks the group for the
backend of that device, which the device's process group answers itself (it does not
split, so new groups are made as without a bound device).
"""

from __future__ import annotations

from tests.helpers import check_python, free_port


def test_init_process_group_with_device_id() -> None:
    """One rank bound to ``sim:1``: collectives on the device, a new group, a barrier."""
    out = check_python(f"""
        import os
        import torch, torchport.sim, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group(rank=0, world_size=1, device_id=torch.device("sim:1"))
        pg = dist.distributed_c10d._get_default_group()
        assert pg._get_backend(torch.device("sim:1")) is pg
        try:
            pg._get_backend(torch.device("cpu"))
        except RuntimeError as e:
            assert "No backend type" in str(e)
        else:
            raise AssertionError("a CPU backend answered")
        x = torch.arange(4.0, device="sim:1")
        dist.all_reduce(x)
        sub = dist.new_group([0])
        dist.all_reduce(x, group=sub)
        dist.barrier()
        print("ok", x.device, x.cpu().tolist())
        dist.destroy_process_group()
    """)
    assert out.split() == ["ok", "sim:1", "[0.0,", "1.0,", "2.0,", "3.0]"]
