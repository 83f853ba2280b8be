"""runnerkit: lifecycle, warmup and offload for multi-model diffusion pipelines."""

__version__ = "0.1.0"
