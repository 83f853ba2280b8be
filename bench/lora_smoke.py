"""LoRA on CUDA, tiny Wan: [none, A, B, none] per mode (unfused resident + inductor compile with
warmup, unfused block streaming, unfused fp8 block streaming, fused resident); prints one JSON line
per mode: whether the requests without an adapter are bit-identical, whether A and B change the
output, and each request's compile audit. Not a speed benchmark (tiny shapes).

    python bench/lora_smoke.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runnerkit.config import RequestConfig, load_runner_config
from runnerkit.lora.synthetic import synthetic_adapter
from runnerkit.models.wan.runner import WanT2VRunner

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "unfused_compiled": {"lora": {"max_rank": 16}, "compile": {"enabled": True}, "warmup": True},
    "unfused_block": {"lora": {"max_rank": 16}, "offload": {"mode": "block"}, "warmup": True},
    "unfused_block_fp8": {"lora": {"max_rank": 16}, "offload": {"mode": "block", "weight_dtype": "fp8_e4m3"}},
    "fused": {"lora": {"mode": "fused"}, "warmup": True},
}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    base = json.loads((REPO / "configs/wan/wan_t2v_tiny.json").read_text())
    base.pop("synthetic_checkpoint")
    base.update(model_path=str(out / "ckpt"), device="cuda", dtype="bfloat16", infer_steps=4)
    if not (out / "ckpt").exists():
        from runnerkit.models.wan.arch import WanArch
        from runnerkit.models.wan.checkpoint import write_synthetic
        write_synthetic(WanArch.model_validate(base["model"]), out / "ckpt", seed=0, dtype=torch.bfloat16)
    layers, _ = WanT2VRunner.lora_layers(load_runner_config(None, base), "lightx2v")
    save_file(synthetic_adapter(layers, "lightx2v", 4, seed=1, alpha=4.0, bias=True), str(out / "a.safetensors"))
    save_file(synthetic_adapter(layers, "kohya", 8, seed=2, alpha=4.0), str(out / "b.safetensors"))
    seq = [None, [{"path": str(out / "a.safetensors")}], [{"path": str(out / "b.safetensors"), "strength": 0.7}], None]
    for name, over in MODES.items():
        runner = WanT2VRunner(load_runner_config(None, {**base, **over}))
        runner.init_modules()
        videos, audits = [], []
        for i, lora in enumerate(seq):
            path = out / f"{name}_{i}.safetensors"
            prof = runner.run_pipeline(RequestConfig(prompt="a fox", seed=3, lora=lora, save_tensor_path=str(path),
                                                     target_height=32, target_width=32, target_video_length=5), i)
            videos.append(load_file(str(path))["video"])
            audits.append((prof.audit["compilations"], prof.audit["recompilations"]))
        print(json.dumps({"mode": name, "none_equal": torch.equal(videos[0], videos[3]),
                          "a_changes": not torch.equal(videos[0], videos[1]),
                          "b_changes": not torch.equal(videos[1], videos[2]),
                          "max_diff_a": float((videos[0] - videos[1]).abs().max()), "audits": audits}), flush=True)
        del runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
