"""What is known about a model family without loading it: the light half of a family package.

Each family package (``trainer/families/<name>/``) holds a ``spec.py`` with one ``FamilySpec`` and a
``model.py`` with the runtime class (which imports diffusers). Everything that needs a family fact
without running the model reads the spec through ``trainer.families.SPECS``: the config checks, the
memory planner, the dataset checker, inference, the platform's fp8 choice, the GPU harness and the
tiny-model builders. This module imports neither torch nor diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

# peft's ``target_modules``: a list of module-name suffixes, or one regex that must match a full name.
TargetSpec = Union[str, Sequence[str]]
# Where each linear of a block reads from, for the memory planner: name inside the block ->
# (stream, input group). Linears of one group share one input tensor.
BlockLayout = Mapping[str, Tuple[str, str]]


@dataclass(frozen=True)
class TextTokens:
    """How the family's prompts become text tokens (the planner's and the GPU harness's inputs)."""

    max_length: int = 512  # the pipeline's max_sequence_length: the longest prompt it encodes
    template: int = 0  # template tokens the pipeline encodes with every prompt, then drops
    padded: bool = False  # every prompt is padded to ``max_length`` and the transformer attends to it
    default_caption: int = 128  # caption tokens a plan assumes when nothing says otherwise (~90 words)

    def seen(self, caption_tokens: int) -> int:
        """Text tokens the transformer sees for a caption of ``caption_tokens`` tokens."""
        return self.max_length if self.padded else min(caption_tokens, self.max_length)


@dataclass(frozen=True)
class BlockGroup:
    """One list of repeated blocks: the transformer's attribute and, for the planner, its layout."""

    attribute: str  # e.g. "transformer_blocks": a ModuleList of the transformer
    kind: str  # "double" (image and text streams), "single" (one joint stream), ...
    layout: Optional[BlockLayout] = None  # None: the planner does not model this block


@dataclass(frozen=True)
class FamilySpec:
    """The facts of one model family, readable without importing diffusers."""

    name: str
    title: str  # for people: "Qwen-Image", "FLUX.1-dev", ...
    entry_script: str  # the script that trains it ("train.py", "train_flux_lora.py", ...)
    pipelines: Tuple[str, ...]  # diffusers pipeline classes of its checkpoints (model_index.json)
    transformer: str  # diffusers class name of its transformer
    lora_presets: Mapping[str, TargetSpec]  # lora_target -> peft target_modules
    blocks: Tuple[BlockGroup, ...]  # the repeated blocks, in execution order
    runtime: str  # "module:Class" of the ModelFamily, imported only when a run needs it
    text: TextTokens = field(default_factory=TextTokens)
    uses_references: bool = False  # Edit-style: reference images condition prompt and latents
    # hub id -> {file in that repository: its JSON}: configs of the published checkpoints, for
    # planning without a download. Files found locally or in the HF cache win.
    hub_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    plannable: bool = True  # whether the memory planner models this family

    @property
    def block_attributes(self) -> Tuple[str, ...]:
        """The transformer attributes holding repeated blocks, in execution order."""
        return tuple(group.attribute for group in self.blocks)
