"""timm's RandAugment as an FFCV pipeline operation: batched on the training device, after ``ToDevice``
(``pipeline.data.rand_augment``), inside the train loader (``pipeline.data.loaders``)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

import pipeline.data.runtime  # noqa: F401  (first: imports ffcv keeping torch's thread count)
from pipeline.data.rand_augment import BatchRandAugment

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.operation import Operation
from ffcv.pipeline.state import State


class RandAugment(Operation):
    """FFCV operation: timm's RandAugment ``spec`` on the uint8 ``[B, 3, H, W]`` batch, on its device.

    Place it after ``ToTorchImage``; it writes into a buffer ffcv allocates per batch slot (safe
    under ffcv's CUDA-stream reuse rules) and draws from a generator seeded with ``seed``.
    """

    def __init__(self, spec: str, img_size: int, mean: tuple[float, float, float], seed: int = 0):
        super().__init__()
        self.augment = BatchRandAugment(spec, img_size, mean, seed=seed)

    def generate_code(self) -> Callable:
        augment = self.augment

        def rand_augment(images: torch.Tensor, destination: torch.Tensor) -> torch.Tensor:
            destination = destination[: images.shape[0]]
            destination.copy_(images)
            return augment.augment_(destination)

        return rand_augment

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        if previous_state.dtype != torch.uint8 or previous_state.shape[0] != 3:
            raise ValueError(
                f"RandAugment runs on uint8 [3, H, W] images after ToTorchImage, got {previous_state.dtype} "
                f"{previous_state.shape}"
            )
        return (replace(previous_state, jit_mode=False),
                AllocationQuery(previous_state.shape, torch.uint8, previous_state.device))
