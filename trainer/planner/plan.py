"""The plan: itemised GPU and host memory per phase (cache pass, training, validation renders, host),
the verdict against a budget, and advice (config changes, cumulative, until it fits). ``entry.py`` prints
it for the command line."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from trainer.families import SPECS
from trainer.families.components import VAE_ACTIVATION_FACTORS
from trainer.facts.optimizer_choices import OPTIMIZERS
from trainer.planner.activations import (LoraLayout, Tokens, block_input_bytes, estimate_activations, int8_scratch_bytes,
                                         lora_layout)
from trainer.planner.model_sizes import EncoderSizes, ModelSizes, TransformerSizes, model_sizes
from trainer.planner.report import MemoryItem, MemoryPlan
from trainer.planner.settings import (
    CLIP_TOKENS,
    CUDA_CONTEXT_GIB,
    DEFAULT_SHARD_GIB,
    ENCODE_BATCH,
    FRAGMENTATION,
    GIB,
    HOST_BASELINE_CPU_GIB,
    HOST_BASELINE_CUDA_GIB,
    QUANT_BYTES,
    SCALE_BYTES,
    VIDEO_VAE_CHUNK,
    WORKSPACE_GIB,
    Settings,
    _side_tokens,
    planned_family,
    resolve_settings,
)

def vae_factors(class_name: str) -> Tuple[float, float]:
    """(encode, decode) activation factors of a VAE class (``components.VAE_ACTIVATION_FACTORS``); a class
    not traced yet is refused rather than planned with another VAE's numbers."""
    if class_name not in VAE_ACTIVATION_FACTORS:
        raise ValueError(f"the memory planner has no activation factors for VAE class {class_name} yet "
                         "(trainer/families/components.py VAE_ACTIVATION_FACTORS)")
    return VAE_ACTIVATION_FACTORS[class_name]


# --------------------------------------------------------------------------- the plan
def _total(items: Sequence[MemoryItem]) -> float:
    return sum(i.gib for i in items if i.counted)


def plan_memory(cfg, gpu_memory_gib: float | None = None, blocks_to_swap: int | None = None,
                quantization: str | None = None, *, text_tokens: int | None = None, device: str = "cuda",
                streamed_loading: bool = True, text_encoder_quantization: str | None = None,
                spec: ModelSizes | None = None) -> MemoryPlan:
    """Itemised peak GPU and host memory of training ``cfg`` (a ``TrainConfig``), from configs only.

    ``blocks_to_swap`` and ``quantization`` (``"qfloat8"``, ..., ``"none"``) override the config's
    ``blocks_to_swap`` and ``quantize``/``quantization.weights`` when given. ``device="cpu"`` plans a
    CPU run (everything in host memory). ``streamed_loading`` (the engine's loader) holds about one
    checkpoint shard on the host at a time; False plans diffusers' ``from_pretrained`` fallback,
    which materialises the whole transformer on the host first.
    """
    family = planned_family(cfg)  # refuses a family the planner does not model, before any build
    spec = spec or model_sizes(cfg.pretrained_model_name_or_path, cfg.revision, family.name)
    s = resolve_settings(cfg, spec, blocks_to_swap=blocks_to_swap, quantization=quantization,
                         text_tokens=text_tokens, device=device, streamed_loading=streamed_loading,
                         text_encoder_quantization=text_encoder_quantization)
    plan = build_plan(spec, s, gpu_memory_gib)
    if plan.fits is False:
        plan.advice = advise(spec, s, gpu_memory_gib)
    return plan


def build_plan(spec: ModelSizes, s: Settings, gpu_memory_gib: Optional[float] = None) -> MemoryPlan:
    """The arithmetic of a plan for resolved settings (no advice)."""
    lora = lora_layout(spec.transformer, s.lora_targets)
    cache_items = _cache_pass_items(spec, s)
    train_items = _training_items(spec, s, lora)
    val_items = _validation_items(spec, s, train_items)
    cache_total, train_total, val_total = _total(cache_items), _total(train_items), _total(val_items)
    host_items = _host_items(spec, s, cache_total, max(train_total, val_total))
    host_total = _total(host_items)
    plan = MemoryPlan(_title(spec, s), cache_items + train_items + val_items + host_items, cache_total,
                      train_total, host_total, val_total, gpu_memory_gib, notes=_notes(spec, s), settings=s)
    if gpu_memory_gib is not None:
        need = plan.gpu_peak_gib + (host_total if s.unified_memory else 0.0)
        plan.fits = need <= gpu_memory_gib
    return plan


def _gib(nbytes: float) -> float:
    return nbytes / GIB


def _dtype_name(s: Settings) -> str:
    return {"bf16": "bf16", "fp16": "fp16"}.get(s.precision, "fp32")


def transformer_weight_bytes(spec: TransformerSizes, s: Settings) -> Tuple[float, List[float]]:
    """(outside-the-blocks bytes, bytes of each block in execution order)."""
    a = s.act_bytes
    blocks: List[float] = []
    for kind in spec.blocks:
        if s.quantization is None:
            size = kind.params * a
        else:
            per_weight = QUANT_BYTES[s.quantization]
            # 8-bit: one scale per output channel
            scales = kind.linear_out * SCALE_BYTES.get(s.quantization, 2) if per_weight >= 1 else 0
            size = (kind.params - kind.linear_weights) * a + kind.linear_weights * per_weight + scales
        blocks += [size] * kind.count
    return spec.outer_params * a, blocks


def _training_items(spec: ModelSizes, s: Settings, lora: LoraLayout) -> List[MemoryItem]:
    t, a = spec.transformer, s.act_bytes
    outer, blocks = transformer_weight_bytes(t, s)
    swapped = blocks[len(blocks) - s.blocks_to_swap:] if s.blocks_to_swap else []
    # Autograd keeps the device copy of a swapped block that is not checkpointed until backward: no saving.
    # The swapped blocks are the last ones, the checkpointed the first: those that are both save memory.
    saving = blocks[len(blocks) - s.blocks_to_swap:s.checkpointed] if swapped else []
    n = s.experts  # a two-expert checkpoint training both holds both (each with its LoRA), one step runs one
    # Two experts: block swap takes its blocks from both experts' blocks as one list (docs/WAN.md).
    resident = n * sum(blocks) - sum(saving)
    q = s.quantization or _dtype_name(s)
    items = [MemoryItem(f"transformer weights ({q})" + (f", {n} experts" if n > 1 else ""), _gib(n * outer + resident),
                        f"{t.params / 1e9:.2f}B params" + (f" x {n}" if n > 1 else "") + f", {t.num_blocks} blocks"
                        + (f"; {len(swapped)} swapped to host" if swapped else "")
                        + ("; both experts (train_expert: high_noise or low_noise holds one)" if n > 1 else ""))]
    if swapped:
        unsaved = len(swapped) - len(saving)
        items.append(MemoryItem("block swap: blocks in flight", _gib(2 * max(swapped)),
                                "the running block and the prefetched next one"
                                + (f"; no saving for the {unsaved} not checkpointed" if unsaved else "")))
    if s.w8a8:
        items.append(MemoryItem("int8 matmul scratch", _gib(int8_scratch_bytes(t, s)),
                                "the largest linear's input in 8 bits and its int32/fp32 product"))
    elif s.quantization is not None:
        largest = max(li.in_features * li.out_features for k in t.blocks for li in k.linears)
        items.append(MemoryItem("dequantization scratch", _gib(2 * largest * a),
                                "the largest block linear dequantized on the fly, two at a time"))
    n_lora = lora.params(t, s.rank) * s.experts
    items += [
        MemoryItem("LoRA parameters (fp32)", _gib(n_lora * 4), f"{n_lora / 1e6:.2f}M params, rank {s.rank}"
                   + (f", {s.experts} experts" if s.experts > 1 else "")),
        MemoryItem("LoRA gradients (fp32)", _gib(n_lora * 4)),
        _optimizer_item(t, lora, s),
    ]
    items += _activation_items(spec, s, lora)
    items += _resident_encoder_items(spec, s)
    if s.device == "cuda":
        act = sum(i.gib for i in items if i.name.startswith(("activations", "backward")))
        items += [MemoryItem("allocator fragmentation", act * FRAGMENTATION,
                             f"{FRAGMENTATION:.0%} of activations and backward buffers (assumed)"),
                  MemoryItem("CUDA context + workspace", CUDA_CONTEXT_GIB + WORKSPACE_GIB,
                             "context, cuBLAS/attention workspaces (assumed)")]
    return items


def _optimizer_item(t: TransformerSizes, lora: LoraLayout, s: Settings) -> MemoryItem:
    """The optimizer's state for the LoRA weights, by its own formula (``trainer/facts/optimizer_choices.py``):
    AdamW two fp32 moments (8 B/param), 8-bit AdamW 2 B/param, Adafactor a factored second moment,
    Prodigy 16 B/param, schedule-free AdamW 8, Prodigy + schedule-free about 4, Muon 4 in the blocks."""
    spec = OPTIMIZERS[s.optimizer]
    state = spec.state_bytes(lora.shapes(t, s.rank))
    params = lora.params(t, s.rank)
    return MemoryItem(f"optimizer state ({spec.label})", _gib(state * s.experts), f"{state / params:.2g} bytes/param")


def _activation_items(spec: ModelSizes, s: Settings, lora: LoraLayout) -> List[MemoryItem]:
    t = spec.transformer
    est = estimate_activations(t, lora, s)
    tokens = f"{s.batch} x ({s.image_tokens} image + {s.text_tokens} text) tokens"
    per_block = ", ".join(f"{k.kind} {_gib(b):.3f}" for k, b in zip(t.blocks, est.per_block))
    inputs = est.saved - est.uncheckpointed
    n = s.checkpointed
    items = []
    if 0 < n < t.num_blocks:
        kept = t.num_blocks - n
        items.append(MemoryItem(f"activations: {kept} block{'s' if kept > 1 else ''} not checkpointed",
                                _gib(est.uncheckpointed),
                                f"the last {kept} (gradient_checkpointing: {n} of {t.num_blocks}); "
                                f"{tokens}; per block GiB: {per_block}"))
    recomputed = MemoryItem("activations: one block recomputed", _gib(est.recompute), f"per block GiB: {per_block}"
                            + ("; only its excess over the kept activations, freed by then" if n < t.num_blocks else ""))
    if n and s.offload_checkpoints:
        items += [MemoryItem("activations: block inputs (in host memory)", _gib(inputs),
                             f"two on the GPU at a time; {n} x {_gib(est.offloaded / n):.3f} "
                             "GiB on the host (gradient_checkpointing_cpu_offload)"), recomputed]
    elif n:
        items += [MemoryItem("activations: block inputs (checkpointed)", _gib(inputs),
                             f"{n} blocks x {tokens} x {t.hidden} x {s.act_bytes} B"), recomputed]
    else:
        items = [MemoryItem("activations: all blocks (no checkpointing)", _gib(est.saved),
                            f"{tokens}; per block GiB: {per_block}")]
    return items + [MemoryItem("activations: outside the blocks", _gib(est.outside),
                               "final norm, rotary tables, fp32 loss tensors"),
                    MemoryItem("backward buffers", _gib(est.transient), "gradients of one block's MLP and streams")]


_RESIDENT = ("transformer weights", "block swap", "dequantization", "int8 matmul", "LoRA parameters",
             "optimizer state", "text encoder weights", "VAE weights", "CUDA context")


def _validation_items(spec: ModelSizes, s: Settings, train_items: Sequence[MemoryItem]) -> List[MemoryItem]:
    """Validation renders (between steps, gradients freed): what stays resident, then the larger of
    the denoising step at the validation size and the VAE decode."""
    if not s.validation_pixels:
        return []
    t, a = spec.transformer, s.act_bytes
    resident = sum(i.gib for i in train_items if i.name.startswith(_RESIDENT))
    tokens = s.validation_pixels // 256 + s.text_tokens
    denoise = tokens * (4 * t.hidden + t.mlp_hidden) * a  # one block's q/k/v/out and MLP hidden, no grad
    decode = 0.0
    if spec.vae is not None:
        decode = vae_factors(spec.vae.class_name)[1] * spec.vae.base_channels * a * s.validation_pixels \
            * min(s.num_frames, VIDEO_VAE_CHUNK)  # a clip decodes a few frames at a time
    items = [MemoryItem("resident (weights, LoRA, optimizer, VAE, context)", resident, "as in training"),
             MemoryItem("denoising activations", _gib(denoise), f"{tokens} tokens, inference",
                        counted=denoise >= decode),
             MemoryItem("VAE decode", _gib(decode), f"{s.validation_pixels / 1e6:.2f} Mpx", counted=decode > denoise)]
    return [dataclasses.replace(i, section="validation render") for i in items]


def _resident_encoder_items(spec: ModelSizes, s: Settings) -> List[MemoryItem]:
    items = []
    if not s.precompute_text or s.keep_encoders:
        size = sum(_encoder_weight_bytes(e, s) for e in spec.text_encoders)
        why = "encodes captions live" if not s.precompute_text else "kept loaded (disable_cpu_offload / unified memory)"
        items.append(MemoryItem("text encoder weights", _gib(size), why))
    if spec.vae is not None and (not s.precompute_image or s.keep_encoders or s.validation_pixels):
        why = "encodes images live" if not s.precompute_image else \
            "kept for validation renders" if s.validation_pixels else "kept loaded"
        items.append(MemoryItem("VAE weights", _gib(spec.vae.params * s.act_bytes), why))
    return items


def _encoder_weight_bytes(e: EncoderSizes, s: Settings) -> float:
    """On the GPU: without an LM head the family drops after loading; quantized, the linears of its layers."""
    params = e.params - e.dropped_head
    if s.text_encoder_quantization is None:
        return params * s.act_bytes
    q = QUANT_BYTES[s.text_encoder_quantization]
    return (params - e.layer_linear_weights) * s.act_bytes + e.layer_linear_weights * q


def _encoder_activation_bytes(e: EncoderSizes, s: Settings) -> float:
    """Encode activations (no grad), per token: Qwen2.5-VL keeps every layer's hidden state
    (``output_hidden_states``) and computes LM-head logits; T5/CLIP hold a few MLP-sized buffers.
    Calibrated on fake-tensor traces of the real encoders (docs)."""
    a = s.act_bytes
    if e.class_name == "CLIPTextModel":
        return ENCODE_BATCH * CLIP_TOKENS * 4 * e.intermediate * a
    tokens = s.encode_batch * s.encode_tokens
    if e.decoder:  # a VL/causal LM through its *ForConditionalGeneration class (logits: unless it has no head)
        per_token = a * (e.vocab + (e.layers + 1) * e.hidden + 1.5 * e.intermediate)
        vision = s.vision_patches * a * (3 * e.vision_intermediate + 4 * e.vision_hidden)
        return tokens * per_token + vision
    return tokens * 6 * e.intermediate * a


def _cache_pass_items(spec: ModelSizes, s: Settings) -> List[MemoryItem]:
    te_q = s.text_encoder_quantization or _dtype_name(s)
    text = [MemoryItem(f"{e.component} weights ({te_q})", _gib(_encoder_weight_bytes(e, s)),
                       f"{e.class_name}, {e.params / 1e9:.2f}B params") for e in spec.text_encoders]
    text += [MemoryItem(f"{e.component} activations", _gib(_encoder_activation_bytes(e, s)),
                        f"{s.encode_batch} prompt(s) x {s.encode_tokens} tokens") for e in spec.text_encoders]
    vae: List[MemoryItem] = []
    if spec.vae is not None:
        factor = vae_factors(spec.vae.class_name)[0]
        chunk = min(s.num_frames, VIDEO_VAE_CHUNK)  # a clip encodes causally, a few frames at a time
        encode = factor * spec.vae.base_channels * s.act_bytes * s.img_size ** 2 * chunk
        what = (f"one {s.num_frames}-frame clip at a time, {chunk} frames per step" if s.num_frames > 1
                else f"one {s.img_size}x{s.img_size} image at a time ({1 + s.references} per sample)")
        vae = [MemoryItem("VAE weights", _gib(spec.vae.params * s.act_bytes), f"{spec.vae.class_name}"),
               MemoryItem("VAE encode activations", _gib(encode), what)]
    if not (s.precompute_text or s.precompute_image):
        return []
    text_total = _total(text) if s.precompute_text else 0.0
    vae_total = _total(vae) if s.precompute_image else 0.0
    text, vae = (text if s.precompute_text else []), (vae if s.precompute_image else [])
    if not s.keep_encoders:
        # The encoders take turns: each is freed before the next loads, so only the larger phase counts.
        smaller = vae if text_total >= vae_total else text
        smaller_ids = {id(i) for i in smaller}
        text = [i if id(i) not in smaller_ids else dataclasses.replace(i, counted=False) for i in text]
        vae = [i if id(i) not in smaller_ids else dataclasses.replace(i, counted=False) for i in vae]
    items = text + vae
    if s.device == "cuda":
        items.append(MemoryItem("CUDA context + workspace", CUDA_CONTEXT_GIB + WORKSPACE_GIB, "assumed"))
    return [dataclasses.replace(i, section="cache pass") for i in items]


def _host_items(spec: ModelSizes, s: Settings, cache_pass_gib: float, training_gib: float) -> List[MemoryItem]:
    """Host: process baseline + the largest phase (encoder load, transformer load, training) + caches."""
    a = s.act_bytes
    _, blocks = transformer_weight_bytes(spec.transformer, s)
    swapped = sum(blocks[len(blocks) - s.blocks_to_swap:]) if s.blocks_to_swap else 0.0
    full = spec.transformer.params * a * s.experts
    shard = full / spec.transformer_shards if spec.transformer_shards else DEFAULT_SHARD_GIB * GIB
    if s.device == "cpu":
        # The device is the host: the phases' device totals are host memory.
        phases = {"cache pass (encoders on the CPU)": cache_pass_gib,
                  "training (everything on the CPU)": training_gib}
    else:
        encoders = sum(e.params for e in spec.text_encoders) * a  # loaded on the host, then moved
        loading = min(shard, full) if s.streamed_loading else full
        offloaded = s.checkpointed * block_input_bytes(
            spec.transformer, Tokens(s.image_tokens * s.batch, s.text_tokens * s.batch), a) \
            if s.offload_checkpoints else 0
        training = "training (swapped blocks, pinned" + (", offloaded block inputs)" if offloaded else ")")
        phases = {"text encoder load (host copy before the GPU)": _gib(encoders),
                  ("transformer load (one shard at a time)" if s.streamed_loading
                   else "transformer load (whole model on the host)"): _gib(max(loading, 2 * swapped)),
                  training: _gib(swapped + offloaded)}
    largest = max(phases, key=phases.get)
    baseline = HOST_BASELINE_CPU_GIB if s.device == "cpu" else HOST_BASELINE_CUDA_GIB
    items = [MemoryItem("process baseline (Python, torch, libraries)", baseline,
                        "measured on CPU torch" if s.device == "cpu" else "assumed for CUDA torch")]
    # The phases come one after another: only the largest counts.
    items += [MemoryItem(f"phase: {name}", value, "largest phase" if name == largest else "", counted=name == largest)
              for name, value in phases.items()]
    caches = _in_memory_cache_bytes(spec, s)
    if caches is not None:
        items.append(MemoryItem("cached latents + embeddings in memory", _gib(caches),
                                f"{s.num_images} images (save_cache_on_disk: false)"))
    return [dataclasses.replace(i, section="host") for i in items]


def _in_memory_cache_bytes(spec: ModelSizes, s: Settings) -> Optional[float]:
    if s.cache_on_disk or not (s.precompute_text or s.precompute_image) or not s.num_images:
        return None
    a, per_image = s.act_bytes, 0.0
    if s.precompute_image and spec.vae is not None:
        side = s.img_size // spec.vae.scale_factor
        per_image += (1 + s.references) * spec.vae.latent_channels * side * side * a * s.latent_frames
    per_prompt = 0.0
    if s.precompute_text and spec.text_encoders:
        joint = spec.text_encoders[-1].hidden  # the encoder whose sequence the transformer reads
        pooled = spec.text_encoders[0].hidden if len(spec.text_encoders) > 1 else 0  # FLUX: CLIP pooled
        per_prompt = (s.text_tokens * joint + pooled) * a
        # Edit encodes the empty (dropout) prompt per sample, with its references; others once.
        per_image += per_prompt * (2 if s.references else 1)
    return per_image * s.num_images + (0 if s.references else per_prompt)


def _title(spec: ModelSizes, s: Settings) -> str:
    quant = s.quantization or "none"
    frames = f" x {s.num_frames} frames ({s.latent_frames} latent)" if s.num_frames > 1 else ""
    return (f"Memory plan: {spec.name} ({s.family}; configs: {spec.source}), {s.img_size}x{s.img_size}{frames}, "
            f"batch {s.batch}, {s.precision}, LoRA rank {s.rank}\n"
            f"tokens per sample: {s.image_tokens} image + {s.text_tokens} text; gradient checkpointing "
            f"{_checkpointing_label(s)}; quantization {quant}; optimizer "
            f"{OPTIMIZERS[s.optimizer].label}; blocks_to_swap {s.blocks_to_swap}; "
            f"device {s.device}")


def _checkpointing_label(s: Settings) -> str:
    if s.checkpointed in (0, s.num_blocks):
        return "on" if s.checkpointed else "off"
    return f"on for the first {s.checkpointed} of {s.num_blocks} blocks"


def _notes(spec: ModelSizes, s: Settings) -> List[str]:
    notes = []
    family = SPECS[s.family]
    text = family.text
    if text.padded:
        notes.append(f"{family.title} text: padded to {s.text_tokens} tokens (attended, so counted in full)")
    else:
        dropped = f" after its {text.template}-token template drop" if text.template else ""
        notes.append(f"{s.caption_tokens} caption tokens per sample (default {text.default_caption}; "
                     f"{family.title} keeps up to {text.max_length}{dropped}; --text-tokens to change)")
    if s.references:
        notes.append(f"{s.references} reference image(s) per sample add {s.image_tokens - s.target_tokens} image "
                     f"tokens and {s.text_tokens - s.caption_tokens} vision tokens to a {s.caption_tokens}-token caption")
    notes.append(f"image planned as a {s.img_size}x{s.img_size} square (img_size is the longest side; with "
                 "bucket_mode: area, the side of the bucket area)")
    if s.num_frames > 1:
        notes.append(f"clips planned at {s.num_frames} frames (the datasets' largest num_frames): {s.latent_frames} "
                     f"latent frames x {s.target_tokens // s.latent_frames} tokens each; bucket_mode: area with "
                     "img_size = sqrt(width x height) plans a wide clip at its own size")
    if s.precision == "no":
        notes.append("mixed_precision unset/'no': weights and activations in fp32 "
                     "(accelerate launch's --mixed_precision, or an accelerate config that sets one, wins over the YAML)")
    if s.precompute_text or s.precompute_image:
        notes.append("first run: the encoders load for the cache pass (a later run that finds the disk cache skips it)")
    if s.device == "cuda":
        notes.append("GPU constants (CUDA context, workspace, fragmentation) are assumptions; measured peaks on an "
                     "H100/H200 came within -2% to -7% of the plan (docs/MEMORY_PLANNER.md)")
        if s.streamed_loading:
            notes.append("host: the checkpoint is stored in the training dtype (a converted load holds the "
                         "converted transformer on the host; --whole-model-loading plans that)")
    if s.num_images is None and not s.cache_on_disk:
        notes.append("dataset folder not found: in-memory cache not counted")
    if s.unified_memory:
        notes.append("unified memory: GPU and host share one pool; the fit check adds both")
    if s.dora:
        notes.append("use_dora: DoRA's per-linear weight-norm temporaries are not modelled (expect more)")
    return notes


# --------------------------------------------------------------------------- advice
def advise(spec: ModelSizes, s: Settings, budget: float) -> List[str]:
    """Config changes, applied one after another, until the plan fits ``budget`` GiB."""
    advice: List[str] = []
    current = build_plan(spec, s, budget)
    steps = [
        ("quantize_text_encoder: true", lambda x: x.text_encoder_quantization is None and x.precompute_text,
         lambda x: dataclasses.replace(x, text_encoder_quantization=x.quantization or "qfloat8"), "cache"),
        ("gradient_checkpointing: true (every block)", lambda x: x.checkpointed < x.num_blocks,
         lambda x: dataclasses.replace(x, checkpointed=x.num_blocks), "training"),
        ("quantize: true (quantization: {backend: torchao, weights: auto})", lambda x: x.quantization is None,
         lambda x: dataclasses.replace(x, quantization="auto"), "training"),
        ("adam8bit: true", lambda x: x.optimizer == "adamw",
         lambda x: dataclasses.replace(x, optimizer="adamw8bit"), "training"),
        ("precompute_text_embeddings: true, precompute_image_embeddings: true",
         lambda x: not (x.precompute_text and x.precompute_image),
         lambda x: dataclasses.replace(x, precompute_text=True, precompute_image=True), "training"),
        # Last of these: it costs PCIe traffic every step (block swap, tried next, costs more).
        ("gradient_checkpointing_cpu_offload: true", lambda x: x.checkpointing and not x.offload_checkpoints
         and x.device == "cuda" and not x.unified_memory,
         lambda x: dataclasses.replace(x, offload_checkpoints=True), "training"),
    ]
    for text, applies, change, phase in steps:
        if current.fits or not applies(s):
            continue
        if phase == "cache" and current.cache_pass_gib <= budget:
            continue
        trial = build_plan(spec, change(s), budget)
        if trial.gpu_peak_gib < current.gpu_peak_gib - 0.01:
            s, current = change(s), trial
            advice.append(f"{text} -> GPU peak {current.gpu_peak_gib:.2f} GiB")
    if not current.fits and current.training_gib > budget:
        s, current = _advise_swap(spec, s, budget, advice, current)
    if not current.fits and current.training_gib > budget:
        s, current = _advise_size(spec, s, budget, advice, current)
    if not current.fits:
        advice.append(f"no combination tried fits {budget:.2f} GiB (best: {current.gpu_peak_gib:.2f} GiB)")
    return advice


def _advise_swap(spec: ModelSizes, s: Settings, budget: float, advice: List[str], current: MemoryPlan):
    """The smallest ``blocks_to_swap`` that fits (needs checkpointing)."""
    if not s.checkpointing:
        return s, current
    for n in range(s.blocks_to_swap + 1, spec.transformer.num_blocks + 1):
        trial = build_plan(spec, dataclasses.replace(s, blocks_to_swap=n), budget)
        if trial.fits:
            advice.append(f"blocks_to_swap: {n} (the smallest that fits) -> GPU peak {trial.gpu_peak_gib:.2f} GiB, "
                          f"host peak {trial.host_gib:.2f} GiB")
            return dataclasses.replace(s, blocks_to_swap=n), trial
    return s, current


def _advise_size(spec: ModelSizes, s: Settings, budget: float, advice: List[str], current: MemoryPlan):
    """Batch 1, then smaller images (with the swap found above kept)."""
    if s.batch > 1:
        one = dataclasses.replace(s, batch=1)
        trial = build_plan(spec, one, budget)
        advice.append(f"data_config.train_batch_size: 1 -> GPU peak {trial.gpu_peak_gib:.2f} GiB")
        s, current = one, trial
        if current.fits:
            return s, current
    for size in (768, 640, 512):
        if size >= s.img_size:
            continue
        tokens = _side_tokens(size)
        smaller = dataclasses.replace(s, img_size=size, image_tokens=s.image_tokens - s.target_tokens + tokens,
                                      target_tokens=tokens)
        trial = build_plan(spec, smaller, budget)
        if trial.fits:
            advice.append(f"data_config.img_size: {size} -> GPU peak {trial.gpu_peak_gib:.2f} GiB")
            return smaller, trial
    return s, current
