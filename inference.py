"""Render an image with a base model and an optional LoRA (any family of ``trainer.families.SPECS``).

    python inference.py --model Qwen/Qwen-Image --lora output/pytorch_lora_weights.safetensors \
        --prompt "a red circle" --out out.png [--steps 30] [--width 1024 --height 1024] [--seed 0]
    python inference.py --model Qwen/Qwen-Image-Edit-2509 --image ref1.png --image ref2.png \
        --prompt "put the cat on the sofa" --out edit.png
    python inference.py --model DIR --lora LORA --base-out base.png --out lora.png --prompt "..."  # both, one load
    python inference.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --lora LORA --prompt "..." --out clip.mp4 \
        --width 832 --height 480 --num-frames 33     # a video model: .mp4 or an animated .webp (.png: frame 1)

The pipeline class is read from the model's ``model_index.json``; ``--family`` makes it one of that
family's pipelines.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.families import SPECS, spec_for_pipeline  # the light specs (also quiets optional backends)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="diffusers folder or hub id")
    p.add_argument("--family", choices=list(SPECS), help="default: from the model's model_index.json")
    p.add_argument("--image", action="append", type=Path, default=[],
                   help="reference image for Qwen-Image-Edit or Qwen-Image-2.1 (repeat for Edit-2509/2511 and "
                        "2.1, up to 3), or the first frame of an image-to-video model's clip (Wan I2V)")
    p.add_argument("--lora", help="LoRA file (pytorch_lora_weights.safetensors) or its folder")
    p.add_argument("--lora-scale", type=float, default=1.0)
    p.add_argument("--base-out", type=Path, default=None,
                   help="with --lora: also render the base model (same prompt and seed) to this PNG first, "
                        "in the same process (the model loads once)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default=None,
                   help="default: '' where the pipeline's true CFG is on by default (Qwen-Image, Edit), "
                        "so it guides as validation samples do; the pipeline's own default elsewhere")
    p.add_argument("--out", required=True, type=Path,
                   help="PNG file to write; for a video model a clip: .mp4 or animated .webp (.png: its first frame)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--num-frames", type=int, default=None,
                   help="video models: frames of the clip (4k+1 for Wan; default: the pipeline's)")
    p.add_argument("--fps", type=float, default=None,
                   help="video models: frame rate of the written clip (default: the model's, 16 for Wan 2.1)")
    p.add_argument("--guidance", type=float, default=None, help="distilled guidance (FLUX)")
    p.add_argument("--true-cfg", type=float, default=None, help="true classifier-free guidance (Qwen)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    return p.parse_args(argv)


def load_pipeline(model: str, family: Optional[str], dtype_name: Optional[str]):
    """The model's diffusers pipeline, on the GPU when there is one."""
    import diffusers
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, DTYPES[dtype_name or ("bf16" if device == "cuda" else "fp32")])
    from utils.qwen_processor import load_qwen_vl_processor  # imports transformers: not for --help

    try:
        name = pipeline_name(diffusers.DiffusionPipeline.load_config(model)["_class_name"], family)
        spec = spec_for_pipeline(name)
        # Components that are Qwen2-VL processors load without torchvision too.
        extra = {component: load_qwen_vl_processor(model, component)
                 for component in (spec.vl_processors if spec is not None else ())}
        pipe = getattr(diffusers, name).from_pretrained(model, dtype=dtype, **extra)
    except OSError as exc:
        raise SystemExit(f"error: cannot load '{model}': {str(exc).splitlines()[0]}\n"
                         "Download it first or point --model at a local diffusers folder.") from None
    return pipe.to(device), device


def pipeline_name(in_checkpoint: str, family: Optional[str]) -> str:
    """The checkpoint's pipeline class, or with ``family`` the first of the family's pipelines when the
    checkpoint names none of them."""
    if family is None or in_checkpoint in SPECS[family].pipelines:
        return in_checkpoint
    return SPECS[family].pipelines[0]


def check_local_files(args: argparse.Namespace) -> None:
    """``SystemExit`` naming a ``--lora`` or ``--image`` path that does not exist."""
    if args.lora and not Path(args.lora).exists():
        raise SystemExit(f"error: LoRA file '{args.lora}' does not exist")
    for path in args.image:
        if not path.is_file():
            raise SystemExit(f"error: reference image '{path}' does not exist")


def add_lora(pipe, lora: str, scale: float) -> None:
    """Load a LoRA file as adapter 'lora' at ``scale``."""
    path = Path(lora)
    folder, name = (path, None) if path.is_dir() else (path.parent, path.name)
    pipe.load_lora_weights(str(folder), weight_name=name, adapter_name="lora")
    pipe.set_adapters(["lora"], adapter_weights=[scale])


def call_kwargs(pipe, args: argparse.Namespace) -> Dict[str, Any]:
    """Only the arguments this pipeline's ``__call__`` takes."""
    import torch

    wanted = {
        "image": reference_images(pipe, args.image),
        "prompt": args.prompt, "negative_prompt": args.negative_prompt, "num_inference_steps": args.steps,
        "width": args.width, "height": args.height, "guidance_scale": args.guidance,
        "true_cfg_scale": args.true_cfg, "generator": torch.Generator("cpu").manual_seed(args.seed),
        "num_frames": args.num_frames, "output_type": "pil" if renders_video(pipe) else None,
    }
    accepted = inspect.signature(pipe.__call__).parameters
    # Qwen pipelines default to true_cfg_scale 4 but skip CFG without a negative prompt.
    true_cfg = accepted.get("true_cfg_scale")
    if wanted["negative_prompt"] is None and true_cfg is not None and (args.true_cfg or true_cfg.default) > 1:
        wanted["negative_prompt"] = ""
    return {k: v for k, v in wanted.items() if k in accepted and v is not None}


def renders_video(pipe) -> bool:
    """Whether the pipeline belongs to a family that renders clips (``FamilySpec.trains_video``)."""
    spec = spec_for_pipeline(type(pipe).__name__)
    return spec is not None and spec.trains_video


def save_output(pipe, output: Any, out: Path, fps: Optional[float] = None) -> int:
    """Write the pipeline's first output to ``out``: an image, or a video model's clip as .mp4 / animated .webp
    at the model's frame rate (or --fps); a clip written to .png keeps its first frame. Returns its frames."""
    frames = output if isinstance(output, list) else [output]
    suffix = out.suffix.lower()
    if suffix in (".mp4", ".webp") and isinstance(output, list):
        from image_datasets.video import write_mp4, write_webp

        spec = spec_for_pipeline(type(pipe).__name__)
        fps = fps or (spec.frame_rate(pipe.vae.config) if spec is not None else 0) or 16.0
        (write_mp4 if suffix == ".mp4" else write_webp)(out, frames, fps)
        return len(frames)
    if suffix == ".mp4":
        raise SystemExit(f"error: {type(pipe).__name__} renders an image; write it as .png, not '{out}'")
    frames[0].save(out)
    return 1


def reference_images(pipe, paths: List[Path]):
    """The ``image`` argument of a pipeline that takes references (Edit): one image, or a list where
    it takes several (Edit-Plus)."""
    from PIL import Image

    name = type(pipe).__name__
    spec = spec_for_pipeline(name)
    facts = spec.references.get(name) if spec is not None else None
    if facts is None and _needs_an_image(pipe):  # image-to-video (WanImageToVideoPipeline): the first frame
        if len(paths) != 1:
            raise SystemExit(f"error: {name} takes one --image (the clip's first frame), got {len(paths)}")
        return Image.open(paths[0]).convert("RGB")
    if facts is None:
        if paths:
            users = ", ".join(s.title for s in SPECS.values() if s.uses_references)
            raise SystemExit(f"error: --image is for {users} models; {name} takes no reference")
        return None
    limit, least = facts.max_references, 0 if spec.references_optional else 1
    if not least <= len(paths) <= limit:
        raise SystemExit(f"error: {name} takes {least} to {limit} --image reference(s), got {len(paths)}")
    if not paths:  # text-to-image (Qwen-Image-2.1)
        return None
    images = [Image.open(p).convert("RGB") for p in paths]
    return images if limit > 1 else images[0]


def _needs_an_image(pipe) -> bool:
    """Whether the pipeline's ``__call__`` requires an ``image`` (an image-to-video pipeline's first frame)."""
    image = inspect.signature(pipe.__call__).parameters.get("image")
    return image is not None and image.default is inspect.Parameter.empty


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.base_out is not None and not args.lora:
        raise SystemExit("error: --base-out renders the base model beside a LoRA: give --lora too")
    check_local_files(args)  # before the model loads (minutes, or hub retries when offline)
    pipe, device = load_pipeline(args.model, args.family, args.dtype)
    if args.base_out is not None:
        render(pipe, args, args.base_out, device)
    if args.lora:
        add_lora(pipe, args.lora, args.lora_scale)
    render(pipe, args, args.out, device)
    return 0


def render(pipe, args: argparse.Namespace, out: Path, device: str) -> None:
    """One image with the pipeline as it stands, saved to ``out``; prints a JSON line about it."""
    start = time.perf_counter()
    # Every pipeline: first output, first image (a video pipeline's: the first clip's frames).
    image = pipe(**call_kwargs(pipe, args), return_dict=False)[0][0]
    out.parent.mkdir(parents=True, exist_ok=True)
    frames = save_output(pipe, image, out, args.fps)
    print(json.dumps({"out": str(out), "pipeline": type(pipe).__name__, "device": device, "frames": frames,
                      "lora": bool(args.lora) and out == args.out, "seconds": round(time.perf_counter() - start, 2)}))


if __name__ == "__main__":
    sys.exit(main())
