"""Write a random-weight Qwen-Image or FLUX.1-dev transformer in the diffusers layout, at a chosen scale.

The architecture is the real one (widths, heads, embedders, RoPE axes) with fewer blocks, so load time
and memory can be measured on a realistic checkpoint without any download. The model is built on the
meta device and each shard's tensors are generated, written and freed in turn: the whole model is
never in memory.

    python benchmarks/make_synthetic_checkpoint.py --family qwen_image --num-layers 3 \
        --out /tmp/synthetic-qwen --max-shard-size 1GB --dtype bf16

writes ``OUT/transformer/{config.json, diffusion_pytorch_model-0000i-of-0000N.safetensors, ...index.json}``
(loadable with ``QwenImageTransformer2DModel.from_pretrained(OUT, subfolder="transformer")``) and
``OUT/synthetic_checkpoint.json`` (sizes and settings).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from utils.fast_loading import WEIGHTS_NAME, save_sharded  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Qwen/Qwen-Image transformer/config.json (60 layers) and black-forest-labs/FLUX.1-dev's (19 + 38).
QWEN_IMAGE_CONFIG: Dict[str, Any] = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
FLUX_DEV_CONFIG: Dict[str, Any] = dict(
    patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56))


def model_class(family: str) -> type:
    """The diffusers transformer class of ``family``."""
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    classes = {"qwen_image": QwenImageTransformer2DModel, "flux": FluxTransformer2DModel}
    if family not in classes:
        raise ValueError(f"family must be one of {', '.join(classes)}, not {family!r}")
    return classes[family]


def synthetic_config(family: str, num_layers: int, num_single_layers: Optional[int] = None,
                     num_heads: Optional[int] = None) -> Dict[str, Any]:
    """The real config with fewer blocks (FLUX: single blocks default to twice the double ones, the
    real 19:38 ratio). ``num_heads`` narrows the model (fewer 128-wide heads) for quick runs."""
    config = dict(QWEN_IMAGE_CONFIG if family == "qwen_image" else FLUX_DEV_CONFIG)
    model_class(family)  # validates the family
    config["num_layers"] = num_layers
    if family == "flux":
        config["num_single_layers"] = 2 * num_layers if num_single_layers is None else num_single_layers
    if num_heads is not None:
        config["num_attention_heads"] = num_heads
    return config


def _meta_state_dict(family: str, config: Dict[str, Any], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = model_class(family)(**config)
    return {k: v.to(dtype) for k, v in model.state_dict().items()}, model  # meta: shapes, no memory


def _random_tensor(name: str, shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic in (seed, name): the same checkpoint whatever the shard size."""
    generator = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 1_000_003 * seed) % 2**63)
    if name.endswith(".weight") and len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=dtype)  # norm scales near 1, as in a trained model
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)


def make_synthetic_checkpoint(out: Path, family: str = "qwen_image", num_layers: int = 3,
                              num_single_layers: Optional[int] = None, num_heads: Optional[int] = None,
                              dtype: str = "bf16", max_shard_size: str = "1GB", seed: int = 0) -> Dict[str, Any]:
    """Write the checkpoint under ``out`` (``out/transformer``) and return its description."""
    out = Path(out)
    config = synthetic_config(family, num_layers, num_single_layers, num_heads)
    torch_dtype = DTYPES[dtype]
    meta, model = _meta_state_dict(family, config, torch_dtype)
    folder = out / "transformer"
    model.save_config(str(folder))

    def materialize(names: List[str]) -> Dict[str, torch.Tensor]:
        return {n: _random_tensor(n, meta[n].shape, torch_dtype, seed) for n in names}

    files = save_sharded(meta, folder, max_shard_size=max_shard_size, weights_name=WEIGHTS_NAME,
                         materialize=materialize)
    sizes = [f.stat().st_size for f in files]
    info = {
        "family": family, "class": model_class(family).__name__, "config": config, "dtype": dtype,
        "seed": seed, "max_shard_size": max_shard_size, "parameters": sum(t.numel() for t in meta.values()),
        "total_bytes": sum(sizes), "largest_shard_bytes": max(sizes),
        "files": [str(f.relative_to(out)) for f in files], "subfolder": "transformer",
    }
    (out / "synthetic_checkpoint.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["qwen_image", "flux"], default="qwen_image")
    parser.add_argument("--num-layers", type=int, default=3,
                        help="transformer blocks (FLUX: double blocks); the real models have 60 / 19")
    parser.add_argument("--num-single-layers", type=int, default=None, help="FLUX single blocks (default 2x)")
    parser.add_argument("--num-heads", type=int, default=None,
                        help="fewer 128-wide heads than the real 24 (a narrower model for quick runs)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-shard-size", default="1GB")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = make_synthetic_checkpoint(args.out, args.family, args.num_layers, args.num_single_layers,
                                     args.num_heads, args.dtype, args.max_shard_size, args.seed)
    print(f"wrote {args.out}/transformer: {info['parameters'] / 1e9:.2f} B parameters, "
          f"{info['total_bytes'] / 2**30:.2f} GiB in {len(info['files'])} file(s), "
          f"largest {info['largest_shard_bytes'] / 2**20:.0f} MiB")
    return info


if __name__ == "__main__":
    main()
