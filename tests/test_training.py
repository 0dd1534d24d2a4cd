"""`vitsweep train` end to end: Ray Train workers x DeepSpeed x FFCV, every run in MLflow. Two runs: the
cluster job's engine with an EMA (``two_epoch_run``), then a linear probe of its EMA weights, stopped by
SIGTERM once its first epoch is checkpointed (``stopped_linear_probe``)."""
import json
import os
import re
import signal
from pathlib import Path

import mlflow
import mlflow.pytorch
import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import (RunningVitsweep, assert_scores_the_runs_metrics, processes_started_below, ray_processes,
                      refused_in_process, run_vitsweep, train_command, wait_for)
from models.measure import count_gmacs
from pipeline.cli import EXIT_OK, main
from pipeline.config.loading import load_config
from pipeline.data.sidecar import read_sidecar
from pipeline.trained.model_source import resolve_model_source
from pipeline.tracking.store import MlflowRun

pytestmark = pytest.mark.slow

METRICS = {"train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_sec", "tflops_per_sec", "epoch_time_s"}
ARTIFACTS = {"config.yaml", "deepspeed.json", "model_summary.txt", "model.safetensors"}


def _only_run(storage):
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    experiment = client.get_experiment_by_name("vitsweep")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


# One run of the cluster job's engine (cluster/jobs/a100_8x8.yaml: ZeRO-2 in bf16, repeated augmentation) that keeps an EMA of
# the weights and, like the demo's first run, writes its offline dataset itself before training. It gives
# its rate per 512 images, DeiT's way: 1.6e-2 x a global batch of 64 (2 workers x 32) / 512 = 2e-3. The
# other engines train end to end elsewhere: ZeRO-1 in fp32 (the smoke preset's, most runs), ZeRO-3
# (``finished_run``, conftest, which keeps no EMA: test_distillation) and ZeRO-0 (test_cluster_growing_sweep's TPE sweep).
# It also profiles two steps (``run.profile``).
EFFECTIVE_LR, GLOBAL_BATCH, RATE_KEY, RATE = 2e-3, 64, "optim.lr_per_512", 1.6e-2
TARGET = 15  # val_top1 (%): 1.5x chance, which the run reaches within its two epochs


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    storage = tmp_path_factory.mktemp("zero2-bf16")
    data = {"train": storage / "data" / "train.beton", "val": storage / "data" / "val.beton"}
    result = run_vitsweep(train_command(
        storage, data, "run.name=e2e", "optim.epochs=2", "optim.lr=null", f"{RATE_KEY}={RATE}",
        "deepspeed.zero_stage=2", "deepspeed.precision=bf16", "optim.ema_decay=0.9", "data.prepare=digits",
        "run.profile=steps:2", f"run.target_metric=val_top1>={TARGET}", "data.repeated_augmentation=3",
        "data.progressive.start_size=8", "data.progressive.end_epoch=2",  # epoch 1's crops at 8 px, epoch 2's at 16
    ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return storage, result


def test_training_reports_progress_and_where_the_run_is(two_epoch_run):
    storage, result = two_epoch_run
    assert "epoch 1/2  train_loss" in result.stdout and "epoch 2/2  train_loss" in result.stdout
    assert re.search(r"^epoch 1/2  step \d+/\d+  loss [\d.]+  \d+ img/s  eta \d+:\d\d$", result.stdout, re.M)
    # repeated augmentation keeps the epoch's length: the 1,437 training digits, 718 per rank, 22 batches of 32
    assert re.search(r"^epoch 1/2  step \d+/22  ", result.stdout, re.M)
    # piped (not a terminal), in order: each epoch's progress, its line, then the next epoch's progress
    order = [(int(epoch), kind == "train_loss")
             for epoch, kind in re.findall(r"^epoch (\d+)/2  (step|train_loss)", result.stdout, re.M)]
    assert order == sorted(order) and order.count((1, True)) == order.count((2, True)) == 1, result.stdout
    assert f"sqlite:///{storage}/mlflow.db" in result.stdout and "mlflow ui" in result.stdout
    assert "workflowType=machine_learning" in result.stdout  # the UI link opens the runs view, not GenAI


LIBRARY_NOISE = ("TrainingReport(", "Checkpoint successfully created", "built successfully", "No CUDA runtime",
                 "PreemptionWatcher", "core_worker", "TensorBoard", "Token authentication", "\x1b[")


def test_the_console_carries_only_vitsweeps_own_lines_and_the_log_file_the_rest(two_epoch_run):
    storage, result = two_epoch_run
    console = result.stdout + result.stderr
    assert not [noise for noise in LIBRARY_NOISE if noise in console], console[-3000:]
    assert not result.stderr  # MLflow's "Creating initial MLflow database tables..." for this new store included
    assert all(line.startswith(("writing the offline digits", "training e2e", "epoch ", "reached val_top1", "finished e2e",
                                "  "))
               or not line.strip()
               for line in result.stdout.splitlines()), result.stdout
    log = (storage / "e2e" / "vitsweep.log").read_text()
    assert f"library output in {storage / 'e2e' / 'vitsweep.log'}" in result.stdout
    assert "TrainController" in log and "Token authentication" in log


# A command asked again is answered from the run's record.
def test_a_finished_run_asked_for_again_is_not_retrained(two_epoch_run, capsys):
    storage, first = two_epoch_run
    with processes_started_below(os.getpid()) as started:
        assert main(first.args[1:]) == EXIT_OK
    out = capsys.readouterr().out
    assert "already finished with this config" in out and str(storage / "e2e") in out
    assert not ray_processes(started), sorted(started)
    client, run = _only_run(storage)
    assert len(client.get_metric_history(run.info.run_id, "val_top1")) == 2  # nothing trained again
    assert len(run.outputs.model_outputs) == 1


def test_a_finished_run_asked_for_with_another_config_is_refused_naming_the_keys(two_epoch_run, capsys):
    storage, first = two_epoch_run
    key, rate = RATE_KEY, RATE
    err = refused_in_process([*first.args[1:], "--set", f"{key}={rate * 2}", "--set", "model.args.depth=3"], capsys)
    assert "was trained with another config: " in err
    assert f"{key}: {rate} -> {rate * 2}" in err and "model.args.depth: 2 -> 3" in err
    _, run = _only_run(storage)
    assert run.data.params[key] == str(rate) and run.info.status == "FINISHED"


def test_its_profile_is_a_chrome_trace_of_the_two_steps_asked_with_the_engines_forward_backward_and_update(
        two_epoch_run):
    storage, _ = two_epoch_run
    client, run = _only_run(storage)
    assert run.data.params["run.profile"] == "steps:2"
    directory = Path(client.download_artifacts(run.info.run_id, "profile", str(storage / "downloaded")))
    # on CPU no memory snapshot
    assert sorted(path.name for path in directory.iterdir()) == ["rank0_ops.txt", "rank0_trace.json"]
    events = json.loads((directory / "rank0_trace.json").read_text())["traceEvents"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#")]
    assert len(spans) == 2, spans  # the command's third and fourth steps
    for start, end in spans:
        ops = {e["name"] for e in events if e.get("ph") == "X" and start <= e["ts"] <= end}
        assert {"aten::conv2d", "aten::linear", "aten::softmax"} <= ops, sorted(ops)  # the XCiT forward
        assert any(op.startswith("autograd::engine::evaluate_function: AddmmBackward") for op in ops)  # backward
        assert any(op.startswith("Optimizer.step#") for op in ops), sorted(ops)  # DeepSpeed's update


HEALTH = ("loss", "loss_max", "grad_norm", "grad_clipped_share", "data_wait_share", "data_wait_share_max",
          "data_wait_slowest_rank", "peak_memory_gib", "peak_memory_rank", "lr", "loss_spikes")


def test_the_run_holds_each_health_metric_at_every_logging_step_on_the_optimizers_step_axis(two_epoch_run):
    storage, result = two_epoch_run
    client, run = _only_run(storage)
    steps = int(re.search(r"^epoch 1/2  step \d+/(\d+)", result.stdout, re.M).group(1))  # an epoch's, per rank
    every = load_config("smoke").run.log_every_steps
    logged = [epoch * steps + step for epoch in range(2) for step in range(1, steps + 1)
              if step % every == 0 or step == steps]  # one optimizer step per micro-batch (no accumulation)
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"health/{key}")}
               for key in HEALTH}
    assert {key: sorted(values) for key, values in history.items()} == {key: logged for key in HEALTH}
    # the windows' mean losses, weighted by their steps, are each epoch's train_loss
    epoch_losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    for epoch in (1, 2):
        ends = [step for step in logged if (epoch - 1) * steps < step <= epoch * steps]
        sizes = [end - start for start, end in zip([(epoch - 1) * steps, *ends], ends)]
        weighted = sum(history["loss"][end] * size for end, size in zip(ends, sizes)) / steps
        assert weighted == pytest.approx(epoch_losses[epoch], rel=1e-9)
        assert all(history["loss_max"][end] >= history["loss"][end] for end in ends)
    (last_lr,) = [m.value for m in client.get_metric_history(run.info.run_id, "lr") if m.step == 2]
    assert history["lr"][logged[-1]] == pytest.approx(last_lr)
    assert all(0 < norm < float("inf") for norm in history["grad_norm"].values())
    assert set(history["grad_clipped_share"].values()) == {0.0}  # the smoke preset does not clip
    assert set(history["loss_spikes"].values()) == {0.0}
    assert all(0 <= history["data_wait_share"][step] <= history["data_wait_share_max"][step] <= 1 for step in logged)
    assert set(history["data_wait_slowest_rank"].values()) <= {0.0, 1.0}
    assert set(history["peak_memory_rank"].values()) <= {0.0, 1.0}
    assert all(0.1 < gib < 24 for gib in history["peak_memory_gib"].values())  # a worker's resident set, in GiB


def test_the_first_epoch_that_reaches_the_target_records_the_time_and_the_spend_it_took(two_epoch_run):
    storage, result = two_epoch_run
    client, run = _only_run(storage)
    top1 = sorted(client.get_metric_history(run.info.run_id, "val_top1"), key=lambda m: m.step)
    reached = [m for m in top1 if m.value >= TARGET]
    assert reached, [m.value for m in top1]
    epoch, metrics = reached[0].step, run.data.metrics
    assert metrics["cost/target_epoch"] == epoch
    # no less than its epochs took, no more than from the run's creation to the epoch's record (MLflow's clock)
    took = sum(m.value for m in client.get_metric_history(run.info.run_id, "epoch_time_s") if m.step <= epoch)
    assert took / 3600 < metrics["cost/wall_hours_to_target"] < (reached[0].timestamp - run.info.start_time) / 3.6e6
    # 2 workers x 1 CPU: two CPU-core-hours an hour
    assert metrics["cost/accelerator_hours_to_target"] == pytest.approx(2 * metrics["cost/wall_hours_to_target"])
    assert re.search(rf"^reached val_top1>={TARGET} at epoch {epoch}, after \d+:\d\d and [\d.]+ CPU-core-hours$",
                     result.stdout, re.M), result.stdout
    assert run.data.tags["cost.unit"] == "CPU-core-hours"
    assert metrics["cost/accelerator_hours"] < 2 * (run.info.end_time - run.info.start_time) / 3.6e6


def test_the_run_records_the_rate_it_trained_at_beside_the_knob_given_and_prints_it(two_epoch_run):
    storage, result = two_epoch_run
    key, rate = RATE_KEY, RATE
    client, run = _only_run(storage)
    params = run.data.params
    assert params[key] == str(rate) and params["optim.lr_scaling"] == "linear"
    assert float(params["optim.lr_effective"]) == pytest.approx(EFFECTIVE_LR)
    assert params["optim.global_batch_size"] == str(GLOBAL_BATCH)
    assert f"lr {EFFECTIVE_LR:.3g}" in run.data.tags["mlflow.note.content"]
    assert f"  global batch {GLOBAL_BATCH} = 32 per worker x 1 accumulation step x 2 workers; lr 0.002" in result.stdout
    # The schedule peaks at that rate: no warmup (smoke), so after epoch 1 of 2 the cosine is halfway to min_lr.
    (epoch_1,) = [m.value for m in client.get_metric_history(run.info.run_id, "lr") if m.step == 1]
    assert epoch_1 == pytest.approx((EFFECTIVE_LR + float(params["optim.schedule.min_lr"])) / 2, rel=1e-3)


def test_the_mlflow_run_reads_well_in_the_ui(two_epoch_run):
    client, run = _only_run(two_epoch_run[0])
    tags = run.data.tags
    assert "xcit_nano_12_p8" in tags["mlflow.note.content"] and tags["mlflow.user"]
    assert tags["mlflow.source.name"].startswith("vitsweep train --config smoke")
    assert [m.value for m in client.get_metric_history(run.info.run_id, "epochs_trained")] == [1, 2]
    inputs = {dict((t.key, t.value) for t in i.tags)["mlflow.data.context"]: i for i in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["training", "validation"]
    for context, split in (("training", "data.train"), ("validation", "data.val")):  # each with its own file's hash
        sha256 = read_sidecar(Path(run.data.params[split])).sha256
        assert dict((t.key, t.value) for t in inputs[context].tags)["sha256"] == sha256, context
        assert inputs[context].dataset.digest == sha256[:32], context
        assert str(Path(run.data.params[split])) in inputs[context].dataset.source, context
    assert inputs["training"].dataset.digest != inputs["validation"].dataset.digest
    assert any(key.startswith("system/node0/cpu_utilization") for key in run.data.metrics)


def test_the_logged_model_carries_the_final_epochs_metrics(two_epoch_run):
    client, run = _only_run(two_epoch_run[0])
    (output,) = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    val_top1 = {m.step: m.value for m in model.metrics if m.key == "val_top1"}
    assert val_top1 == {2: run.data.metrics["val_top1"]}


def test_a_run_asked_to_prepare_its_dataset_writes_it_before_training(two_epoch_run):
    storage, _ = two_epoch_run
    written = {p.name for p in (storage / "data").glob("*")}
    assert {"train.beton", "train.beton.json", "val.beton", "val.beton.json"} <= written


def test_loss_decreases_over_two_epochs(two_epoch_run):
    # The validation loss: its 16 px crops are the same both epochs; the training loss is epoch 1's 8 px
    # crops against epoch 2's 16 px (data.progressive), two different tasks.
    client, run = _only_run(two_epoch_run[0])
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=lambda m: m.step)]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_mlflow_run_holds_every_config_value_as_a_dotted_param(two_epoch_run):
    storage, _ = two_epoch_run
    _, run = _only_run(storage)
    assert run.info.status == "FINISHED"
    # the smoke preset's keys, data.progressive (null there) as the three keys this run sets
    expected = set(load_config("smoke").flat()) - {"data.progressive"}
    expected |= {"data.progressive.start_size", "data.progressive.start_epoch", "data.progressive.end_epoch"}
    assert expected <= set(run.data.params)
    assert run.data.params["optim.epochs"] == "2"
    assert {"model_facts.params", "model_facts.gflops", "model_facts.family", "model_facts.paper"} <= set(run.data.params)


def test_mlflow_run_has_one_step_per_epoch_for_each_metric(two_epoch_run):
    client, run = _only_run(two_epoch_run[0])
    for metric in METRICS:
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [1, 2], metric  # from 1


def test_progressive_resolution_trains_each_epoch_at_its_size_says_so_and_evaluates_at_the_models(two_epoch_run):
    storage, result = two_epoch_run
    client, run = _only_run(storage)
    # data.progressive: 8 px up to start_epoch 1, model.img_size (16) from end_epoch 2, rounded to the 8-px patch
    sizes = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_img_size")}
    assert sizes == {1: 8, 2: 16}
    assert "epoch 1/2  training crops at 8 px (data.progressive: 16 px from epoch 2; validation at 16 px)" in result.stdout
    assert "epoch 2/2  training crops at 16 px" in result.stdout
    # validation and the model it hands on are at model.img_size: the card every checkpoint records says 16
    final = resolve_model_source("e2e", storage_path=storage, tracking_uri=f"sqlite:///{storage}/mlflow.db")
    assert final.card.model.img_size == 16 and run.data.params["model.img_size"] == "16"
    assert len(client.get_metric_history(run.info.run_id, "val_top1")) == 2
    # (TFLOP/s counts each epoch's images at their size: test_each_epoch_logs_its_achieved_training_tflops)


def test_mlflow_run_is_tagged_with_the_environment(two_epoch_run):
    _, run = _only_run(two_epoch_run[0])
    for tag in ("torch_version", "deepspeed_version", "ray_version", "accelerator", "world_size", "git_commit"):
        assert run.data.tags.get(tag), tag
    assert run.data.tags["world_size"] == "2"


def test_mlflow_run_holds_the_artifacts_and_a_logged_model(two_epoch_run):
    storage, _ = two_epoch_run
    client, run = _only_run(storage)
    assert run.info.artifact_uri.startswith((storage / "mlartifacts").as_uri())  # not ./mlruns of the cwd
    assert ARTIFACTS <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert len(run.outputs.model_outputs) == 1  # MLflow 3 keeps logged models beside the artifacts


def test_the_printed_model_is_the_runs_named_after_it_and_it_scores_the_runs_final_val_top1(
        two_epoch_run, monkeypatch, tmp_path):
    storage, result = two_epoch_run
    client, run = _only_run(storage)
    (printed,) = re.findall(r"^  its MLflow model: models:/(m-\w+) \(", result.stdout, re.M)
    assert printed == run.outputs.model_outputs[0].model_id and client.get_logged_model(printed).name == "e2e"
    # Not mlflow.set_tracking_uri: it would export the URI to every later test's subprocesses.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{storage}/mlflow.db")
    model = mlflow.pytorch.load_model(f"models:/{printed}")
    assert model(torch.zeros(3, 3, 16, 16)).shape == (3, 10)
    (tmp_path / "config.yaml").write_text(MlflowRun(f"sqlite:///{storage}/mlflow.db", run.info.run_id).read_artifact("config.yaml"))
    cfg = load_config(str(tmp_path / "config.yaml"))
    assert_scores_the_runs_metrics(model, cfg, Path(cfg.data.val), run.data.metrics)


def test_each_epoch_logs_its_achieved_training_tflops(two_epoch_run):
    # 6 x the model's GMACs per image at the epoch's crop size (data.progressive: 8 px, then 16) x images/s;
    # MFU needs a GPU's peak, so a CPU run logs none.
    storage, _ = two_epoch_run
    client, run = _only_run(storage)
    model = resolve_model_source("e2e", storage_path=storage, tracking_uri=f"sqlite:///{storage}/mlflow.db").build()
    gmacs = {size: count_gmacs(model, size) for size in (8, 16)}
    assert float(run.data.params["model_facts.gflops"]) == pytest.approx(gmacs[16], abs=5e-5)  # 4 decimals
    sizes = {m.step: int(m.value) for m in client.get_metric_history(run.info.run_id, "train_img_size")}
    images_per_sec = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "images_per_sec")}
    tflops = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "tflops_per_sec")}
    assert tflops == pytest.approx({step: 6 * gmacs[sizes[step]] * ips / 1e3 for step, ips in images_per_sec.items()})
    assert sorted(tflops) == [1, 2] and all(value > 0 for value in tflops.values())
    assert "mfu" not in run.data.metrics


def test_ema_metrics_and_weights_are_logged_each_epoch_when_ema_is_on(two_epoch_run):
    client, run = _only_run(two_epoch_run[0])
    for metric in ("val_top1_ema", "val_top5_ema", "val_loss_ema"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [1, 2], metric
    assert "model_ema.safetensors" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_the_finished_run_is_a_model_source_by_name_and_by_its_mlflow_model(two_epoch_run):
    storage, _ = two_epoch_run
    _, run = _only_run(storage)
    by_name, by_uri = (resolve_model_source(given, storage_path=storage, tracking_uri=f"sqlite:///{storage}/mlflow.db",
                                            ema=True) for given in ("e2e", f"runs:/{run.info.run_id}/model"))
    assert by_name.card == by_uri.card and by_name.card.model.name == run.data.params["model.name"]
    assert by_name.card.class_names == tuple(read_sidecar(run.data.params["data.train"]).classes)
    assert by_name.provenance.run_id == by_uri.provenance.run_id == run.info.run_id
    assert by_name.provenance.model_id == by_uri.provenance.model_id == run.outputs.model_outputs[0].model_id
    assert all(torch.equal(by_name.weights[key], by_uri.weights[key]) for key in by_name.weights)


# -- a linear probe of that run's EMA, stopped by SIGTERM -----------------------------------------------------

@pytest.fixture(scope="module")
def stopped_linear_probe(two_epoch_run, tmp_path_factory) -> tuple[Path, RunningVitsweep, int]:
    """A linear probe (``model.freeze=backbone``) from the run above's EMA weights (``model.init_from`` its
    run directory, ``model.init_ema``) on its dataset, one worker; sent SIGTERM (what `ray job stop`, Slurm
    and Kubernetes send; Ray's own handlers act on it) once its first epoch's checkpoint is saved. SIGINT
    shares the handler (pipeline.interrupts); its exit is checked during start-up (test_fault_injection)."""
    source, _ = two_epoch_run
    storage = tmp_path_factory.mktemp("probe")
    data = {"train": source / "data" / "train.beton", "val": source / "data" / "val.beton"}
    driver = RunningVitsweep(train_command(storage, data, "run.name=probe", "optim.epochs=30", "scaling.num_workers=1",
                                           f"model.init_from={source / 'e2e'}", "model.init_ema=true",
                                           "model.freeze=backbone"))
    driver.wait_for_line("(checkpoint saved)")
    assert driver.train_workers()
    driver.process.send_signal(signal.SIGTERM)
    return storage, driver, driver.finish(timeout=120)


def test_a_signal_to_the_driver_ends_the_run_killed_and_stops_its_workers(stopped_linear_probe):
    storage, driver, returncode = stopped_linear_probe
    assert returncode == 143, driver.output[-3000:]
    last = [line for line in driver.output.splitlines() if line.strip()][-1]
    assert last.startswith("vitsweep train: interrupted by SIGTERM; MLflow run"), driver.output[-3000:]
    _, run = _only_run(storage)
    assert run.info.status == "KILLED" and run.data.tags["stop_reason"] == "interrupted: SIGTERM"
    wait_for(lambda: not driver.processes(), 30, "every process the command started (its workers too) to end")


def test_a_linear_probe_of_a_runs_ema_trains_on_the_ema_backbone_it_loaded_and_leaves_it_as_loaded(
        stopped_linear_probe, two_epoch_run):
    from safetensors.torch import load_file

    from pipeline.components.checkpointing import read_meta

    storage, driver, _ = stopped_linear_probe
    (checkpoint,) = [path for path in (storage / "probe").glob("checkpoint_*")
                     if path.is_dir() and read_meta(path)["epoch"] == 0]  # its first epoch's
    trained = torch.load(next(checkpoint.rglob("*model_states.pt")), map_location="cpu", weights_only=True)["module"]
    (final,) = {path.parent for path in (two_epoch_run[0] / "e2e").glob("checkpoint_*/model_ema.safetensors")}
    ema, weights = load_file(final / "model_ema.safetensors"), load_file(final / "model.safetensors")
    backbone = [name for name in ema if not name.startswith("head.")]
    assert backbone and set(backbone) < set(trained)
    # an epoch of training later, every backbone tensor (buffers too) is the source's EMA tensor, bit for bit
    assert [name for name in backbone if not torch.equal(trained[name], ema[name].to(trained[name].dtype))] == []
    assert [name for name in backbone if not torch.equal(ema[name], weights[name])]  # the EMA, not the final weights
    _, run = _only_run(storage)
    assert run.data.tags["init.source"] == str(two_epoch_run[0] / "e2e")
    # the same ten digits: the head started from the EMA's too, and it alone trained
    assert not torch.equal(trained["head.weight"], ema["head.weight"].to(trained["head.weight"].dtype))
