"""Activation memory of one training step: which linears carry LoRA, and per-block formulas for what
autograd keeps (``docs/MEMORY_PLANNER.md``), checked by the tests against the tensors the diffusers
blocks really save. Where each linear reads from comes from the family spec's block layouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Sequence, Tuple

from trainer.facts.family_spec import BlockLayout
from trainer.facts.optimizer_choices import Matrix, TrainedShapes
from trainer.planner.model_sizes import BlockKind, LinearInfo, TransformerSizes
from trainer.planner.settings import INT8_SCRATCH_IN, INT8_SCRATCH_OUT, Settings


# --------------------------------------------------------------------------- LoRA targets
def lora_matcher(targets: Any):
    """``name -> bool`` with peft's own matching rules (suffix list or full-match regex)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(r=1, target_modules=targets)
    return lambda name: bool(check_target_module_exists(config, name))


@dataclass(frozen=True)
class LoraLayout:
    """Which linears carry LoRA: per block kind (relative names) and outside the blocks."""

    per_block: Mapping[str, Tuple[LinearInfo, ...]]  # block prefix -> LoRA linears in one block
    outer: Tuple[LinearInfo, ...]

    def params(self, spec: TransformerSizes, rank: int) -> int:
        """Trainable LoRA parameters: rank x (in + out) per adapted linear (A: r x in, B: out x r)."""
        per_block = sum(kind.count * sum(rank * (li.in_features + li.out_features)
                                         for li in self.per_block.get(kind.prefix, ())) for kind in spec.blocks)
        return per_block + sum(rank * (li.in_features + li.out_features) for li in self.outer)

    def shapes(self, spec: TransformerSizes, rank: int) -> TrainedShapes:
        """The LoRA matrices as the optimizer sees them (fp32): A (rank x in) and B (out x rank, zero at
        the start) of each adapted linear, those of the blocks marked hidden."""
        def pair(li: LinearInfo, count: int, hidden: bool) -> Tuple[Matrix, Matrix]:
            return (Matrix(rank, li.in_features, count, hidden),
                    Matrix(li.out_features, rank, count, hidden, starts_zero=True))

        matrices = [m for kind in spec.blocks for li in self.per_block.get(kind.prefix, ())
                    for m in pair(li, kind.count, True)]
        matrices += [m for li in self.outer for m in pair(li, 1, False)]
        return TrainedShapes(tuple(matrices))


def lora_layout(spec: TransformerSizes, targets: Any) -> LoraLayout:
    """Match ``targets`` against block 0 of each kind (blocks are identical) and the outer linears."""
    match = lora_matcher(targets)
    per_block = {kind.prefix: tuple(li for li in kind.linears if match(f"{kind.prefix}.0.{li.name}"))
                 for kind in spec.blocks}
    outer = tuple(li for li in spec.outer_linears if match(li.name))
    if not any(per_block.values()) and not outer:
        raise ValueError(f"LoRA targets {targets!r} match no linear layer of {spec.class_name}")
    return LoraLayout(per_block, outer)



# --------------------------------------------------------------------------- activation formulas
@dataclass(frozen=True)
class Tokens:
    """Tokens of one forward pass (batch included)."""

    img: int
    txt: int

    @property
    def all(self) -> int:
        return self.img + self.txt

    def stream(self, name: str) -> int:
        return {"img": self.img, "txt": self.txt, "joint": self.all}[name]


def _qk_norm_bytes(transformer: TransformerSizes, a: int) -> int:
    """Per token and hidden unit: RMSNorm of q and k saves an fp32 copy of each (4 bytes); diffusers'
    RMSNorm (Qwen-Image's) also keeps its half-precision input."""
    extra = 2 * a if transformer.qk_norm_keeps_input and a < 4 else 0
    return 2 * 4 + extra


def block_base_bytes(transformer: TransformerSizes, kind: str, t: Tokens, a: int) -> int:
    """Activations one block saves for backward, without LoRA or quantization extras (bytes).

    double (per stream s, tokens N_s; N = all tokens):
        sum_s N_s * D * (a*(2 + M/D) + qk)  +  N * 4*D*a
        (LayerNorm inputs x2, the GELU input M, the q/k RMSNorm copies; joint attention q, k, v, out)
    single (one joint stream of N tokens):
        N * D * (a*(1 + M/D) + qk)  +  N * 4*D*a
    """
    d, m = transformer.hidden, transformer.mlp_hidden
    qk = _qk_norm_bytes(transformer, a)
    norms = 2 if kind == "double" else 1
    streams = (t.img, t.txt) if kind == "double" else (t.all,)
    per_stream = sum(n * (a * (norms * d + m) + qk * d) for n in streams)
    return per_stream + t.all * 4 * d * a


def described_block_bytes(transformer: TransformerSizes, kind: BlockKind, t: Tokens, a: int) -> int:
    """Activations of one block whose family spec counts what it saves (``SavedActivations``): per token,
    half-precision and fp32 tensors of the hidden and MLP widths, and fp32 copies of named linears' outputs."""
    saved = kind.saved
    outputs = {li.name: li.out_features for li in kind.linears}
    per_token = (saved.half_hidden * a * transformer.hidden + saved.fp32_hidden * 4 * transformer.hidden
                 + saved.half_mlp * a * transformer.mlp_hidden + sum(4 * outputs[n] for n in saved.fp32_outputs))
    if saved.text_hidden is None:
        return t.all * per_token
    return t.img * per_token + t.txt * saved.text_hidden * a * transformer.hidden


def _input_groups(layout: Mapping[str, Tuple[str, str]], linears: Sequence[LinearInfo],
                  batch: int) -> Dict[Tuple[str, str], int]:
    """Distinct input tensors of ``linears``: (stream, group) -> input features. An attention
    output view is free at batch 1 (attention already saves it); modulation inputs are per sample."""
    groups: Dict[Tuple[str, str], int] = {}
    for li in linears:
        stream, group = layout.get(li.name, ("joint", li.name))
        if group == "mod" or (group == "attn_out" and batch == 1):
            continue
        groups[(stream, group)] = li.in_features
    return groups


def block_lora_bytes(transformer: TransformerSizes, kind: BlockKind, lora: Sequence[LinearInfo], t: Tokens,
                     s: Settings) -> int:
    """What LoRA adds to one block's saved activations (bytes).

    Mixed precision (fp32 LoRA on a bf16/fp16 base): each adapted linear saves its own half-precision
    cast of its input (autocast) and the rank-r output of lora_A: N_s * (in + r) * a per linear, plus
    autocast's half-precision copies of its A and B weights: r * (in + out) * a.
    fp32: adapted linears that share an input save it once; r * 4 per linear for lora_A's output.
    Dropout adds a 1-byte mask per input element (and, in fp32, an unshared dropped copy).
    """
    layout = kind.layout
    a, total = s.act_bytes, 0
    for li in lora:
        stream, group = layout.get(li.name, ("joint", li.name))
        n = 0 if group == "mod" else t.stream(stream)
        total += n * s.rank * a + (n * li.in_features if s.lora_dropout else 0)
        if a < 4 or s.lora_dropout:
            total += n * li.in_features * a
        if a < 4:  # autocast's half-precision copies of the fp32 LoRA weights, kept for backward
            total += s.rank * (li.in_features + li.out_features) * a
    if a == 4 and not s.lora_dropout and s.backend != "quanto":  # quanto already saves every input
        total += sum(t.stream(st) * width * a for (st, _), width in _input_groups(layout, lora, s.batch).items())
    return total


def block_modulation_bytes(kind: BlockKind, t: Tokens, d: int, a: int, streams: Sequence[str]) -> int:
    """Modulation that needs a gradient (LoRA on the timestep embedder or on a modulation linear):
    each ``x * (1 + scale) + shift`` then keeps the normalised x and each gate multiply keeps the
    branch output, token-sized tensors: 4 per stream token in a double block (2 modulations),
    2 per token in a single block."""
    per_token = 4 * d * a if kind.kind == "double" else 2 * d * a
    if kind.saved is not None:  # the family spec counts them
        per_token = kind.saved.modulated_hidden * d * a
    return sum(t.stream(stream) * per_token for stream in streams)


def block_quantization_bytes(transformer: TransformerSizes, kind: BlockKind, t: Tokens, s: Settings,
                             mod_streams: Sequence[str] = ()) -> int:
    """Quantized weights change what backward keeps (bytes, one block).

    quanto: its linear autograd function saves every input, even of frozen layers: one per input group.
    torchao weight-only: autograd keeps the dequantized (half-precision) weight of every linear whose
    input needs a gradient (all but the modulation linears, unless the modulation trains).
    torchao int8_w8a8, float8_w8a8, auto: nothing (the 8-bit layer keeps only its own weight for backward).
    """
    layout = kind.layout
    if s.w8a8:
        return 0
    if s.backend == "torchao":
        graded = [li for li in kind.linears
                  if layout.get(li.name, ("", ""))[1] != "mod" or layout[li.name][0] in mod_streams]
        return sum(li.in_features * li.out_features for li in graded) * s.act_bytes
    if s.backend != "quanto":
        return 0
    groups = _input_groups(layout, kind.linears, s.batch)
    return sum(t.stream(stream) * width * s.act_bytes for (stream, _), width in groups.items())


def int8_scratch_bytes(transformer: TransformerSizes, s: Settings) -> int:
    """torchao W8A8 formats: the largest transient of one 8-bit linear call (bytes): its input quantized
    and its int32 product scaled in fp32, for the tokens it sees (one per sample: modulation)."""
    t = Tokens(s.image_tokens * s.batch, s.text_tokens * s.batch)

    def tokens(kind: BlockKind, li: LinearInfo) -> int:
        stream, group = kind.layout.get(li.name, ("joint", li.name))
        return s.batch if group == "mod" else t.stream(stream)

    return max(tokens(k, li) * (INT8_SCRATCH_IN * li.in_features + INT8_SCRATCH_OUT * li.out_features)
               for k in transformer.blocks for li in k.linears)


def zero_cond_bytes(transformer: TransformerSizes, kind: BlockKind, t: Tokens, a: int) -> int:
    """Qwen-Image-Edit-2511 (``zero_cond_t``) modulates per token: the scale and gate each modulate
    multiply saves are token-sized (2 modulates x 2) on the image stream."""
    if not transformer.zero_cond_t or kind.kind != "double":
        return 0
    return t.img * 4 * transformer.hidden * a


def block_input_bytes(transformer: TransformerSizes, t: Tokens, a: int) -> int:
    """What gradient checkpointing keeps per block: its inputs (image and text hidden states)."""
    return t.all * transformer.hidden * a


def backward_transient_bytes(transformer: TransformerSizes, kind: BlockKind, lora: Sequence[LinearInfo],
                             t: Tokens, s: Settings) -> int:
    """Peak of the gradient buffers while one block runs backward (calibrated on traces, see docs).

    double: a * (g*M * N_mlp + D * N)   the MLP hidden gradient and its GELU gradient on the largest
                                        stream, plus the streams' hidden-state gradients
    single: a * N * (g*M + 4*D)         the same, plus the gradient of the [attention, MLP] concat
    with g = 2 in half precision and 1.5 in fp32 (fp32 traces peak lower).
    LoRA on a linear wider than D (MLP down-projection, FLUX proj_out), mixed precision: + N_s * in * 4,
    the fp32 gradient of peft's input cast, alive at the same moment.
    """
    d, m, a = transformer.hidden, transformer.mlp_hidden, s.act_bytes
    g = 2.0 if a < 4 else 1.5
    if kind.kind == "double":
        base = a * (g * m * max(t.img, t.txt) + d * t.all)
    else:
        base = a * t.all * (g * m + 4 * d)
    layout = kind.layout
    wide = [t.stream(layout.get(li.name, ("joint", ""))[0]) * li.in_features * 4
            for li in lora if li.in_features > d and a < 4]
    return int(base + max(wide, default=0))


@dataclass(frozen=True)
class ActivationEstimate:
    per_block: Tuple[int, ...]  # saved activations of each block kind, in spec order (bytes)
    saved: int  # kept until backward: the blocks not checkpointed, and the checkpointed ones' inputs
    recompute: int  # checkpointing: what the largest checkpointed block's recomputation adds to ``saved`` at the peak
    transient: int
    outside: int  # embedders, final norm, rotary tables, loss, LoRA outside the blocks
    offloaded: int = 0  # gradient_checkpointing_cpu_offload: the checkpointed blocks' inputs, in host memory
    uncheckpointed: int = 0  # the part of ``saved`` that is the activations of the blocks not checkpointed


def estimate_activations(transformer: TransformerSizes, lora: LoraLayout, s: Settings) -> ActivationEstimate:
    """Activation memory of one training step at the configured resolution and batch."""
    t = Tokens(s.image_tokens * s.batch, s.text_tokens * s.batch)
    a = s.act_bytes
    temb_grad = any(outer_slot(transformer.outer_layout, li.name)[1] == "temb" for li in lora.outer)
    per_block = []
    for kind in transformer.blocks:
        adapted = lora.per_block.get(kind.prefix, ())
        mod_streams = _modulated_streams(kind, kind.layout, adapted, temb_grad)
        base = described_block_bytes(transformer, kind, t, a) if kind.saved is not None \
            else block_base_bytes(transformer, kind.kind, t, a)
        per_block.append(base
                         + block_lora_bytes(transformer, kind, adapted, t, s)
                         + block_modulation_bytes(kind, t, transformer.hidden, a, mod_streams)
                         + block_quantization_bytes(transformer, kind, t, s, mod_streams)
                         + zero_cond_bytes(transformer, kind, t, a))
    inputs = block_input_bytes(transformer, t, a)
    # Execution order: the first ``s.checkpointed`` blocks are checkpointed (activation_offload.checkpointed_indices).
    ordered = [b for k, b in zip(transformer.blocks, per_block) for _ in range(k.count)]
    checkpointed, kept = ordered[:s.checkpointed], sum(ordered[s.checkpointed:])
    # Backward recomputes them last, once the other blocks have freed their activations: the peak holds
    # the larger of the kept activations and one recomputed block, so the recomputation adds only its excess.
    recompute = max(max(checkpointed, default=0) - kept, 0)
    offloaded = 0
    if checkpointed and s.offload_checkpoints:
        # On the device: the block input being copied out and the one copied back for the block.
        saved, offloaded = kept + 2 * inputs, len(checkpointed) * inputs
    else:
        saved = kept + len(checkpointed) * inputs
    transient = max(backward_transient_bytes(transformer, k, lora.per_block.get(k.prefix, ()), t, s)
                    for k in transformer.blocks)
    return ActivationEstimate(tuple(per_block), saved, recompute, transient, _outside_bytes(transformer, lora, t, s),
                              offloaded, kept)


def _modulated_streams(kind: BlockKind, layout: Mapping[str, Tuple[str, str]], adapted: Sequence[LinearInfo],
                       temb_grad: bool) -> Tuple[str, ...]:
    streams = ("img", "txt") if kind.kind == "double" else ("joint",)
    if temb_grad:
        return streams
    return tuple(st for st in streams if any(layout.get(li.name) == (st, "mod") for li in adapted))


def _outside_bytes(transformer: TransformerSizes, lora: LoraLayout, t: Tokens, s: Settings) -> int:
    """Outside the blocks: the final norm's input, the rotary tables, fp32 latents/noise/prediction
    for the loss, and the inputs LoRA on embedders or the output layer saves."""
    a, d = s.act_bytes, transformer.hidden
    rope = t.all * transformer.head_dim * 8 // max(1, s.batch)  # one table per step (complex64 / cos+sin fp32)
    latents = t.img * transformer.in_channels * 4 * 4  # fp32 noisy, noise, target, prediction
    total = t.img * d * a + rope + latents
    for li in lora.outer:
        stream, group = outer_slot(transformer.outer_layout, li.name)
        per_sample = group in ("temb", "mod")
        total += 0 if per_sample else t.stream(stream) * (li.in_features + s.rank) * a
    return total


def outer_slot(layout: BlockLayout, name: str) -> Tuple[str, str]:
    """(stream, group) of a linear outside the blocks: the layout entry its name starts with, else an
    image-stream input of its own."""
    return next((slot for prefix, slot in layout.items() if name.startswith(prefix)), ("img", name))
