"""Real-valued RoPE (``trainer/families/real_rope.py`` and each family's ``attention.py``): for every family whose
diffusers processor rotates in complex numbers, the project's processors give diffusers' results (each block and
the whole transformer, forward and gradients, fp32 relative error <= 1e-5), compiled (the real arithmetic: the
AOTAutograd graphs inductor would get, run op by op with ``aot_eager``) and eager (diffusers' complex product);
the compiled forward and backward graphs hold no complex-dtype value; weights, configs and LoRA files stay as
they were; training, compiled, gives diffusers' losses and resumes bit for bit."""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from safetensors.torch import load_file

from conftest import (ONE_SHAPE, assert_resume_is_bit_equal, family_pipeline, lora_keys_match, read_losses,
                      train_in_process)
from benchmarks.rope_block_ab import (capture_block_call, compiled_graphs, complex_values, keeping, rel_err,
                                      run_block)
from trainer.config import TrainConfig
from trainer.families.base import load_family
from trainer.families.real_rope import cos_sin, install, is_installed, restore, rotate, rotate_complex, rotate_real

TOLERANCE = 1e-5  # fp32 relative error (Frobenius) against diffusers' processor
COMPILED = "aot_eager"  # the graphs inductor would compile, run op by op: seconds on a CPU, not minutes


@dataclass(frozen=True)
class Case:
    """A family on its tiny model, with a batch that exercises what its tables cover."""

    family: str
    tiny: str  # tiny_model name
    captions: Tuple[int, ...]  # caption lengths: unequal ones pad and mask (Qwen-Image, Z-Image)
    references: Tuple[Tuple[int, int], ...] = ()  # latent (h, w) of each reference
    zero_cond_t: bool = False  # Edit-2511: reference tokens modulated at t = 0


CASES = {
    "qwen_image": Case("qwen_image", "qwen_image", (5, 7)),
    "qwen_image_edit": Case("qwen_image_edit", "qwen_image_edit", (6,), references=((6, 10),)),
    "edit_2511": Case("qwen_image_edit", "qwen_image_edit_plus", (6,), references=((8, 8), (4, 8)),
                      zero_cond_t=True),
    "qwen_image21": Case("qwen_image21", "qwen_image21", (9,), references=((4, 8),)),
    "z_image": Case("z_image", "z_image", (5, 9)),
}


def model_folder(case: Case, tiny_model: Callable[[str], Path], tmp_path_factory: Any) -> Path:
    folder = tiny_model(case.tiny)
    if not case.zero_cond_t:
        return folder
    copy = tmp_path_factory.mktemp("edit-2511") / "model"
    shutil.copytree(folder, copy)
    config_file = copy / "transformer" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "zero_cond_t": True}))
    return copy


@pytest.fixture(scope="module")
def loaded(tiny_model: Callable[[str], Path], tmp_path_factory: Any) -> Callable[[str], Tuple[Any, torch.nn.Module]]:
    """``loaded(case)``: the family and its transformer as ``load_transformer`` gives it (fp32), once per module."""
    cache: Dict[str, Tuple[Any, torch.nn.Module]] = {}

    def load(name: str) -> Tuple[Any, torch.nn.Module]:
        if name not in cache:
            case = CASES[name]
            cfg = TrainConfig(family=case.family,
                              pretrained_model_name_or_path=str(model_folder(case, tiny_model, tmp_path_factory)))
            family = load_family(cfg)
            cache[name] = family, family.load_transformer(torch.float32)
        return cache[name]

    return load


def batch(case: Case, family: Any, transformer: torch.nn.Module, seed: int = 0,
          ) -> Tuple[torch.Tensor, Dict[str, Any], List[torch.Tensor]]:
    """Random latents (8x8), the family's collated text of ``case.captions`` lengths (Qwen-Image-2.1: slots for
    each reference between text tokens), and the references."""
    gen = torch.Generator().manual_seed(seed)
    channels = int(family.vae_config.get("z_dim") or family.vae_config["latent_channels"])
    latents = torch.randn(len(case.captions), channels, 8, 8, generator=gen)
    references = [torch.randn(len(case.captions), channels, h, w, generator=gen) for h, w in case.references]
    width = transformer.config[family.spec.text.conditions["prompt_embeds"][0]]
    conds = [{"prompt_embeds": torch.randn(n, width, generator=gen)} for n in case.captions]
    if "image_pad_mask" in family.spec.text.conditions:  # Qwen-Image-2.1: reference slots among the text tokens
        for cond in conds:
            slots = [torch.ones(h * w // 4, dtype=torch.bool) for h, w in case.references]
            text = torch.zeros(len(cond["prompt_embeds"]) - sum(len(s) for s in slots), dtype=torch.bool)
            cond["image_pad_mask"] = torch.cat([text[:3], *slots, text[3:]])
    return latents, family.collate_text(conds, torch.device("cpu"), torch.float32), references


def predict_with_grads(family: Any, transformer: torch.nn.Module, inputs: Tuple[Any, ...],
                       ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The prediction and the gradients of a fixed projection of it: to the latents, the references and every
    weight (zeros for one without: compiled blocks give zeros where eager ones give none)."""
    latents, text, references = inputs
    latents = latents.clone().requires_grad_(True)
    references = [r.clone().requires_grad_(True) for r in references]
    transformer.requires_grad_(True).zero_grad(set_to_none=True)  # loaded frozen
    out = family.predict(transformer, latents, torch.tensor([0.3, 0.7][:len(latents)]), text, references)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weight).sum().backward()
    grads = [latents.grad, *[r.grad for r in references]]
    grads += [torch.zeros_like(p) if p.grad is None else p.grad for p in transformer.parameters()]
    return out.detach(), [g.detach().clone() for g in grads]


def processor_types(transformer: torch.nn.Module) -> set:
    """The classes of the transformer's attention processors."""
    return {type(m.processor) for m in transformer.modules() if hasattr(m, "set_processor")}


# ------------------------------------------------------------------------------------------------ the rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table_batch", [(), (2,)], ids=["shared-table", "per-sample-table"])
def test_rotations_are_diffusers_complex_product(dtype: torch.dtype, table_batch: Tuple[int, ...]) -> None:
    """``rotate_real`` and ``rotate_complex`` on the real table equal ``apply_rotary_emb_qwen(use_real=False)``
    (Qwen) / Z-Image's complex product, for a table shared by the batch (Qwen) and one per sample (Z-Image), in
    fp32 and bf16; so does ``rotate``, eager and compiled."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 3, 16, generator=gen).to(dtype)  # (B, S, H, D)
    angles = torch.randn(*table_batch, 11, 8, generator=gen) * 40
    freqs = torch.polar(torch.ones_like(angles), angles)
    if table_batch:  # Z-Image: (B, S, D/2), a head axis inserted at 2
        want = torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * freqs.unsqueeze(2))
        want = want.flatten(3).type_as(x)
    else:
        want = apply_rotary_emb_qwen(x, freqs, use_real=False)
    table = cos_sin(freqs)
    assert table.shape == (*table_batch, 11, 8, 2) and table.dtype == torch.float32
    torch._dynamo.reset()
    for got in (rotate_real(x, table), rotate_complex(x, table), rotate(x, table),
                torch.compile(rotate, backend=COMPILED, fullgraph=True)(x, table)):
        assert got.dtype == dtype and got.shape == x.shape
        assert rel_err([got], [want]) <= (TOLERANCE if dtype == torch.float32 else 0.0)
    assert torch.equal(rotate_complex(x, table), want)  # eagerly, diffusers' very operations
    assert rel_err([want], [x]) > 0.5  # the rotation does something


def test_rotate_refuses_a_complex_table() -> None:
    freqs = torch.polar(torch.ones(4, 2), torch.randn(4, 2))
    with pytest.raises(TypeError, match="still complex"):
        rotate(torch.randn(1, 4, 1, 4), freqs)


# ------------------------------------------------------------------------------------------------ equal to diffusers


@pytest.mark.parametrize("name", CASES)
def test_each_block_equals_diffusers_compiled_without_complex_values(name: str, loaded: Callable[..., Any]) -> None:
    """Each block (every block list) on the inputs a real forward gives it: compiled and eager, outputs and the
    gradients of every floating-point input within 1e-5 of diffusers' eager processor; the compiled forward and
    backward graphs hold complex values with diffusers' processor and none with the project's. The blocks of a
    list run through the graphs compiled for its first, as in the engine (one graph, each block's weights)."""
    family, transformer = loaded(name)
    assert is_installed(transformer), "load_transformer installs the family's real RoPE"
    inputs = batch(CASES[name], family, transformer)
    forward = lambda: family.predict(transformer, inputs[0], torch.tensor([0.3, 0.7][:len(inputs[0])]),  # noqa: E731
                                     *inputs[1:])
    rope = family.real_rope
    lists = [list(getattr(transformer, attribute)) for attribute in family.spec.block_attributes]
    assert [b for blocks in lists for b in blocks] == family.blocks(transformer)
    try:
        for blocks in lists:
            ours: List[torch.fx.GraphModule] = []  # the compiled runs' graphs (aot_eager, kept)
            backend = keeping(ours)
            calls = [capture_block_call(transformer, rope, block, forward) for block in blocks]
            for index, call in enumerate(calls):
                want = run_block(transformer, rope, call, real=False)
                for compiled in (backend, None):
                    got = run_block(transformer, rope, call, real=True, backend=compiled, afresh=index == 0)
                    assert rel_err(got.outputs, want.outputs) <= TOLERANCE
                    assert got.grads and rel_err(got.grads, want.grads) <= TOLERANCE
            theirs = compiled_graphs(transformer, rope, calls[0], real=False)
            assert len(ours) == 2, "one forward and one backward graph, for every block of the list"
            assert complex_values(theirs), "diffusers' processor puts complex values in the graphs (the check works)"
            assert complex_values(ours) == []
    finally:
        install(transformer, rope)
        torch._dynamo.reset()


@pytest.mark.parametrize("name", CASES)
def test_transformer_equals_diffusers_forward_and_backward(name: str, loaded: Callable[..., Any]) -> None:
    """The whole prediction (tables converted once, every block list: Z-Image's refiners too), each block's
    forward compiled as the engine compiles them, and eager: output and gradients (latents, references, every
    weight) within 1e-5 of diffusers' eager processors."""
    family, transformer = loaded(name)
    inputs = batch(CASES[name], family, transformer)
    assert processor_types(transformer) == {family.real_rope.processor}
    blocks = family.blocks(transformer)
    torch._dynamo.reset()
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=COMPILED)
    try:
        compiled = predict_with_grads(family, transformer, inputs)
    finally:
        for block in blocks:
            del block.forward  # the class's forward again
        torch._dynamo.reset()
    eager = predict_with_grads(family, transformer, inputs)
    restore(transformer)
    try:
        assert processor_types(transformer) == {family.real_rope.replaces}
        want, want_grads = predict_with_grads(family, transformer, inputs)
    finally:
        install(transformer, family.real_rope)
    for got, got_grads in (compiled, eager):
        assert rel_err([got], [want]) <= TOLERANCE
        assert sum(bool(g.any()) for g in want_grads) > 10 and rel_err(got_grads, want_grads) <= TOLERANCE


# ------------------------------------------------------------------------------------------------ the transformer


def test_install_changes_no_weight_config_or_module(loaded: Callable[..., Any]) -> None:
    """install/restore touch no parameter, buffer, module name or config value; restore gives back diffusers'
    processors with the backend set on ours meanwhile, and the complex table."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    family, transformer = loaded("qwen_image")
    state = {k: v.clone() for k, v in transformer.state_dict().items()}
    modules, config = [n for n, _ in transformer.named_modules()], dict(transformer.config)
    restore(transformer)
    assert not is_installed(transformer)
    assert [n for n, _ in transformer.named_modules()] == modules and dict(transformer.config) == config
    assert transformer.state_dict().keys() == state.keys()
    vid, _ = transformer.pos_embed([(1, 4, 4)], max_txt_seq_len=3, device=torch.device("cpu"))
    assert vid.is_complex()
    install(transformer, family.real_rope)
    transformer.set_attention_backend("native")
    restore(transformer)
    processors = [b.attn.processor for b in transformer.transformer_blocks]
    assert all(type(p) is QwenDoubleStreamAttnProcessor2_0 and p._attention_backend == "native" for p in processors)
    install(transformer, family.real_rope)
    vid, txt = transformer.pos_embed([(1, 4, 4)], max_txt_seq_len=3, device=torch.device("cpu"))
    assert vid.shape == (16, 8, 2) and txt.shape == (3, 8, 2) and not vid.is_complex()
    assert all(torch.equal(state[k], v) for k, v in transformer.state_dict().items())


def test_another_processor_keeps_diffusers_rope(loaded: Callable[..., Any]) -> None:
    """A processor the project's one does not reproduce (Qwen-Image-2.1's flex one) on any block: install
    changes nothing and says so (the table is shared by all blocks)."""
    from diffusers.models.transformers.transformer_qwenimage21 import (
        QwenImage21AttnProcessor,
        QwenImage21FlexAttnProcessor,
    )

    family, transformer = loaded("qwen_image21")
    restore(transformer)
    try:
        transformer.transformer_blocks[1].attn.set_processor(QwenImage21FlexAttnProcessor())
        assert install(transformer, family.real_rope) is False
        assert not is_installed(transformer)
        assert type(transformer.transformer_blocks[0].attn.processor) is QwenImage21AttnProcessor
        image_pad_mask = torch.tensor([False, True, True, True, True, False])  # a 2x2 image between text
        assert transformer.pos_embed([(1, 2, 2)], image_pad_mask, torch.device("cpu")).is_complex()
    finally:
        transformer.transformer_blocks[1].attn.set_processor(QwenImage21AttnProcessor())
        install(transformer, family.real_rope)
    assert is_installed(transformer)


@pytest.mark.parametrize("name", ["qwen_image", "qwen_image21"])
def test_render_equals_diffusers(name: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The family's pipeline renders the same image with the project's processors (Qwen-Image-2.1: with a
    reference, through its KV cache: the prefix's keys stored, then reused)."""
    from PIL import Image

    pipe = family_pipeline(name, tiny_model(name))
    family = load_family(TrainConfig(family=name, pretrained_model_name_or_path=str(tiny_model(name))))
    call: Dict[str, Any] = dict(prompt="a red cube", height=64, width=64, num_inference_steps=2, output_type="np")
    if family.uses_references:
        call.update(image=Image.new("RGB", (64, 64), (200, 30, 30)), output_resolution=64)
    want = pipe(generator=torch.Generator().manual_seed(0), **call).images
    modes: List[Any] = []
    processor = family.real_rope.processor
    original = processor.__call__

    @functools.wraps(original)  # diffusers' Attention passes only the arguments the signature names
    def spy(self: Any, attn: Any, hidden: torch.Tensor, **kwargs: Any) -> Any:
        modes.append(kwargs.get("kv_cache_mode"))
        return original(self, attn, hidden, **kwargs)

    monkeypatch.setattr(processor, "__call__", spy)
    assert install(pipe.transformer, family.real_rope)
    got = pipe(generator=torch.Generator().manual_seed(0), **call).images
    assert modes, "the project's processor rendered"
    assert not family.uses_references or {"extract", "cached"} <= set(modes)
    assert rel_err([torch.from_numpy(got)], [torch.from_numpy(want)]) <= TOLERANCE


# ------------------------------------------------------------------------------------------------ training


@pytest.fixture
def compile_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's ``torch.compile`` of the blocks with the ``aot_eager`` backend: the graphs inductor would get,
    run op by op (inductor itself takes minutes on a CPU)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=COMPILED))
    torch._dynamo.reset()


def train(family: str, profile: str, model: Path, data: Path, out: Path, *extra: str) -> Any:
    return train_in_process(profile, family, f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}",
                            f"output_dir={out}", "report_to=none", "max_train_steps=4", "checkpointing_steps=100",
                            "learning_rate=1e-2", "data_config.train_batch_size=2", "compile=true", ONE_SHAPE, *extra)


@pytest.mark.e2e
def test_training_matches_diffusers_processor(tiny_qwen_image: Path, one_shape_data: Path,
                                              monkeypatch: pytest.MonkeyPatch, compile_op_by_op: None,
                                              tmp_path: Path) -> None:
    """Four fp32 steps of Qwen-Image with the project's processors, blocks compiled (where the real arithmetic
    runs; eagerly it is diffusers' complex product), against diffusers' processors run eagerly (the family's
    ``real_rope`` switched off: the reference): the same losses (relative 1e-6) and LoRA (1e-5); the same keys,
    which load in the pipeline; no file of the run names the processor. One batch shape: each block graph is
    traced once per gradient mode (the graphs of other shapes are the per-block tests' above)."""
    name, model = "qwen_image", tiny_qwen_image
    ours = train(name, "train_configs/quickstart_tiny.yaml", model, one_shape_data, tmp_path / "real")
    rope = ours.family.real_rope
    assert ours.compiled and processor_types(ours.transformer) == {rope.processor}
    monkeypatch.setattr(type(ours.family), "real_rope", None)
    theirs = train(name, "train_configs/quickstart_tiny.yaml", model, one_shape_data, tmp_path / "diffusers",
                   "compile=false")
    assert not theirs.compiled and processor_types(theirs.transformer) == {rope.replaces}
    got, want = read_losses(tmp_path / "real"), read_losses(tmp_path / "diffusers")
    assert len(got) == 4 and all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(got, want)), (got, want)
    lora, reference = (load_file(str(tmp_path / run / "pytorch_lora_weights.safetensors"))
                       for run in ("real", "diffusers"))
    assert lora.keys() == reference.keys()
    assert rel_err([lora[k] for k in sorted(lora)], [reference[k] for k in sorted(lora)]) <= TOLERANCE
    texts = [p.read_text(errors="ignore") for p in (tmp_path / "real").rglob("*") if p.suffix in (".json", ".yaml")]
    assert texts and not any("RealRope" in t or "real_rope" in t for t in texts)
    lora_keys_match(family_pipeline(name, model), tmp_path / "real", "trained")


@pytest.mark.e2e
def test_compiled_resume_is_bit_equal(tiny_qwen_image: Path, one_shape_data: Path, compile_op_by_op: None,
                                      tmp_path: Path) -> None:
    """Qwen-Image's resume, with the blocks compiled (where the real arithmetic runs): four steps straight against
    two and a resume to four, LoRA, EMA and losses bit for bit (the eager resume tests run diffusers' complex
    product, unchanged: tests/test_resilience.py, tests/test_qwen_image21_family.py). One batch shape and no caption
    dropout (an empty caption is another length): the blocks' two graphs serve every step of the three runs."""
    assert_resume_is_bit_equal("train_configs/quickstart_tiny.yaml", "qwen_image", tiny_qwen_image, one_shape_data,
                               tmp_path, "lora", "pytorch_lora_weights.safetensors", "compile=true",
                               ONE_SHAPE)


def test_every_complex_rope_family_has_real_rope() -> None:
    """The families whose diffusers 0.42.1 transformer module multiplies complex numbers are the ones with
    ``real_rope``; the others' (FLUX, FLUX.2, Krea 2: ``use_real=True``; Kandinsky 5: a real sum) have none."""
    import importlib
    import inspect

    from trainer.families import SPECS

    with_real_rope, complex_processors = set(), set()
    for spec in SPECS.values():
        cls = getattr(importlib.import_module(f"trainer.families.{spec.name}.family"), spec.runtime)
        if cls.real_rope is not None:
            with_real_rope.add(spec.name)
        if "view_as_complex" in inspect.getsource(inspect.getmodule(cls.transformer_class)):
            complex_processors.add(spec.name)
    assert with_real_rope == complex_processors == {"qwen_image", "qwen_image_edit", "qwen_image21", "z_image"}
