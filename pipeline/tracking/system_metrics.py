"""A node's CPU, memory and GPU use, sampled into its run's System metrics tab."""
from __future__ import annotations

import logging
from importlib.metadata import version

from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from pipeline.tracking.connection import is_new_local_store


class GpuMetricsUnavailable(RuntimeError):
    """MLflow's monitor cannot read this node's GPUs: its runs will have no GPU metrics."""


def gpu_metrics_source() -> str:
    """How MLflow's system-metrics monitor reads this node's NVIDIA GPUs (NVML through nvidia-ml-py, as its
    ``GPUMonitor`` does); raises ``GpuMetricsUnavailable`` saying why it cannot. MLflow itself only says so
    at INFO level, which the run's log leaves out."""
    try:
        import pynvml
    except ImportError as err:
        raise GpuMetricsUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py): "
                                    "MLflow records no GPU metrics on this node") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise GpuMetricsUnavailable(f"NVML cannot start ({err}): MLflow records no GPU metrics on this node") from err
    try:
        gpus, driver = pynvml.nvmlDeviceGetCount(), pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return f"MLflow records the metrics of {gpus} GPU(s) through NVML (nvidia-ml-py {version('nvidia-ml-py')}, driver {driver})"


def monitor_node_system(uri: str, run_id: str, node_id: str, interval_s: float = 10.0,
                        gpus: bool = False) -> NodeSystemMetrics | None:
    """A background monitor logging this node's CPU, memory (and, with NVML, GPU) use into the run's
    System metrics tab until it is finished (or the run ends); ``None`` where the store is a local
    file of another node. Checked before any client exists: opening a client creates a local store.
    ``gpus``: the node trains on GPUs, so a monitor without them is said in the run's log."""
    if is_new_local_store(uri):
        return None
    logger = logging.getLogger("mlflow.system_metrics")
    logger.setLevel(logging.WARNING)
    monitor = NodeSystemMetrics(run_id, sampling_interval=interval_s, node_id=node_id, tracking_uri=uri)
    if gpus and not any(isinstance(each, GPUMonitor) for each in monitor.monitors):
        try:
            gpu_metrics_source()
        except GpuMetricsUnavailable as err:
            logger.warning("%s: %s", node_id, err)
    monitor.start()
    return monitor


class NodeSystemMetrics(SystemMetricsMonitor):
    """MLflow's system-metrics monitor, which also logs a last sample when it is finished: MLflow's own
    logs only at the end of each full sampling interval, so a run shorter than one would have none."""

    def finish(self) -> None:
        super().finish()
        try:
            self.collect_metrics()
            self.publish_metrics(self.aggregate_metrics())  # with what the loop sampled since its last one
            self.mlflow_logger.flush()
        except Exception as err:  # noqa: BLE001  (as MLflow's own monitor: never fail the run over its metrics)
            logging.getLogger("mlflow.system_metrics").warning("could not log the last system metrics sample: %s", err)
