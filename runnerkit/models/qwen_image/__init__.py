"""Qwen-Image family: MMDiT transformer, Qwen2.5-VL text encoder, Wan-2.1-architecture VAE,
dynamic-shift Euler scheduler, text-to-image and image-editing runners."""
