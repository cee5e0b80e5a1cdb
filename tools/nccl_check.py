"""An NCCL process group of world size 1, created and used once (the GPU check's step 4).

    python tools/nccl_check.py          # on a machine with a GPU; exit 0 when every call worked

Tensor parallelism over NCCL has never run on two GPUs here (every lent machine had one); this
is the most of it one GPU can run: stage 15's rendezvous (`open_rendezvous`: rank 0's TCP store
on a port the OS picks) and the group built the way `init_tensor_parallel` builds it for NCCL
(`ProcessGroupNCCL` over that store, with its timeout), then an all-reduce, an all-gather and a
barrier on CUDA tensors, each checked, and the group shut down. It prints one line per call.
"""

from __future__ import annotations

import importlib
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMEOUT_SECONDS = 20.0


def main() -> int:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("nccl_check: needs CUDA and NCCL (this machine has neither)", file=sys.stderr)
        return 1
    from stages import load

    group_module = importlib.import_module(f"{load('15').__name__}.parallel.group")
    store, address = group_module.open_rendezvous(1, TIMEOUT_SECONDS)
    print(f"rendezvous at {address}", flush=True)
    options = dist.ProcessGroupNCCL.Options()  # as init_tensor_parallel does for "nccl"
    options._timeout = timedelta(seconds=TIMEOUT_SECONDS)
    torch.cuda.set_device(0)
    group = dist.ProcessGroupNCCL(store, 0, 1, options)
    version = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"NCCL {version}: a group of world size 1", flush=True)
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    group.allreduce([x]).wait()
    torch.cuda.synchronize()
    assert x.tolist() == list(range(8)), x
    print("all_reduce: ok (one rank: the sum is the tensor)", flush=True)
    parts = [torch.empty_like(x)]
    group.allgather([parts], [x]).wait()
    torch.cuda.synchronize()
    assert torch.equal(parts[0], x)
    print("all_gather: ok", flush=True)
    group.barrier().wait()
    print("barrier: ok", flush=True)
    if hasattr(group, "shutdown"):  # torch >= 2.5: release the communicator now
        group.shutdown()
    del group, store
    print("nccl_check: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
