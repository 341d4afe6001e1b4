"""Run a Megatron (megatron-core 0.16) model on the CPU, for checks and tests: one process.

megatron-core's GPT path runs on the CPU (gloo, world size 1, model parallel 1/1, the local
spec, the allgather MoE dispatcher, an explicit attention mask) except where it names the GPU
outright: `torch.cuda.current_device()` for the router's buffers, the rotary frequencies and the
expert token counts, and the CUDA RNG tracker's `fork` around attention dropout. Inside
`megatron_on_cpu` the first answers "cpu" and the second is a no-op (dropout is 0 in these
checks); both are restored on exit, with the process groups destroyed. The model math is
Megatron's own.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """A gloo process group of one, Megatron's model-parallel groups 1/1, and the two CUDA
    lookups answered on the CPU (see the module doc)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tracker = mp_random.get_cuda_rng_tracker()
    saved_device, saved_fork = torch.cuda.current_device, tracker.fork
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    tracker.fork = lambda *_a, **_k: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device
        tracker.fork = saved_fork
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


def causal_mask(length: int) -> torch.Tensor:
    """Megatron's attention mask for one causal sequence: True where a position may not attend."""
    return torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
