"""What held the memory when a rank ran out of it, left by the worker before the error ends it.

``rank<R>_memory.txt``: the process's resident memory now and at its peak, and the largest tensors
still alive (the model's weights, the optimizer's states, the batch's activations a backward pass
holds), by size; on a GPU also the CUDA caching allocator's summary. On a GPU, beside it,
``rank<R>_memory_snapshot.pickle``: the allocator's segments and blocks as it held them
(https://pytorch.org/memory_viz opens it; its allocation history too while ``run.profile`` records it).
Nothing runs before the error: the snapshot is taken from the state the error left.
"""
from __future__ import annotations

import gc
from pathlib import Path

import psutil
import torch

from pipeline.components.health import peak_memory_bytes

LARGEST_TENSORS = 25  # listed in the text, by size


def live_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector can reach (parameters and their gradients included)."""
    found, seen = [], set()
    for candidate in gc.get_objects():
        try:
            tensor = candidate if isinstance(candidate, torch.Tensor) else None
        except ReferenceError:  # a weak proxy whose object is gone
            continue
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            found.append(tensor)
    return found


def describe_memory(rank: int, device: torch.device) -> str:
    """The text snapshot: resident and peak memory, the largest live tensors, and the allocator's summary."""
    mib = 1 << 20
    tensors = sorted(live_tensors(), key=lambda t: t.numel() * t.element_size(), reverse=True)
    on_device = [t for t in tensors if t.device.type == device.type]
    lines = [f"rank {rank} ran out of memory on {device}",
             f"process resident memory: {psutil.Process().memory_info().rss / mib:.1f} MiB now, "
             f"peak {peak_memory_bytes(torch.device('cpu')) / mib:.1f} MiB",
             f"live tensors on {device.type}: {len(on_device)}, "
             f"{sum(t.numel() * t.element_size() for t in on_device) / mib:.1f} MiB; the largest:"]
    lines += [f"  {t.numel() * t.element_size() / mib:10.3f} MiB  {str(t.dtype):16} {tuple(t.shape)}"
              for t in on_device[:LARGEST_TENSORS]]
    if device.type == "cuda":
        lines += ["", torch.cuda.memory_summary(device)]
    return "\n".join(lines) + "\n"


def write_memory_snapshot(directory: Path, rank: int, device: torch.device) -> Path:
    """The snapshot's files in ``directory`` (made if need be); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}_memory.txt").write_text(describe_memory(rank, device))
    if device.type == "cuda":
        torch.cuda.memory._dump_snapshot(str(directory / f"rank{rank}_memory_snapshot.pickle"))
    return directory
