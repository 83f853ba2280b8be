"""LTX-2 family (Lightricks LTX-2 / LTX-2.3 audio+video): networks written here, parity-tested against diffusers."""
