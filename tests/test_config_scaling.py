"""scaling: one Ray Train worker per GPU. Other GPU shares are refused when the config is read, with
the reason, because DeepSpeed, FFCV and NCCL would each pick a different GPU."""
import pytest

from pipeline.config.loading import load_config
from pipeline.errors import ConfigError


@pytest.mark.parametrize("gpus", ["2", "0.5", "8"])
def test_gpus_per_worker_other_than_one_is_refused_saying_why(gpus):
    with pytest.raises(ConfigError) as err:
        load_config("smoke", ["scaling.use_gpu=true", f"scaling.gpus_per_worker={gpus}"])
    message = str(err.value)
    assert f"gpus_per_worker={float(gpus)}" in message
    assert "gpus_per_worker=1" in message and "DeepSpeed" in message and "NCCL" in message


def test_one_gpu_per_worker_is_the_gpu_configuration():
    cfg = load_config("smoke", ["scaling.use_gpu=true", "scaling.gpus_per_worker=1", "scaling.num_workers=8"])
    assert cfg.scaling.gpus_per_worker == 1 and cfg.scaling.num_workers == 8
