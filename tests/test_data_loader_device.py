"""DeviceLoader: ffcv's Loader whose epoch thread selects the loader's CUDA device before its first
batch (else each rank's loader thread opens a context on GPU 0). On CPU it must be ffcv's Loader,
batch for batch, epoch after epoch."""
import torch

from pipeline.config.schema import AugmentConfig, DataConfig
from pipeline.data.loaders import ORDERS, DeviceLoader, train_pipelines
from pipeline.data.runtime import ThreadCountPreservingLoader
from pipeline.data.sources import DigitsSource
from pipeline.data.writing import write_beton

PLAIN = AugmentConfig(rand_augment=None, hflip=0.0, mixup_alpha=0.0, cutmix_alpha=0.0, random_erasing=0.0)


def epochs(loader, count: int) -> list[list[torch.Tensor]]:
    return [[labels.clone() for _, labels in loader] for _ in range(count)]


def test_device_loader_yields_ffcvs_batches_in_ffcvs_order_every_epoch(tmp_path):
    path = tmp_path / "digits.beton"
    write_beton(DigitsSource("val", 16), path, num_workers=1)
    data = DataConfig(num_workers=1, augment=PLAIN)
    options = dict(batch_size=32, num_workers=1, order=ORDERS["random"], seed=3, drop_last=True)
    ours = DeviceLoader(str(path), pipelines=train_pipelines(data, 12, torch.device("cpu")), device=torch.device("cpu"),
                        **options)
    ffcv = ThreadCountPreservingLoader(str(path), pipelines=train_pipelines(data, 12, torch.device("cpu")), **options)
    ours_epochs, ffcv_epochs = epochs(ours, 2), epochs(ffcv, 2)
    assert len(ours_epochs[0]) == 360 // 32
    for mine, theirs in zip(ours_epochs, ffcv_epochs):
        torch.testing.assert_close(torch.cat(mine), torch.cat(theirs))
    assert not torch.equal(torch.cat(ours_epochs[0]), torch.cat(ours_epochs[1]))  # reshuffled per epoch
