"""FFCV loaders, one function per split, with their pipelines declared per field (as ffcv-imagenet).

Both return batches of ``(images [B, 3, S, S] float32 normalised, labels [B] int64)`` on ``device``.
The batch tensors are ffcv's reused buffers: consume them before the next batch, copy what you keep.

Distributed (``distributed=True``, torch.distributed initialised, as inside Ray Train workers):
ffcv shards with torch's ``DistributedSampler``, so each rank reads its own ``ceil(N / world)``
samples. To make that even it pads with repeats of the first samples, placed last on the ranks
that come up short; ``ValLoader`` yields the number of real samples in each batch, so metrics
count every validation sample exactly once across ranks.

The first epoch of each Loader JIT-compiles its pipeline (seconds); later epochs reuse the code.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numba
import torch
import torch.distributed as dist

from pipeline.config.schema import DataConfig
from pipeline.data.rand_augment_operation import RandAugment
from pipeline.data.integrity import check_beton
from pipeline.data.runtime import ThreadCountPreservingLoader, preserved_torch_threads, stopped_at_exit
from pipeline.data.repeated_augmentation import RepeatedAugmentation
from pipeline.errors import InvalidInputError

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import OrderOption
from ffcv.loader.epoch_iterator import EpochIterator
from ffcv.pipeline import Compiler
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.operation import Operation
from ffcv.pipeline.state import State
from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage

ORDERS = {"random": OrderOption.RANDOM, "sequential": OrderOption.SEQUENTIAL, "quasi_random": OrderOption.QUASI_RANDOM}
Pipelines = dict[str, list[Operation]]


def normalization(mean: tuple[float, float, float], std: tuple[float, float, float],
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(255 mean, 1 / (255 std)) as float32 [1, 3, 1, 1]: ``(x - first) * second`` normalises uint8 pixels.
    ``NormalizeToFloat`` and ``pipeline.data.images`` both use these, so their float32 results are equal."""
    mean_255, std_255 = torch.tensor(mean) * 255, torch.tensor(std) * 255
    return mean_255.view(1, 3, 1, 1).to(device), (1 / std_255).view(1, 3, 1, 1).to(device)


class NormalizeToFloat(Operation):
    """uint8 [B, C, H, W] -> float32 ``(x - 255 mean) / (255 std)``, with torch ops on the batch's device.

    ffcv's own ``NormalizeImage`` needs cupy on GPUs (not a dependency here); this one writes into a
    buffer ffcv allocates per batch slot, so the output is safe under ffcv's CUDA-stream reuse rules.
    """

    def __init__(self, mean: tuple[float, float, float], std: tuple[float, float, float]):
        super().__init__()
        self.mean, self.std = mean, std

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        self.device = previous_state.device
        return (replace(previous_state, dtype=torch.float32),
                AllocationQuery(previous_state.shape, torch.float32, previous_state.device))

    def generate_code(self) -> Callable:
        mean, inverse_std = normalization(self.mean, self.std, self.device)

        def normalize(images: torch.Tensor, destination: torch.Tensor) -> torch.Tensor:
            destination = destination[: images.shape[0]]
            destination.copy_(images)  # uint8 channels-last -> float32 contiguous
            return destination.sub_(mean).mul_(inverse_std)

        return normalize


class _DeviceEpochIterator(EpochIterator):
    """ffcv's epoch thread, on its loader's CUDA device from its first line.

    A new thread's current CUDA device is 0. Each batch the thread enters ``torch.cuda.stream`` of
    the loader's GPU and, leaving it, restores the stream it found: device 0's, which sets device 0
    (cudaSetDevice creates a context there). Ray Train shows every worker all of its node's GPUs,
    so each rank would hold a context on GPU 0 (ffcv 1.0.2 epoch_iterator.run_pipeline).
    """

    def run(self) -> None:
        if self.loader.device.type == "cuda":
            torch.cuda.set_device(self.loader.device)
        super().run()


class DeviceLoader(ThreadCountPreservingLoader):
    """``ThreadCountPreservingLoader`` whose epoch thread runs on ``device`` (``_DeviceEpochIterator``);
    an epoch holds a whole multiple of ``batches_per_step`` batches (the optimizer step's micro-batches),
    the samples of an incomplete last step left out as ``drop_last`` leaves out an incomplete batch. So
    an epoch's steps see the same samples at any split of the step into micro-batches, and no step
    accumulates across two epochs. ``resume_within_epoch`` starts the next epoch past its first batches: a
    run resumed from a mid-epoch checkpoint reads the rest of that epoch's order (a function of the seed
    and the epoch), as the interrupted run would have."""

    def __init__(self, *args, device: torch.device, batches_per_step: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.device, self.batches_per_step = device, batches_per_step
        self.batches_done = 0  # of the next epoch, read before a mid-epoch checkpoint

    def __len__(self) -> int:
        batches = super().__len__()
        return batches - batches % self.batches_per_step

    def resume_within_epoch(self, batches_done: int) -> None:
        """The next epoch leaves out its first ``batches_done`` batches (whole optimizer steps)."""
        if batches_done % self.batches_per_step or not 0 <= batches_done < len(self):
            raise ValueError(f"cannot resume after batch {batches_done} of an epoch of {len(self)} batches in "
                             f"steps of {self.batches_per_step}")
        self.batches_done = batches_done

    def __iter__(self) -> _DeviceEpochIterator:
        # ffcv 1.0.2's Loader.__iter__, which builds its EpochIterator inline: the same steps.
        with preserved_torch_threads():
            Compiler.set_num_threads(self.num_workers)
            order = self.next_traversal_order()[self.batches_done * self.batch_size: len(self) * self.batch_size]
            self.next_epoch, self.batches_done = self.next_epoch + 1, 0
            if self.code is None or self.recompile:
                self.generate_code()
            return stopped_at_exit(_DeviceEpochIterator(self, order))


def label_pipeline(device: torch.device) -> list[Operation]:
    # Squeeze(1), not Squeeze(): a batch of one must stay [1], not become a scalar.
    return [IntDecoder(), ToTensor(), Squeeze(1), ToDevice(device, non_blocking=True)]


def train_pipelines(data: DataConfig, img_size: int, device: torch.device, seed: int = 0) -> Pipelines:
    """``seed`` seeds RandAugment's draws (give each rank its own, see ``build_train_loader``)."""
    image: list[Operation] = [
        RandomResizedCropRGBImageDecoder((img_size, img_size), scale=data.crop_scale, ratio=data.crop_ratio),
    ]
    if data.augment.hflip > 0:
        image.append(RandomHorizontalFlip(data.augment.hflip))
    image += [ToTensor(), ToDevice(device, non_blocking=True), ToTorchImage()]
    if data.augment.rand_augment:  # batched on the device, on uint8 before normalising (timm's order)
        image.append(RandAugment(data.augment.rand_augment, img_size, data.mean, seed=seed))
    image.append(NormalizeToFloat(data.mean, data.std))
    return {"image": image, "label": label_pipeline(device)}


def val_pipelines(data: DataConfig, img_size: int, device: torch.device) -> Pipelines:
    image: list[Operation] = [
        CenterCropRGBImageDecoder((img_size, img_size), ratio=data.val_crop_ratio),
        ToTensor(), ToDevice(device, non_blocking=True), ToTorchImage(), NormalizeToFloat(data.mean, data.std),
    ]
    return {"image": image, "label": label_pipeline(device)}


def build_train_loader(
    data: DataConfig,
    path: str | Path,
    batch_size: int,
    img_size: int,
    device: torch.device | str,
    distributed: bool = False,
    seed: int = 0,
    batches_per_step: int = 1,
) -> DeviceLoader:
    """Random-resized-crop training batches from a local ``.beton`` (``stage_dataset`` gives one), each
    epoch a whole number of optimizer steps of ``batches_per_step`` batches (``optim.grad_accum_steps``)."""
    check_beton(path)
    _check_distributed(distributed, data.order)
    check_decoding_threads(data.num_workers)
    # ffcv's order needs one seed on every rank; the augmentations should differ per rank.
    augment_seed = seed * 65_537 + (dist.get_rank() if distributed else 0)
    return DeviceLoader(
        str(path), batch_size=batch_size, num_workers=data.num_workers, os_cache=data.os_cache,
        order=(RepeatedAugmentation(data.repeated_augmentation) if data.repeated_augmentation else ORDERS[data.order]),
        distributed=distributed, seed=seed, drop_last=data.drop_last,
        batches_ahead=data.batches_ahead,
        pipelines=train_pipelines(data, img_size, torch.device(device), seed=augment_seed),
        device=torch.device(device), batches_per_step=batches_per_step,
    )


@dataclass
class ValLoader:
    """Center-crop validation batches as ``(images, labels, num_real)``: count ``[:num_real]`` only.

    ``num_real`` is below the batch size only in the last batch of a rank that ffcv padded; a
    rank's batches are never dropped, so every rank runs the same number of forward passes.
    """

    loader: DeviceLoader
    num_samples: int  # real samples this rank reads; summed over ranks: the dataset size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        seen = 0
        for images, labels in self.loader:
            yield images, labels, max(0, min(len(labels), self.num_samples - seen))
            seen += len(labels)


def build_val_loader(
    data: DataConfig,
    path: str | Path,
    batch_size: int,
    img_size: int,
    device: torch.device | str,
    distributed: bool = False,
) -> ValLoader:
    """Center-crop (``data.val_crop_ratio``) validation in file order; every sample once, nothing dropped."""
    sidecar = check_beton(path)
    _check_distributed(distributed, "sequential")
    check_decoding_threads(data.num_workers)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    loader = DeviceLoader(
        str(path), batch_size=batch_size, num_workers=data.num_workers, os_cache=data.os_cache,
        order=OrderOption.SEQUENTIAL, distributed=distributed, seed=0, drop_last=False,
        batches_ahead=data.batches_ahead, pipelines=val_pipelines(data, img_size, torch.device(device)),
        device=torch.device(device),
    )
    return ValLoader(loader, rank_sample_count(sidecar.num_samples, rank, world_size))


def train_steps_per_epoch(num_samples: int, data: DataConfig, batch_size: int, batches_per_step: int,
                          world_size: int) -> int:
    """The optimizer steps of a training epoch on each rank, counted as ``build_train_loader``'s loader counts
    them, before it exists: the rank's share (DistributedSampler's ceil(N/W); repeated augmentation's N // W),
    its batches (whole ones with ``data.drop_last``), their whole steps."""
    share = num_samples // world_size if data.repeated_augmentation else math.ceil(num_samples / world_size)
    batches = share // batch_size if data.drop_last else math.ceil(share / batch_size)
    return batches // batches_per_step


def rank_sample_count(num_samples: int, rank: int, world_size: int) -> int:
    """Real samples on ``rank`` under DistributedSampler sharding (rank r reads positions r, r+W, ...)."""
    return len(range(rank, num_samples, world_size))


def check_decoding_threads(num_workers: int) -> None:
    """``data.num_workers`` fits this node: ffcv decodes on numba's thread pool, which cannot grow past
    NUMBA_NUM_THREADS (the CPU count). Checked by the loaders, and before a local Ray starts."""
    available = numba.config.NUMBA_NUM_THREADS
    if num_workers > available:
        raise InvalidInputError(
            f"data.num_workers={num_workers} exceeds the {available} decoding threads this node can run "
            f"(numba's NUMBA_NUM_THREADS); use 1..{available}"
        )


def _check_distributed(distributed: bool, order: str) -> None:
    if not distributed:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("distributed=True needs torch.distributed initialised first (Ray Train does this)")
    if order == "quasi_random":
        raise InvalidInputError(
            "data.order='quasi_random' cannot be sharded across ranks by ffcv 1.0.2; use 'random' "
            "(with data.os_cache=true on a node-local copy, see stage_dataset) or train on one worker"
        )

