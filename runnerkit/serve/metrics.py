"""Prometheus metrics of `runnerkit serve`, through `prometheus_client` (one registry per server).

    runnerkit_ready                      1 once warmup is done and the runner is alive, else 0
    runnerkit_queue_depth                jobs waiting
    runnerkit_jobs_total{status}         jobs ended, by final status
    runnerkit_job_seconds                seconds from start to end of each job that ran
    runnerkit_step_seconds               seconds of each denoising step
    runnerkit_first_step_seconds         seconds of each job's first denoising step
    runnerkit_load_seconds               seconds of loading (once)
    runnerkit_warmup_seconds             seconds of warmup (once; 0 without warmup)
    runnerkit_device_memory_bytes{kind}  CUDA allocated / reserved / peak, host RSS (read at scrape)
"""

from __future__ import annotations

from typing import Any

import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runnerkit import memory

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    """The server's metrics; `observe_job` after every job, `render` for `/metrics`."""

    def __init__(self, device: torch.device) -> None:
        self.registry = registry = CollectorRegistry()
        self.device = device
        self.ready = Gauge("runnerkit_ready", "1 once warmup is done and the runner is alive", registry=registry)
        self.queue_depth = Gauge("runnerkit_queue_depth", "Jobs waiting in the queue", registry=registry)
        self.jobs = Counter("runnerkit_jobs", "Jobs ended, by final status", ["status"], registry=registry)
        self.job_seconds = Histogram("runnerkit_job_seconds", "Seconds of each job that ran", buckets=_SECONDS,
                                     registry=registry)
        self.step_seconds = Histogram("runnerkit_step_seconds", "Seconds of each denoising step", buckets=_SECONDS,
                                      registry=registry)
        self.first_step_seconds = Histogram("runnerkit_first_step_seconds", "Seconds of each job's first step",
                                            buckets=_SECONDS, registry=registry)
        self.load_seconds = Gauge("runnerkit_load_seconds", "Seconds of loading", registry=registry)
        self.warmup_seconds = Gauge("runnerkit_warmup_seconds", "Seconds of warmup (0 without)", registry=registry)
        self.device_memory = Gauge("runnerkit_device_memory_bytes", "Device and host memory", ["kind"],
                                   registry=registry)

    def observe_job(self, status: str, profile: dict[str, Any] | None) -> None:
        self.jobs.labels(status=status).inc()
        if profile is None:
            return
        self.job_seconds.observe(profile["seconds"])
        for s in profile["steps"]:
            self.step_seconds.observe(s)
        if profile["steps"]:
            self.first_step_seconds.observe(profile["steps"][0])

    def render(self) -> tuple[bytes, str]:
        if self.device.type == "cuda":
            snap = memory.snapshot(self.device)
            self.device_memory.labels(kind="allocated").set(snap.allocated_gib * 2**30)
            self.device_memory.labels(kind="reserved").set(snap.reserved_gib * 2**30)
            self.device_memory.labels(kind="peak").set(torch.cuda.max_memory_allocated(self.device))
        self.device_memory.labels(kind="host_rss").set(memory.host_memory().rss_gib * 2**30)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["Metrics"]
