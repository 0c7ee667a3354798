"""Host time of one AdamW step over FSDP2-style DTensor parameters: torch's AdamW (its kernels
dispatched through DTensor) against LocalShardAdamW (longmoe/train/optim.py, the same kernels on
the local shards). One rank, a one-rank mesh; as many parameters as the model preset has (653 for
Qwen3.5-35B-A3B at 40 layers with 32 experts), each of --numel elements, since the dispatch cost
goes with the count of tensors, not their size. The time is the process's CPU time for the step
call (kernels issued, not waited for), the least of --repeats.

    python bench/adamw_host.py --out results/cpu/adamw_host.json
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

from longmoe.bench import write_json_and_table
from longmoe.bench.tables import plain_table


def parameter_count(preset: str, layers: int, experts: int) -> int:
    from longmoe.config import get_preset
    from longmoe.model.transformer import MoETransformer
    cfg = get_preset(preset)
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                  for i in range(layers))
    cfg = cfg.replace(num_layers=layers, num_experts=experts, layer_types=types)
    with torch.device("meta"):
        return len(list(MoETransformer(cfg).parameters()))


def host_ms(opt, repeats: int) -> float:
    opt.step()  # state creation
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        opt.step()
        best = min(best, time.process_time() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--numel", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    a = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from longmoe.backends import active_backend
    from longmoe.train.optim import LocalShardAdamW
    be = active_backend()
    be.set_device(0)
    dev = be.device(0)
    n = parameter_count(a.preset, a.layers, a.experts)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(be.dist_backend, init_method=f"file://{os.path.join(d, 'rdv')}",
                                rank=0, world_size=1)
        try:
            mesh = init_device_mesh(dev.type, (1,))
            rows = []
            for kernel in ("fused", "foreach"):
                row = {"params": n, "numel_each": a.numel, "kernel": kernel}
                for name, cls in (("torch_adamw_ms", torch.optim.AdamW),
                                  ("local_shard_adamw_ms", LocalShardAdamW)):
                    ps = [torch.nn.Parameter(distribute_tensor(
                        torch.randn(a.numel, device=dev), mesh, [Shard(0)])) for _ in range(n)]
                    for p in ps:
                        p.grad = torch.randn_like(p)
                    row[name] = round(host_ms(cls(ps, lr=1e-4, **{kernel: True}), a.repeats), 2)
                be.synchronize()
                print(row, flush=True)
                rows.append(row)
        finally:
            dist.destroy_process_group()
    if a.out:
        write_json_and_table({"bench": "adamw-host", "rows": rows}, a.out, plain_table, be)


if __name__ == "__main__":
    main()
