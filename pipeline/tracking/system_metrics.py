"""A node's CPU, memory and GPU use, sampled into its run's System metrics tab."""
from __future__ import annotations

import logging

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from pipeline.tracking.connection import is_new_local_store

def monitor_node_system(uri: str, run_id: str, node_id: str, interval_s: float = 10.0) -> NodeSystemMetrics | None:
    """A background monitor logging this node's CPU, memory (and, with NVML, GPU) use into the run's
    System metrics tab until it is finished (or the run ends); ``None`` where the store is a local
    file of another node. Checked before any client exists: opening a client creates a local store."""
    if is_new_local_store(uri):
        return None
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    monitor = NodeSystemMetrics(run_id, sampling_interval=interval_s, node_id=node_id, tracking_uri=uri)
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
