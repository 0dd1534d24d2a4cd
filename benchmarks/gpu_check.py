"""The compute path on one GPU, in one prepared run: vitsweep's training step against timm's, the
input pipeline's GPU share, svPN exact against approximate, torch.compile, and the largest micro-batch.

Made for a GPU machine that is lent briefly (one H100, ~15 minutes, no package registry): it imports
no Ray, FFCV or MLflow, only torch, timm, DeepSpeed and vitsweep's own modules, and finishes well
within 8 minutes (``--budget-s`` skips what would not fit, and says so). Every figure goes to
``gpu_check.json`` and a Markdown table (``gpu_check.md``) in ``--out``:

1. For each paper's model at its ImageNet size (224 px, 1000 classes, bf16): vitsweep's step
   (``pipeline.components.engine``'s DeepSpeed engine, ZeRO-2 in one process over NCCL, BatchNorm kept
   fp32, the batch already on the GPU) against timm's own train step of the same model (bf16
   autocast, AdamW, channels_last). Images/s, step time, peak memory, TFLOP/s and MFU (the dense peak
   of ``pipeline.components.accelerator``); the top operators of one profiled step of each side.
2. The GPU share of the input pipeline: ``BatchRandAugment`` then ``BatchAugment`` (random erasing,
   Mixup/CutMix) on a GPU-resident uint8 batch, against timm's per-image RandAugment on every CPU core.
3. svPN exact (SVD) against approximate (power iteration), forward and backward, at SoT-Tiny's sizes
   (``benchmarks/bench_svpn.py``): paper 004's ~20x (Table 4c) on the hardware it was made on.
4. ``torch.compile`` of vitsweep's step (``deepspeed.compile``): speed-up and compile time.
5. The largest micro-batch each model fits, by a bounded search (doubling, then bisection).

    python benchmarks/gpu_check.py --out OUT                 # on the GPU machine (see bash benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py --device cpu --tiny --out OUT   # every code path on CPU, in the test suite
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # vitsweep's packages, run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench_svpn

# What the GPU machine does not have, and what the check must not need (tests/test_gpu_check.py).
NOT_IMPORTED = ("ray", "ffcv", "mlflow")


@dataclass(frozen=True)
class PaperModel:
    label: str
    name: str
    args: dict


MODELS = [
    PaperModel("XCiT-N12/16 (003)", "xcit_nano_12_p16", {}),
    PaperModel("XCiT-S12/16 (003)", "xcit_small_12_p16", {}),
    PaperModel("EIT-Tiny (001)", "eit16_4_3_tiny", {}),
    PaperModel("Armour DeiT-Ti (002)", "armour_tiny", {}),
    PaperModel("F-SNE XCiT-N12, c=8 (000)", "xcit_nano_12_p16", {"qkv": "fsne", "code_size": 8}),
    PaperModel("SoT-T (004)", "sot_tiny", {}),
]


@dataclass(frozen=True)
class Sizes:
    img_size: int
    num_classes: int
    batch: int
    warmup: int
    steps: int
    augment_batch: int
    svpn_batch: int
    max_batch: int  # the bound of the micro-batch search
    depth: int | None = None  # every model one block deep (tiny), else the paper's
    # how many models' steps are profiled (all on the GPU; tiny: the first, the same code path for each,
    # while reading a profile back costs seconds per step on CPU)
    profiled_models: int | None = None
    # tiny: the same capture through deepspeed.compile without inductor's code generation, whose CPU
    # half (C++, a minute on 2 cores) a GPU never runs (tests/test_engine_runtime.py compiles with it)
    compile_backend: str = "inductor"

    @classmethod
    def of(cls, tiny: bool) -> Sizes:
        if tiny:
            return cls(img_size=32, num_classes=10, batch=4, warmup=1, steps=2, augment_batch=8, svpn_batch=2,
                       max_batch=8, depth=1, profiled_models=1, compile_backend="aot_eager")
        return cls(img_size=224, num_classes=1000, batch=128, warmup=5, steps=20, augment_batch=256,
                   svpn_batch=128, max_batch=2048)

    def model_args(self, model: PaperModel) -> dict:
        return {**model.args, **({} if self.depth is None else {"depth": self.depth})}


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_single_process_group(backend: str) -> None:
    import torch.distributed as dist

    if backend == "gloo":  # as a CPU worker does: DeepSpeed then loads its CPU comm op, not rebuilds it
        from pipeline.components.engine import use_the_environments_ninja

        use_the_environments_ninja()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29561"),
                        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)


def vitsweep_config(model: PaperModel, sizes: Sizes, device, compile_step: bool = False):
    """The config vitsweep's worker would build this step from: ZeRO-2, bf16, one worker."""
    from pipeline.config.loading import load_config

    gpu = device.type == "cuda"
    return load_config("default", [
        f"model.name={model.name}", f"model.img_size={sizes.img_size}", f"model.args={json.dumps(sizes.model_args(model))}",
        f"optim.micro_batch_size={sizes.batch}", "deepspeed.zero_stage=2", "deepspeed.precision=bf16",
        f"deepspeed.compile={compile_step}", *([f"deepspeed.compile_backend={sizes.compile_backend}"] if compile_step else []),
        "scaling.num_workers=1", f"scaling.use_gpu={gpu}",
        f"scaling.gpus_per_worker={1 if gpu else 0}", "data.prepare=null",
    ])


def vitsweep_step(model: PaperModel, sizes: Sizes, device, compile_step: bool = False):
    """(step(batch) -> None, a cleanup) of vitsweep's engine for ``model``; ``batch`` images per call."""
    import deepspeed
    import torch

    from pipeline.components.engine import compile_engine, deepspeed_config, input_dtype, keep_batchnorm_in_fp32
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer, build_scheduler

    cfg = vitsweep_config(model, sizes, device, compile_step)
    net = build_model(cfg.model, sizes.num_classes)
    optimizer = build_optimizer(net, cfg.optim, effective_lr(cfg.optim, world_size=1))
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch=1000)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, world_size=1), dist_init_required=False)
    keep_batchnorm_in_fp32(engine.module)
    compile_engine(engine, cfg)
    dtype, loss_fn = input_dtype(cfg), torch.nn.CrossEntropyLoss()
    inputs = {}

    def step(batch: int) -> None:
        if batch not in inputs:
            inputs.clear()
            inputs[batch] = (torch.randn(batch, 3, sizes.img_size, sizes.img_size, device=device, dtype=dtype),
                             torch.randint(0, sizes.num_classes, (batch,), device=device))
        images, labels = inputs[batch]
        loss = loss_fn(engine(images).float(), labels)
        engine.backward(loss)
        engine.step()

    return step, engine.destroy


def timm_step(model: PaperModel, sizes: Sizes, device):
    """(step(batch) -> None, a cleanup) of timm's own train loop: the same model from timm's registry,
    channels_last, AdamW, bf16 autocast (timm's benchmark.py train mode)."""
    import timm
    import torch
    from timm.optim import create_optimizer_v2

    import models  # noqa: F401  (registers vitsweep's variants in timm)

    net = timm.create_model(model.name, num_classes=sizes.num_classes, img_size=sizes.img_size,
                            **sizes.model_args(model))
    net = net.to(device).to(memory_format=torch.channels_last).train()
    optimizer = create_optimizer_v2(net, "adamw", lr=1e-4, weight_decay=0.05)
    loss_fn, inputs = torch.nn.CrossEntropyLoss(), {}

    def step(batch: int) -> None:
        if batch not in inputs:
            inputs.clear()
            inputs[batch] = (torch.randn(batch, 3, sizes.img_size, sizes.img_size, device=device)
                             .contiguous(memory_format=torch.channels_last),
                             torch.randint(0, sizes.num_classes, (batch,), device=device))
        images, labels = inputs[batch]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(net(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step, lambda: None


def timed(step: Callable[[int], None], batch: int, warmup: int, steps: int, device) -> float:
    """Seconds per step, after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step(batch)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step(batch)
    synchronize(device)
    return (time.perf_counter() - started) / steps


def profiled(step: Callable[[int], None], batch: int, device, rows: int = 12) -> str:
    """The operators of one step, the most expensive first (self time on the device, else the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(batch)
        synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=48)


@contextlib.contextmanager
def peak_memory(device):
    """{"mb": the peak memory the block allocated on the GPU} (None on CPU: no per-block peak)."""
    import torch

    found = {"mb": None}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield found
    if device.type == "cuda":
        found["mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def largest_micro_batch(fits: Callable[[int], bool], start: int, bound: int) -> tuple[int, int]:
    """(a batch in [1, bound] for which ``fits`` holds, within 1/16 of the largest; probes made): doubling
    from ``start`` while it fits, then bisecting between the last fit and the first failure until they
    are within 1/16 of each other (each probe is one step at that batch); 0 if not even 1 fits."""
    probes, fit, fail = 0, 0, None
    batch = max(1, min(start, bound))
    while True:  # doubling (or halving down to 1 when the first probe fails)
        probes += 1
        if fits(batch):
            fit = batch
            if batch >= bound:
                return fit, probes
            batch = min(2 * batch, bound)
        else:
            fail = batch
            if fit or batch == 1:
                break
            batch //= 2
    while fail - fit > max(1, fit // 16):  # bisection: fit fits, fail does not
        middle = (fit + fail) // 2
        probes += 1
        if fits(middle):
            fit = middle
        else:
            fail = middle
    return fit, probes


def batch_fits(step: Callable[[int], None], device) -> Callable[[int], bool]:
    def fits(batch: int) -> bool:
        try:
            step(batch)
            synchronize(device)
            return True
        except Exception as error:  # noqa: BLE001  (CUDA's OOM, or the allocator's RuntimeError)
            if not is_out_of_memory(error):
                raise
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()
            return False

    return fits


def step_comparison(model: PaperModel, sizes: Sizes, device, peak: float | None, search: bool,
                    profile: bool = True) -> dict:
    from models.measure import build_on_meta, count_gmacs
    from pipeline.components.accelerator import mfu, training_tflops

    gmacs = count_gmacs(build_on_meta(model.name, num_classes=sizes.num_classes, img_size=sizes.img_size,
                                      **sizes.model_args(model)), sizes.img_size)
    result = {"model": model.label, "name": model.name, "args": model.args, "gmacs_per_image": round(gmacs, 4)}
    for side, build in (("vitsweep", vitsweep_step), ("timm", timm_step)):
        with peak_memory(device) as memory:
            step, cleanup = build(model, sizes, device)
            seconds = timed(step, sizes.batch, sizes.warmup, sizes.steps, device)
        rate = sizes.batch / seconds
        figures = {"step_ms": round(1e3 * seconds, 2), "images_per_s": round(rate, 1), "peak_memory_mb": memory["mb"],
                   "tflops": training_tflops(gmacs, rate),
                   "mfu": None if peak is None else mfu(gmacs, rate, peak),
                   "profile": profiled(step, sizes.batch, device) if profile else None}
        if search and side == "vitsweep":  # what the OOM planning of a sweep needs
            figures["largest_micro_batch"], figures["search_probes"] = largest_micro_batch(
                batch_fits(step, device), sizes.batch, sizes.max_batch)
        cleanup()
        del step
        result[side] = figures
    result["vitsweep_over_timm"] = round(result["vitsweep"]["images_per_s"] / result["timm"]["images_per_s"], 3)
    return result


def _timm_rand_augment_images(args: tuple) -> int:
    """One CPU worker's share: timm's RandAugment (DeiT's spec) on ``count`` PIL images, per image."""
    count, side, spec = args
    import numpy as np
    from PIL import Image
    from timm.data.auto_augment import rand_augment_transform

    from pipeline.data.rand_augment import timm_hparams, use_timms_posterize_as_intended

    use_timms_posterize_as_intended()  # Pillow 13 raises on 0 bits: ~0.2 % of images
    transform = rand_augment_transform(spec, timm_hparams(side, (0.485, 0.456, 0.406)))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(8)]
    for index in range(count):
        transform(images[index % len(images)])
    return count


def augment_share(sizes: Sizes, device, cpus: int) -> dict:
    """vitsweep's batched RandAugment + BatchAugment on a device-resident uint8 batch, against timm's
    per-image RandAugment on ``cpus`` processes (images/s each)."""
    import torch

    from pipeline.config.schema import AugmentConfig
    from pipeline.data.augment import BatchAugment
    from pipeline.data.rand_augment import BatchRandAugment

    spec = AugmentConfig().rand_augment  # DeiT's, the config's default
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    rand_augment = BatchRandAugment(spec, sizes.img_size, (0.485, 0.456, 0.406), seed=0)
    batch_augment = BatchAugment(AugmentConfig(), sizes.num_classes, device)
    uint8 = torch.randint(0, 256, (sizes.augment_batch, 3, sizes.img_size, sizes.img_size), dtype=torch.uint8,
                          device=device)
    labels = torch.randint(0, sizes.num_classes, (sizes.augment_batch,), device=device)

    def step(_: int) -> None:
        images = rand_augment.augment_(uint8.clone())
        batch_augment((images.float() - mean) / std, labels.clone())

    seconds = timed(step, sizes.augment_batch, sizes.warmup, sizes.steps, device)
    per_worker = max(1, (sizes.augment_batch * sizes.steps) // cpus)
    with multiprocessing.get_context("spawn").Pool(cpus) as pool:
        pool.map(_timm_rand_augment_images, [(1, sizes.img_size, spec)] * cpus)  # imports paid before the clock
        started = time.perf_counter()
        done = sum(pool.map(_timm_rand_augment_images, [(per_worker, sizes.img_size, spec)] * cpus))
        cpu_seconds = time.perf_counter() - started
    ours, theirs = sizes.augment_batch / seconds, done / cpu_seconds
    return {"spec": spec, "batch": sizes.augment_batch, "vitsweep_device_images_per_s": round(ours, 1),
            "timm_cpu_images_per_s": round(theirs, 1), "cpu_processes": cpus, "ratio": round(ours / theirs, 2)}


def svpn_timings(sizes: Sizes, device, repeats: int) -> dict:
    """Forward + backward ms of svPN exact and each approximation of Table 4c, SoT-Tiny's sizes."""
    import torch
    from bench_svpn import APPROX_SETTINGS, cross_covariances, time_forward_backward

    from models.layers.svpn import svpn_approx, svpn_exact

    shape = SimpleNamespace(batch=sizes.svpn_batch, heads=6, m=14, n=14, tokens=196)
    q = cross_covariances(shape, device)
    upstream, v0 = torch.randn_like(q), torch.randn(shape.n, device=device, requires_grad=True)
    methods = {"exact (SVD)": lambda m: svpn_exact(m, 0.5)}
    for num_sv, iters in APPROX_SETTINGS:
        methods[f"approx #sv={num_sv} #iter={iters}"] = lambda m, s=num_sv, i=iters: svpn_approx(m, v0, 0.5, s, i)
    times = {name: [] for name in methods}
    for repeat in range(1 + repeats):
        for name, fn in methods.items():  # interleaved, each after an untimed call of its own (warm)
            time_forward_backward(fn, q, upstream)
            elapsed = time_forward_backward(fn, q, upstream)
            if repeat:
                times[name].append(elapsed)
    exact = statistics.median(times["exact (SVD)"])
    return {"matrices": f"{q.shape[0]} x {shape.m} x {shape.n}",
            "ms": {name: round(statistics.median(samples), 3) for name, samples in times.items()},
            "speedup_vs_exact": {name: round(exact / statistics.median(samples), 1) for name, samples in times.items()}}


def compile_timing(model: PaperModel, sizes: Sizes, device) -> dict:
    """vitsweep's step eager and compiled (``deepspeed.compile``): images/s and the first steps' extra time."""
    rates, first = {}, {}
    for compiled in (False, True):
        step, cleanup = vitsweep_step(model, sizes, device, compile_step=compiled)
        started = time.perf_counter()
        step(sizes.batch)
        synchronize(device)
        first[compiled] = time.perf_counter() - started
        rates[compiled] = sizes.batch / timed(step, sizes.batch, sizes.warmup, sizes.steps, device)
        cleanup()
    return {"model": model.label, "backend": sizes.compile_backend, "eager_images_per_s": round(rates[False], 1),
            "compiled_images_per_s": round(rates[True], 1), "speedup": round(rates[True] / rates[False], 3),
            "compile_s": round(first[True] - first[False], 1)}


def distributions_imported() -> list[str]:
    """The installed distributions whose modules this process imported, each module attributed by where
    its file lies below the outermost ``sys.path`` entry holding it (a package vendored inside another,
    as setuptools vendors jaraco on a path entry of its own, is that other's); vitsweep's own, the
    standard library's and torch's compiled kernels are none of them. The repository is no such entry:
    a virtual environment inside it (``make setup``'s ``.venv``) would make every module its own."""
    distributions = importlib.metadata.packages_distributions()
    repository = Path(__file__).resolve().parents[1]
    roots = sorted({Path(entry).resolve() for entry in sys.path if entry and Path(entry).is_dir()} - {repository},
                   key=lambda root: len(root.parts))
    found = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        root = next((root for root in roots if path.is_relative_to(root)), None)
        if root is None:
            continue
        top = path.relative_to(root).parts[0].split(".")[0]
        found.update(dist.lower().replace("_", "-") for dist in distributions.get(top, []))
    return sorted(found - {"vitsweep"})


def markdown(report: dict) -> str:
    lines = [f"**{report['device']}**; torch {report['torch']}, DeepSpeed {report['deepspeed']}; "
             f"{report['sizes']['img_size']} px, batch {report['sizes']['batch']}, bf16, "
             f"{report['sizes']['steps']} timed steps after {report['sizes']['warmup']}; "
             f"peak {report['peak_tflops']} TFLOP/s; {report['seconds']:.0f} s in all", "",
             "| model | step | images/s | step ms | peak MB | TFLOP/s | MFU | largest micro-batch | vs timm |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in report["steps"]:
        for side in ("vitsweep", "timm"):
            f = row[side]
            ratio = f"{row['vitsweep_over_timm']:.2f}x" if side == "vitsweep" else ""
            utilisation = "n/a" if f["mfu"] is None else f"{100 * f['mfu']:.1f} %"
            lines.append(f"| {row['model']} | {side} | {f['images_per_s']} | {f['step_ms']} | {f['peak_memory_mb'] or 'n/a'} "
                         f"| {f['tflops']:.3g} | {utilisation} | {f.get('largest_micro_batch', '')} | {ratio} |")
    if report.get("augment"):
        a = report["augment"]
        lines += ["", f"Input pipeline: vitsweep's batched RandAugment + BatchAugment on the device "
                      f"{a['vitsweep_device_images_per_s']} images/s, timm's per-image RandAugment on "
                      f"{a['cpu_processes']} CPU processes {a['timm_cpu_images_per_s']} images/s ({a['ratio']}x)."]
    if report.get("svpn"):
        s = report["svpn"]
        lines += ["", f"svPN forward + backward, {s['matrices']}: "
                  + "; ".join(f"{name} {ms} ms ({s['speedup_vs_exact'][name]}x)" for name, ms in s["ms"].items())]
    if report.get("compile"):
        c = report["compile"]
        lines += ["", f"torch.compile ({c['backend']}) of vitsweep's step, {c['model']}: {c['eager_images_per_s']} -> "
                      f"{c['compiled_images_per_s']} images/s ({c['speedup']}x), compile {c['compile_s']} s."]
    lines += ["", "Skipped (time budget): " + (", ".join(report["skipped"]) or "nothing")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="32 px, batch 4, 2 steps: every code path in seconds")
    parser.add_argument("--out", type=Path, required=True, help="where gpu_check.json and gpu_check.md go")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip a part that starts after this")
    args = parser.parse_args()
    started = time.perf_counter()
    sizes, cpu = Sizes.of(args.tiny), args.device == "cpu"
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import deepspeed
    import torch

    from pipeline.components.accelerator import math_mode, peak_tflops, prepare_gpu_worker

    if cpu:
        device, name, peak = torch.device("cpu"), f"CPU ({os.cpu_count()} cores): not a GPU result", None
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        name = f"{prepare_gpu_worker(tf32=True)}"
        peak = peak_tflops(torch.cuda.get_device_name(device), math_mode("bf16", tf32=True))
    init_single_process_group("gloo" if cpu else "nccl")

    report = {"device": name, "torch": torch.__version__, "deepspeed": deepspeed.__version__, "peak_tflops": peak,
              "sizes": sizes.__dict__, "steps": [], "skipped": []}
    args.out.mkdir(parents=True, exist_ok=True)

    report["part_seconds"] = {}

    def run_part(part: str, measure: Callable[[], dict]) -> dict | None:
        """``measure()``'s figures, unless the budget is spent (the part is then listed as skipped)."""
        if time.perf_counter() - started >= args.budget_s:
            report["skipped"].append(part)
            return None
        part_started = time.perf_counter()
        figures = measure()
        report["part_seconds"][part] = round(time.perf_counter() - part_started, 1)
        print(f"{part}: {report['part_seconds'][part]} s", flush=True)
        return figures

    for index, model in enumerate(MODELS):
        profile = sizes.profiled_models is None or index < sizes.profiled_models
        row = run_part(f"step {model.label}",
                       lambda model=model, profile=profile: step_comparison(model, sizes, device, peak, True, profile))
        if row is not None:
            report["steps"].append(row)
    report["augment"] = run_part("input pipeline", lambda: augment_share(sizes, device, cpus=os.cpu_count() or 1))
    report["svpn"] = run_part("svPN", lambda: svpn_timings(sizes, device, repeats=3 if args.tiny else 20))
    report["compile"] = run_part("torch.compile", lambda: compile_timing(MODELS[0], sizes, device))
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["imported"] = sorted({module.split(".")[0] for module in sys.modules} & set(NOT_IMPORTED))
    report["distributions_imported"] = distributions_imported()
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
