"""Rotary position embeddings without complex numbers in compiled blocks, for the families whose diffusers attention
processors rotate queries and keys as complex numbers (Qwen-Image, Qwen-Image-Edit, Qwen-Image-2.1, Z-Image in
diffusers 0.42.1).

Why: those processors call ``torch.view_as_complex``, multiply by a complex64 table and go back with
``view_as_real``. Inductor generates no code for complex tensors ("Torchinductor does not support code generation
for complex operators"), so a compiled block falls back to separate eager kernels there, with fp32 complex
intermediates between them.

How: the transformer's rotary table (complex ``(..., S, D/2)``, computed once per forward outside the blocks)
reaches the blocks as its real view ``(..., S, D/2, 2)``, (cos, sin) per channel pair (``cos_sin``: a view, no
copy). A project-owned processor per family (``<family>/attention.py``) rotates queries and keys with ``rotate``:
inside ``torch.compile`` in real arithmetic, pair ``(a, b)`` -> ``(a cos - b sin, a sin + b cos)`` in fp32 and
cast back, which inductor fuses into one kernel; in eager mode diffusers' own complex product, because there one
complex multiply is fewer kernels and less memory traffic than the six real ones (a block runs eagerly where the
engine does not compile: the CPU, quanto blocks, Qwen-Image-2.1's default, short runs). ``install`` puts the
table view and the processors on a loaded transformer, ``restore`` takes them off; neither touches a parameter,
a buffer or the config, so saved weights and LoRA files are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from loguru import logger

INSTALLED = "_real_rope_installed"  # attribute on the transformer: the Installed record (not a module or buffer)


@dataclass(frozen=True)
class RealRope:
    """How one diffusers transformer class gets real-valued RoPE.

    ``tables``: the transformer attribute that computes the rotary table its blocks receive (an ``nn.Module``
    or, for Z-Image, a plain callable object). ``replaces``: the diffusers processor class the project's one
    reproduces (written against diffusers 0.42.1); only processors of exactly that class are replaced, so a
    processor chosen by someone else (Qwen-Image-2.1's flex one) keeps the transformer as it was. ``processor``:
    the project's class, built with no arguments."""

    tables: str
    replaces: type
    processor: type


@dataclass
class Installed:
    """What ``install`` changed on one transformer, so ``restore`` can put it back."""

    originals: Dict[str, Any]  # attention module name -> the diffusers processor it had
    undo_tables: Callable[[], None]


def cos_sin(freqs: torch.Tensor) -> torch.Tensor:
    """A complex rotary table ``(..., S, D/2)`` (diffusers builds them as ``torch.polar(1, angle)``) as its real view
    ``(..., S, D/2, 2)``: the cos and sin of each channel pair's angle. A real table is returned as is."""
    return torch.view_as_real(freqs) if freqs.is_complex() else freqs


def real_tables(tables: Any) -> Any:
    """``cos_sin`` of a table, or of each table in a tuple or list (Qwen-Image hands the blocks (image, text))."""
    if isinstance(tables, (tuple, list)):
        return type(tables)(real_tables(t) for t in tables)
    return cos_sin(tables) if isinstance(tables, torch.Tensor) else tables


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(..., S, H, D)`` by the real ``table`` ``(..., S, D/2, 2)`` (``cos_sin``), equal
    to diffusers' ``view_as_real(view_as_complex(x.float()) * freqs).type_as(x)``: ``rotate_real`` while
    ``torch.compile`` traces (no complex tensor for inductor), ``rotate_complex`` in eager mode (fewer kernels)."""
    if table.is_complex():  # a diffusers table reached the project's processor: install() was bypassed
        raise TypeError("rotate() takes the real (cos, sin) table; the transformer's rotary table is still complex "
                        "(install the real RoPE with trainer.families.real_rope.install)")
    return rotate_real(x, table) if torch.compiler.is_compiling() else rotate_complex(x, table)


def rotate_real(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``rotate`` in real arithmetic: pair ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)``, in fp32, cast back
    to ``x``'s dtype."""
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = table.unsqueeze(-3).unbind(-1)  # (..., S, 1, D/2): a head axis to broadcast over
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).type_as(x)


def rotate_complex(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``rotate`` as diffusers computes it, one complex64 multiply (the table viewed back as complex, no copy)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.view_as_complex(table).unsqueeze(-2)).flatten(-2).type_as(x)


def attention_modules(transformer: torch.nn.Module, rope: RealRope) -> Dict[str, torch.nn.Module]:
    """The transformer's attention modules whose processor is ``rope.replaces``'s or the project's."""
    return {name: module for name, module in transformer.named_modules()
            if type(getattr(module, "processor", None)) in (rope.replaces, rope.processor)}


def install(transformer: torch.nn.Module, rope: RealRope) -> bool:
    """Give ``transformer`` the real rotary table and the project's processors. All or nothing: returns False,
    and changes nothing, when any attention module holds a processor other than ``rope.replaces`` (the table is
    shared by every block, and a processor left as it was would get a real table it cannot read). Idempotent."""
    if getattr(transformer, INSTALLED, None) is not None:
        return True
    foreign = _foreign_processors(transformer, rope)
    if foreign:
        logger.info(f"real-valued RoPE not installed: {len(foreign)} attention module(s) use another processor "
                    f"than {rope.replaces.__name__} ({foreign[0]}); diffusers' complex RoPE stays")
        return False
    originals: Dict[str, Any] = {}
    for name, module in attention_modules(transformer, rope).items():
        originals[name] = module.processor
        module.set_processor(_carry_settings(module.processor, rope.processor()))
    setattr(transformer, INSTALLED, Installed(originals, _convert_tables(transformer, rope.tables)))
    return True


def restore(transformer: torch.nn.Module) -> None:
    """Undo ``install``: diffusers' processors (with the backend settings they have now) and complex table."""
    installed: Optional[Installed] = getattr(transformer, INSTALLED, None)
    if installed is None:
        return
    for name, original in installed.originals.items():
        module = transformer.get_submodule(name)
        module.set_processor(_carry_settings(module.processor, original))
    installed.undo_tables()
    delattr(transformer, INSTALLED)


def is_installed(transformer: torch.nn.Module) -> bool:
    """Whether ``install`` is in effect on ``transformer``."""
    return getattr(transformer, INSTALLED, None) is not None


def _foreign_processors(transformer: torch.nn.Module, rope: RealRope) -> List[str]:
    """Attention modules of the transformer whose processor is neither diffusers' expected one nor ours."""
    ours = attention_modules(transformer, rope)
    return [name for name, module in transformer.named_modules()
            if hasattr(module, "processor") and hasattr(module, "set_processor") and name not in ours]


def _carry_settings(old: Any, new: Any) -> Any:
    """``new`` with ``old``'s attention backend and parallel config (``set_attention_backend`` writes them on
    each processor; the engine's choice must survive the swap either way)."""
    for attribute in ("_attention_backend", "_parallel_config"):
        if attribute in vars(old):
            setattr(new, attribute, getattr(old, attribute))
    return new


def _convert_tables(transformer: torch.nn.Module, attribute: str) -> Callable[[], None]:
    """Make ``transformer.<attribute>`` hand out real tables; returns the undo. A module gets a forward hook; a
    plain callable object (Z-Image's ``RopeEmbedder``) is wrapped in place."""
    source = getattr(transformer, attribute)
    if isinstance(source, torch.nn.Module):
        handle = source.register_forward_hook(lambda module, args, output: real_tables(output))
        return handle.remove
    setattr(transformer, attribute, RealTablesOf(source))
    return lambda: setattr(transformer, attribute, source)


class RealTablesOf:
    """A plain rotary-table callable whose tables come out as ``real_tables``; ``inner`` is the original."""

    def __init__(self, inner: Callable[..., Any]):
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return real_tables(self.inner(*args, **kwargs))
