"""Block A/B of the real-valued RoPE processors (``trainer/families/real_rope.py``; lever L4 of the GPU review):
one transformer block's forward + backward with diffusers' processor (complex RoPE) and with the project's, on
the same inputs, both compiled the same way: milliseconds, the relative error of the project's outputs and input
gradients against diffusers' eager block, and the complex-dtype values in the compiled forward and backward graphs.

    python benchmarks/rope_block_ab.py --family qwen_image                      # CPU smoke (not a claim)
    python benchmarks/rope_block_ab.py --family qwen_image --backend inductor   # minutes on a CPU

For the GPU pass: build the transformer and a batch as it does (``benchmarks/harness.py``), then
``block_ab(transformer, family.real_rope, lambda: family.predict(transformer, ...))`` (CUDA events on a GPU).
Eagerly both processors run the same complex product (``real_rope.rotate``), so the A/B is of compiled blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(ROOT))

from trainer.families.real_rope import RealRope, install, is_installed, real_tables, restore  # noqa: E402

COMPLEX = (torch.complex32, torch.complex64, torch.complex128)
Arguments = Tuple[Tuple[Any, ...], Dict[str, Any], List[torch.Tensor]]  # args, kwargs, the leaves among them


@dataclass
class BlockCall:
    """The arguments one block received in a forward with diffusers' processors (complex tables), detached."""

    block: torch.nn.Module
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


@dataclass
class BlockRun:
    """One block forward + backward: its outputs and the gradients of its floating-point inputs."""

    outputs: List[torch.Tensor]
    grads: List[torch.Tensor]


@dataclass
class BlockAB:
    """``block_ab``'s result: ms per forward + backward, relative errors (real against diffusers' eager block), and
    the complex-dtype values in each processor's compiled forward and backward graphs."""

    backend: Optional[str]
    diffusers_ms: float
    real_ms: float
    output_rel_err: float
    grad_rel_err: float
    complex_values: Dict[str, int]

    def line(self) -> str:
        return (f"block fwd+bwd ({self.backend or 'eager'}): diffusers {self.diffusers_ms:.3f} ms, real "
                f"{self.real_ms:.3f} ms (delta {self.real_ms - self.diffusers_ms:+.3f} ms); rel.err output "
                f"{self.output_rel_err:.2e}, input grad {self.grad_rel_err:.2e}; complex values in the compiled "
                f"graphs {self.complex_values}")


def capture_block_call(transformer: torch.nn.Module, rope: RealRope, block: torch.nn.Module,
                       forward: Callable[[], Any]) -> BlockCall:
    """What ``block`` receives during ``forward()`` (a whole-transformer call), run with diffusers' processors so
    the tables are diffusers' own; the transformer is left as it was (real RoPE installed or not)."""
    was_installed = is_installed(transformer)
    restore(transformer)
    seen: List[Tuple[Tuple[Any, ...], Dict[str, Any]]] = []
    handle = block.register_forward_pre_hook(lambda module, args, kwargs: seen.append((args, kwargs)),
                                             with_kwargs=True)
    try:
        with torch.no_grad():
            forward()
    finally:
        handle.remove()
        if was_installed:
            install(transformer, rope)
    args, kwargs = seen[0]
    detach = lambda value: value.detach().clone() if isinstance(value, torch.Tensor) else value  # noqa: E731
    return BlockCall(block, tree_map(detach, args), tree_map(detach, kwargs))


def block_arguments(transformer: torch.nn.Module, rope: RealRope, call: BlockCall, real: bool) -> Arguments:
    """The call's arguments for one processor, with the transformer's processors set to match (the project's and
    real tables for ``real``, else diffusers' and complex ones); every floating-point input a fresh leaf."""
    if real:
        install(transformer, rope)
    else:
        restore(transformer)
    leaves: List[torch.Tensor] = []

    def prepare(value: Any) -> Any:  # the tables are complex here: not leaves
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            leaves.append(value.clone().requires_grad_(True))
            return leaves[-1]
        return value

    args, kwargs = tree_map(prepare, (list(call.args), call.kwargs))
    if real:
        args, kwargs = real_tables(args), {name: real_tables(value) for name, value in kwargs.items()}
    return tuple(args), kwargs, leaves


def run_block(transformer: torch.nn.Module, rope: RealRope, call: BlockCall, real: bool,
              backend: Optional[str | Callable[..., Any]] = None, seed: int = 0, afresh: bool = True) -> BlockRun:
    """The captured call once with either processor, eager (``backend`` None) or ``torch.compile``d with
    ``backend`` (``afresh``: dynamo's caches cleared first; else a graph compiled for another block of the same
    code and guards is reused, as the engine reuses one graph for its blocks); the backward of a fixed random
    projection of every output, to each floating-point input."""
    args, kwargs, leaves = block_arguments(transformer, rope, call, real)
    block = _compiled(call.block, backend, afresh)
    outputs = _tensors(block(*args, **kwargs))
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype) for o in outputs]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # a mask given as floats gets none
    return BlockRun([o.detach() for o in outputs], [g.detach() for g in grads if g is not None])


def rel_err(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """Largest ``|got - want| / |want|`` (Frobenius norms, in fp64) over the pairs."""
    if len(got) != len(want) or not want:
        raise ValueError(f"{len(got)} tensors against {len(want)}")
    return max(float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
               for g, w in zip(got, want))


def keeping(graphs: List[torch.fx.GraphModule]) -> Callable[..., Any]:
    """The ``aot_eager`` backend (the graphs inductor would get, run op by op) that also appends to ``graphs`` the
    forward and backward graphs AOTAutograd hands the compiler."""
    from functools import partial

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.debugging import aot_eager

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return partial(aot_eager, fw_compiler=keep, bw_compiler=keep)


def compiled_graphs(transformer: torch.nn.Module, rope: RealRope, call: BlockCall,
                    real: bool) -> List[torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd hands the compiler (inductor) for the block with either
    processor, from one compiled forward + backward."""
    graphs: List[torch.fx.GraphModule] = []
    args, kwargs, leaves = block_arguments(transformer, rope, call, real)
    torch._dynamo.reset()
    outputs = _tensors(torch.compile(call.block, backend=keeping(graphs))(*args, **kwargs))
    torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves, allow_unused=True)
    torch._dynamo.reset()
    return graphs


def complex_values(graphs: Sequence[torch.fx.GraphModule]) -> List[str]:
    """The nodes of ``graphs`` whose value is, or holds, a complex-dtype tensor (what inductor cannot compile)."""
    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            values = tree_flatten(node.meta.get("val"))[0]
            if any(isinstance(v, torch.Tensor) and v.dtype in COMPLEX for v in values):
                found.append(f"{node.op} {node.target}")
    return found


def time_block(transformer: torch.nn.Module, rope: RealRope, call: BlockCall, real: bool,
               backend: Optional[str] = "inductor", steps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one block forward + backward (CUDA events on a GPU, wall time on the CPU), compiled
    with ``backend`` as the engine compiles blocks (None: eager)."""
    args, kwargs, leaves = block_arguments(transformer, rope, call, real)
    block = _compiled(call.block, backend)
    device = leaves[0].device
    times = []
    for index in range(warmup + steps):
        start = _clock(device)
        outputs = _tensors(block(*args, **kwargs))
        torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves, allow_unused=True)
        if index >= warmup:
            times.append(_elapsed_ms(start, device))
    return statistics.median(times)


def block_ab(transformer: torch.nn.Module, rope: RealRope, forward: Callable[[], Any], block_index: int = 0,
             steps: int = 20, warmup: int = 3, backend: Optional[str] = "inductor") -> BlockAB:
    """The A/B of block ``block_index`` (in ``transformer``'s first block list) on the inputs ``forward()`` gives
    it, both processors compiled with ``backend``. The transformer ends as it was (real RoPE installed or not)."""
    block = _blocks(transformer)[block_index]
    call = capture_block_call(transformer, rope, block, forward)
    was_installed = is_installed(transformer)
    try:
        want = run_block(transformer, rope, call, real=False)
        got = run_block(transformer, rope, call, real=True, backend=backend)
        found = {name: len(complex_values(compiled_graphs(transformer, rope, call, real)))
                 for name, real in (("diffusers", False), ("real", True))}
        ms = {real: time_block(transformer, rope, call, real, backend, steps, warmup) for real in (False, True)}
    finally:
        torch._dynamo.reset()
        if was_installed:
            install(transformer, rope)
        else:
            restore(transformer)
    return BlockAB(backend, ms[False], ms[True], rel_err(got.outputs, want.outputs), rel_err(got.grads, want.grads),
                   found)


def _compiled(block: torch.nn.Module, backend: Optional[str | Callable[..., Any]],
              afresh: bool = True) -> Callable[..., Any]:
    """``block`` compiled with ``backend``, afresh by default (the processor changes the graph), or as it is
    (None)."""
    if backend is None:
        return block
    if afresh:
        torch._dynamo.reset()
    return torch.compile(block, backend=backend)


def _tensors(output: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]


def _blocks(transformer: torch.nn.Module) -> List[torch.nn.Module]:
    """The first repeated-block list of a diffusers transformer (``transformer_blocks``; Z-Image's ``layers``)."""
    for attribute in ("transformer_blocks", "layers"):
        if hasattr(transformer, attribute):
            return list(getattr(transformer, attribute))
    raise ValueError(f"{type(transformer).__name__}: no transformer_blocks or layers")


def _clock(device: torch.device) -> Any:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(start: Any, device: torch.device) -> float:
    if device.type == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    return (time.perf_counter() - start) * 1000


def smoke_batch(family: Any, transformer: torch.nn.Module) -> Tuple[torch.Tensor, Dict[str, Any], List[torch.Tensor]]:
    """Random 8x8 latents (the VAE's channels), a random 12-token text condition of the family's shapes (the GPU
    harness's), and one reference of the same size where the family needs references (Edit)."""
    from benchmarks import harness

    gen = torch.Generator().manual_seed(0)
    channels = int(family.vae_config.get("z_dim") or family.vae_config["latent_channels"])
    latents = torch.randn(1, channels, 8, 8, generator=gen)
    cond = harness._text_cond(family.spec, dict(transformer.config), 12, gen)
    references = [torch.randn(latents.shape, generator=gen)] if harness.with_reference(family.spec) else []
    return latents, family.collate_text([cond], torch.device("cpu"), torch.float32), references


def main(argv: Optional[List[str]] = None) -> int:
    """CPU smoke test on a tiny model (``--model``; built offline when absent): prints ``BlockAB.line()``."""
    from trainer.config import TrainConfig
    from trainer.families.base import load_family
    from utils.tiny_models import build_tiny_pipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen_image")
    parser.add_argument("--model", type=Path, help="a tiny model folder (default: built in a temporary folder)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="aot_eager",
                        help="torch.compile backend of both blocks (inductor: the engine's; aot_eager: the same "
                             "graphs run op by op, seconds on a CPU; eager: not compiled)")
    opts = parser.parse_args(argv)
    model = opts.model or build_tiny_pipeline(opts.family, Path(tempfile.mkdtemp()) / f"tiny-{opts.family}", seed=0)
    family = load_family(TrainConfig(family=opts.family, pretrained_model_name_or_path=str(model)))
    if family.real_rope is None:
        raise SystemExit(f"{opts.family}: its diffusers processors rotate in real arithmetic already")
    transformer = family.load_transformer(torch.float32)
    latents, text, references = smoke_batch(family, transformer)
    sigmas = torch.full((latents.shape[0],), 0.5)
    result = block_ab(transformer, family.real_rope,
                      lambda: family.predict(transformer, latents, sigmas, text, references),
                      steps=opts.steps, backend=None if opts.backend == "eager" else opts.backend)
    print(result.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
