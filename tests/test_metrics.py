"""Validation metrics count every real sample exactly once across ranks: top-1 is the argmax, top-5 any
of the five best, padding rows never count, and the ranks' sums are added before dividing."""
import json
import math

import pytest
import torch
import torch.multiprocessing as torch_mp
from torch import nn

from conftest import free_port, gloo_rank
from pipeline.components.metrics import Tally, validation_metrics

NUM_CLASSES = 10


def _ranked(label: int, rank: int) -> list[float]:
    """Logits whose ``rank``-th largest (0 = the argmax) is ``label``; every other class is distinct."""
    others = [c for c in range(NUM_CLASSES) if c != label]
    order = others[:rank] + [label] + others[rank:]
    logits = [0.0] * NUM_CLASSES
    for position, cls in enumerate(order):
        logits[cls] = float(NUM_CLASSES - position) / 2  # 5.0, 4.5, ... distinct and spread
    return logits


# (label, rank of the label among the logits); padding rows are real-looking hits, so counting them shows.
RANK0_REAL = [(0, 0), (1, 4), (2, 5)]  # top-1 hit; top-5 only (the fifth); neither (the sixth)
RANK1_REAL = [(4, 0), (6, 0), (5, 1)]  # two top-1 hits; top-5 only
PADDING = (3, 0)


def _batch(rows: list[tuple[int, int]], num_real: int):
    """A validation batch as the loader yields it: images (here: the logits themselves), labels, real rows."""
    logits = torch.tensor([_ranked(label, rank) for label, rank in rows])
    return logits, torch.tensor([label for label, _ in rows]), num_real


SHARDS = {
    0: [_batch(RANK0_REAL + [PADDING], num_real=3)],
    1: [_batch(RANK1_REAL[:2], num_real=2), _batch(RANK1_REAL[2:] + [PADDING], num_real=1)],
}


def _cross_entropy(label: int, rank: int) -> float:
    logits = _ranked(label, rank)
    return math.log(sum(math.exp(z) for z in logits)) - logits[label]


def _expected(rows: list[tuple[int, int]]) -> dict[str, float]:
    """The metrics by hand: top-1 = label is the argmax, top-5 = label among the five largest."""
    return {
        "val_loss": sum(_cross_entropy(*row) for row in rows) / len(rows),
        "val_top1": 100.0 * sum(rank == 0 for _, rank in rows) / len(rows),
        "val_top5": 100.0 * sum(rank < 5 for _, rank in rows) / len(rows),
    }


def test_top1_is_the_argmax_and_top5_any_of_the_five_largest():
    tally = Tally()
    logits, labels, _ = _batch(RANK0_REAL + RANK1_REAL, num_real=6)
    tally.add(logits, labels, torch.tensor([_cross_entropy(*row) for row in RANK0_REAL + RANK1_REAL]))
    assert (tally.correct_top1, tally.correct_top5, tally.samples) == (3, 5, 6)
    assert tally.means("val") == pytest.approx(_expected(RANK0_REAL + RANK1_REAL))
    assert _expected(RANK0_REAL + RANK1_REAL)["val_top1"] == 50.0  # the hand count, for the reader


def test_fewer_than_five_classes_count_top5_over_all_of_them():
    tally = Tally()
    tally.add(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]), torch.tensor([0, 0]), torch.zeros(2))
    assert (tally.correct_top1, tally.correct_top5) == (1, 2)


def test_a_single_samples_metrics_are_its_own():
    tally = Tally()
    tally.add(torch.tensor([_ranked(7, 0)]), torch.tensor([7]), torch.tensor([0.25]))
    assert tally.means("val") == {"val_loss": 0.25, "val_top1": 100.0, "val_top5": 100.0}


def test_an_empty_tally_reports_zeros_rather_than_dividing_by_zero():
    assert Tally().means("val") == {"val_loss": 0.0, "val_top1": 0.0, "val_top5": 0.0}


def test_evaluate_drops_the_padding_rows_of_each_batch():
    metrics = validation_metrics(nn.Flatten(), SHARDS[0] + SHARDS[1], torch.float32, torch.device("cpu"))
    assert metrics == pytest.approx(_expected(RANK0_REAL + RANK1_REAL))


def test_evaluate_puts_the_model_in_eval_mode_and_feeds_it_the_input_dtype():
    seen = []
    model = nn.Flatten().train()
    model.register_forward_hook(lambda module, inputs, _: seen.append((module.training, inputs[0].dtype)))
    validation_metrics(model, SHARDS[0], torch.float64, torch.device("cpu"))
    assert seen == [(False, torch.float64)]


def _normalised(running_mean: float) -> nn.Module:
    """Logits through a BatchNorm whose running mean (this rank's own statistics) shifts one class."""
    norm = nn.BatchNorm1d(NUM_CLASSES, affine=False)
    norm.running_mean[1] = running_mean
    return norm


RUNNING_MEANS = {0: 0.0, 1: 4.0}  # each rank's BatchNorm saw other batches


def _evaluate_on_rank(rank: int, world_size: int, port: int, out_dir) -> None:
    with gloo_rank(rank, world_size, port):
        plain = validation_metrics(nn.Flatten(), SHARDS[rank], torch.float32, torch.device("cpu"))
        model = _normalised(RUNNING_MEANS[rank])
        normalised = validation_metrics(model, SHARDS[rank], torch.float32, torch.device("cpu"))
        past_float32 = Tally(samples=2.0**24 + 1).reduced(torch.device("cpu")).samples  # float32 would round it
        record = {"plain": plain, "normalised": normalised, "running_mean": model.running_mean.tolist(),
                  "samples_past_float32": past_float32}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two real processes in a gloo group, each evaluating its own shard (one with more padding)."""
    out_dir = tmp_path_factory.mktemp("two-ranks")
    torch_mp.spawn(_evaluate_on_rank, args=(2, free_port(), out_dir), nprocs=2)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_every_rank_reports_the_metrics_of_all_ranks_samples(two_ranks):
    # What one process reports over both shards (checked by hand above) is what each rank reports.
    single = validation_metrics(nn.Flatten(), SHARDS[0] + SHARDS[1], torch.float32, torch.device("cpu"))
    for rank in range(2):
        assert two_ranks[rank]["plain"] == pytest.approx(single) == _expected(RANK0_REAL + RANK1_REAL), rank
        assert two_ranks[rank]["samples_past_float32"] == 2 * (2**24 + 1), rank  # counts are summed exactly
    assert _expected(RANK0_REAL)["val_top1"] != single["val_top1"]  # a rank's own accuracy would differ


def test_every_rank_evaluates_one_model_with_batchnorm_statistics_averaged_over_ranks(two_ranks):
    # As timm's train.py does (--dist-bn reduce): the model every rank scores is the one rank 0 saves.
    average = _normalised(sum(RUNNING_MEANS.values()) / 2)
    single = validation_metrics(average, SHARDS[0] + SHARDS[1], torch.float32, torch.device("cpu"))
    for rank in range(2):
        assert two_ranks[rank]["running_mean"] == average.running_mean.tolist(), rank
        assert two_ranks[rank]["normalised"] == pytest.approx(single), rank
    assert single != pytest.approx(two_ranks[0]["plain"])  # the statistics matter to these metrics
