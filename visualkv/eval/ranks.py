"""Data parallelism from the launcher's environment (torchrun, accelerate launch, or none).

torchrun and `accelerate launch` on GPUs set RANK, WORLD_SIZE and LOCAL_RANK (and MASTER_ADDR / MASTER_PORT);
accelerate's CPU processes run under mpirun, whose names (PMI_*, OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*) are read
as accelerate reads them; without any the run is rank 0 of 1. Each rank takes a disjoint shard (every WORLD_SIZE-th item from its rank on), so ranks over
several machines split one item list; ranks meet at a barrier through a gloo process group (CPU-only
traffic, so the same on GPUs and CPUs) before rank 0 merges.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
#: ranks wait this long at the barrier for the slowest rank's shard
BARRIER_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def label(self) -> str:
        return f"rank {self.rank}/{self.world}"

    def shard(self, items: list[T]) -> list[T]:
        return items[self.rank :: self.world]


RANK_NAMES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
WORLD_NAMES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
LOCAL_NAMES = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")


def _first(env, names: tuple[str, ...], default: int) -> int:
    return next((int(env[n]) for n in names if env.get(n, "").strip()), default)


def from_env(env: dict[str, str] | None = None) -> Rank:
    env = os.environ if env is None else env
    rank = _first(env, RANK_NAMES, 0)
    return Rank(rank=rank, world=_first(env, WORLD_NAMES, 1), local=_first(env, LOCAL_NAMES, rank))


def device_for(rank: Rank, device: str) -> str:
    """On CUDA each rank of a machine takes the GPU of its local rank ("cuda" -> "cuda:LOCAL_RANK"); "auto"
    (device_map over every GPU) stays for a single process only."""
    if device in ("cuda", "auto") and rank.world > 1:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(rank.local)
            return f"cuda:{rank.local}"
        return "cpu" if device == "auto" else device
    return device


def start(rank: Rank) -> None:
    """Join the ranks' process group (several ranks only)."""
    if rank.world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank.rank, world_size=rank.world, timeout=BARRIER_TIMEOUT)


def barrier(rank: Rank) -> None:
    if rank.world > 1:
        import torch.distributed as dist

        dist.barrier()


def stop(rank: Rank) -> None:
    if rank.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
