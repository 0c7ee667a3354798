"""The policy-update API an RL framework calls (docs/api.md): PolicyTrainer, and run_local to
start its SPMD ranks on one machine without torchrun."""

from longmoe.api.policy import PolicyTrainer


def run_local(fn, nproc: int, *args, device: str = "cpu") -> list:
    """fn(rank, world, backend, *args) on `nproc` spawned local ranks, each inside its own
    initialised process group (gloo on CPU, the device's collective backend on GPUs; a file
    store in a private temporary directory, so no port is raced for); returns what each rank
    returned, in rank order. `fn` must be importable at module level (ranks start with spawn).
    Under torchrun, initialise torch.distributed yourself and call fn's body directly."""
    from longmoe.paired.spawn import run_ranks
    return run_ranks(fn, nproc, *args, device=device)


__all__ = ["PolicyTrainer", "run_local"]
