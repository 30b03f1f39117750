"""The notebook code path as a multi-process / multi-node script, under torchrun.

    torchrun --nproc-per-node=4 -m course_lib.torchrun_demo
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 -m course_lib.torchrun_demo

``course_lib.run(fn)`` sees torchrun's RANK/WORLD_SIZE/LOCAL_RANK, initialises the process group once
(with the ledger backend) and calls ``fn`` on this rank; every rank gets all ranks' results back. So a
function written in a lab runs unchanged on one laptop (``run`` starts the ranks) or across machines
(torchrun starts them). The course never ships its own multi-node process manager.
"""
from __future__ import annotations

import os


def _step():
    import torch
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    grad = torch.full((17, 257), float(rank + 1))
    dist.all_reduce(grad)
    grad /= world  # data parallel: the mean gradient
    return grad[0, 0].item()


def main():
    from course_lib.launch.forkserver import PRELOAD
    from course_lib.runtime.imports import import_quickly
    import_quickly(PRELOAD["minimal"])   # the collector paused: a quicker start for each rank
    from course_lib.maths import costs
    from course_lib import run
    out = run(_step)
    world = len(out)
    if int(os.environ.get("RANK", "0")) == 0:
        expected = (world + 1) / 2
        measured = costs.ledger_wire_bytes(out.ledger)
        analytic = costs.wire_bytes("all_reduce", 17 * 257 * 4, world)
        print(f"world={world} mean grad={out[0]:.3f} (expected {expected:.3f}); "
              f"wire bytes on this rank {measured:.0f} vs ring formula {analytic:.0f}")
        assert all(abs(v - expected) < 1e-6 for v in out), out
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
