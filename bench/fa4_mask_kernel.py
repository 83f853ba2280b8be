"""One joint-attention call with a text-bucket key mask, per backend (issue 22, item 1; CUDA only).

Qwen-Image 1328x1328 with CFG: q, k, v [2, 24, 256 + 6889, 128] bf16, a text bucket of 256 with 150
real tokens (keys 150..255 masked). Prints the milliseconds of 3 rounds of 20 calls (CUDA events) for
FlashAttention-4 unmasked / masked (runnerkit/attention.py: kept keys first + `seqused_k`), cuDNN
unmasked / masked, and FA4 on the unpadded sequence. The 2026-12-03 H200 numbers are in
bench/results/lora_distill_h200.md (notes) and docs/prompt_lengths.md.

    python bench/fa4_mask_kernel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runnerkit import attention  # noqa: E402

TEXT, REAL, IMAGE = 256, 150, 6889


def rounds(fn, *args: torch.Tensor) -> list[float]:  # type: ignore[no-untyped-def]
    """Milliseconds per call, one value per round of 20 calls, sorted."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    out = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / 20)
    return sorted(out)


def main() -> None:
    dev = torch.device("cuda")
    q, k, v = (torch.randn(2, 24, TEXT + IMAGE, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(2, 1, 1, TEXT + IMAGE, dtype=torch.bool, device=dev)
    mask[..., REAL:TEXT] = False
    fa4, cudnn = attention.backend_fn("flash_attn_4"), attention.backend_fn("sdpa_cudnn")
    cut = TEXT - REAL
    with torch.inference_mode():
        print("fa4 unmasked ms", rounds(fa4, q, k, v))
        print("fa4 masked ms", rounds(fa4, q, k, v, mask))
        print("cudnn unmasked ms", rounds(cudnn, q, k, v))
        print("cudnn masked ms", rounds(cudnn, q, k, v, mask))
        print(f"fa4 unpadded ({REAL}+{IMAGE}) ms", rounds(fa4, q[:, :, cut:], k[:, :, cut:], v[:, :, cut:]))


if __name__ == "__main__":
    main()
