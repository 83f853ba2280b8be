"""Wan2.1 family: transformer, UMT5 text encoder, VAE, checkpoint layouts and the runner."""
