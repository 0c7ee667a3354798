"""Process layout: world = dp_mod_ep x ep. Non-expert parameters are sharded over every rank
("dp", the whole world); experts are split over "ep" and sharded over the ranks that remain
("dp_mod_ep"), the torchtitan arrangement. EP groups are consecutive ranks so that, on GPUs, the
all-to-all stays inside a node; CP groups (ranks sharing sequences, split zigzag) are consecutive
ranks too. PP and TP are reserved and must be 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from longmoe.errors import ConfigError


def validate_layout(world: int, ep: int, num_experts: int, cp: int = 1, pp: int = 1, tp: int = 1):
    """Checks run before any process group starts."""
    if world < 1:
        raise ConfigError("nproc", f"must be >= 1, got {world}")
    if ep < 1:
        raise ConfigError("parallel.ep", f"must be >= 1, got {ep}")
    if ep > num_experts:
        raise ConfigError("parallel.ep", f"ep={ep} exceeds model.num_experts={num_experts}")
    if num_experts % ep:
        raise ConfigError("parallel.ep", f"ep={ep} does not divide model.num_experts={num_experts}")
    if world % ep:
        raise ConfigError("parallel.ep", f"world size {world} is not divisible by ep={ep}")
    if cp < 1 or world % cp:
        raise ConfigError("parallel.cp", f"cp={cp} must be >= 1 and divide the world size {world}")
    for name, v in (("pp", pp), ("tp", tp)):
        if v != 1:
            raise ConfigError(f"parallel.{name}", f"{name}={v} is not supported yet (must be 1)")


@dataclass
class Layout:
    world: int
    rank: int
    ep: int
    dp_mesh: DeviceMesh | None          # all ranks: non-expert FSDP, the global batch
    expert_mesh: DeviceMesh | None      # dp_mod_ep: expert FSDP
    ep_group: dist.ProcessGroup | None  # the all-to-all group
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None  # consecutive ranks sharing sequences

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def data_rank(self) -> int:
        """Which slice of the global batch this rank's sequences come from (CP ranks share)."""
        return self.rank // self.cp

    @property
    def data_world(self) -> int:
        return self.world // self.cp

    @property
    def batch_group(self):
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None


def build_layout(device_type: str, ep: int, cp: int = 1) -> Layout:
    """EP groups and CP groups are both runs of consecutive ranks; an EP group may span CP ranks
    (EP8 x CP4 on 32 GPUs): the MoE is per token and does not care whose sequence a token is in."""
    if not dist.is_initialized():
        return Layout(1, 0, 1, None, None, None)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    cp_group = None
    if cp > 1:
        cp_group = init_device_mesh(device_type, (world // cp, cp),
                                    mesh_dim_names=("cp_outer", "cp"))["cp"].get_group()
    if ep == 1:
        return Layout(world, rank, 1, dp_mesh, dp_mesh, None, cp, cp_group)
    mesh2 = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    return Layout(world, rank, ep, dp_mesh, mesh2["dp_mod_ep"], mesh2["ep"].get_group(),
                  cp, cp_group)
