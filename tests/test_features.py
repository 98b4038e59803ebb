"""The embedding cache (``trainer.data.features``) on the real tiny models: keys, the one cache pass for text
and latents, and what the dataset serves from it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from conftest import ROOT
from image_datasets.dataset import ImageCaptionDataset, collate, load_image, scan_image_folder
from trainer.config import load_config
from trainer.families.base import load_family
from trainer.data import features
from trainer.data.features import FeatureStore

CONFIGS = {"qwen_image": "train_configs/quickstart_tiny.yaml",
           "qwen_image_edit": "train_configs/quickstart_edit_tiny.yaml"}


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    AcceleratorState._reset_state(reset_partial_state=True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def make_store(family: str, model: Path, data: Path, accelerator: Accelerator, out: Path, *extra: str,
               dtype: torch.dtype = torch.float32) -> FeatureStore:
    """The store of a run on ``data`` (cache under ``out`` unless the overrides say otherwise)."""
    overrides = [f"pretrained_model_name_or_path={model}", f"data_config.img_dir={data}", f"output_dir={out}", *extra]
    cfg = load_config(ROOT / CONFIGS[family], overrides, default_family=family)
    fam = load_family(cfg)
    controls = [data.parent / "control"] if fam.uses_references else []
    samples = scan_image_folder(data, "txt", 64, fam.pixel_multiple, controls,
                                fam.reference_size if fam.uses_references else None)
    return FeatureStore(cfg, fam, samples, accelerator, dtype, keep_encoders=False)


def count_encodings(store: FeatureStore, monkeypatch: pytest.MonkeyPatch) -> Dict[str, List]:
    """Record what the store's family is asked to encode (the real encoders still run)."""
    calls: Dict[str, List] = {"text": [], "images": []}
    family = store.family
    prompts, images = family.encode_prompts, family.encode_images
    monkeypatch.setattr(family, "encode_prompts", lambda p, *a: calls["text"].extend(p) or prompts(p, *a))
    monkeypatch.setattr(family, "encode_images", lambda x: calls["images"].append(tuple(x.shape)) or images(x))
    return calls


def test_keys_change_with_everything_that_made_the_entry(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                         accelerator: Accelerator) -> None:
    data = tmp_path / "data"
    shutil.copytree(sample_data, data)

    def keys(*extra: str, model: Path = tiny_qwen_image, dtype: torch.dtype = torch.float32) -> tuple:
        store = make_store("qwen_image", model, data, accelerator, tmp_path, *extra, dtype=dtype)
        sample = store.samples[0]
        return store.text_key(sample.caption), store.image_key(sample.image_path, sample.size)

    store = make_store("qwen_image", tiny_qwen_image, data, accelerator, tmp_path)
    sample = store.samples[0]
    text, image = keys()
    assert (text, image) == keys() and len({text, image, store.text_key(""), store.text_key(sample.caption + ".")}) == 4
    assert store.image_key(sample.image_path, (32, 64)) != image, "the encoded size"
    assert set(keys("revision=abc")).isdisjoint({text, image}), "the model revision"
    assert set(keys(dtype=torch.bfloat16)).isdisjoint({text, image}), "the encoders' dtype"
    other_model = tmp_path / "model-copy"
    shutil.copytree(tiny_qwen_image, other_model)
    assert set(keys(model=other_model)).isdisjoint({text, image}), "the model"
    sample.image_path.write_bytes(sample.image_path.read_bytes() + b"\0")  # the same picture, other bytes
    assert keys() == (text, keys()[1]) and keys()[1] != image, "the image file's bytes"


def test_one_pass_fills_both_kinds_and_encodes_only_what_is_missing(
        tiny_qwen_image: Path, sample_data: Path, tmp_path: Path, accelerator: Accelerator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = f"cache_dir={tmp_path / 'cache'}"
    store = make_store("qwen_image", tiny_qwen_image, sample_data, accelerator, tmp_path, cache)
    calls = count_encodings(store, monkeypatch)
    store.cache_pass()
    captions = [s.caption for s in store.samples]
    assert sorted(calls["text"]) == sorted(captions + [""]), "each caption once, and the empty prompt"
    assert calls["images"] == [(1, 3, s.size[1], s.size[0]) for s in store.samples], "one image per VAE call"
    assert store.family.text_pipe is None and store.family.vae is None, "both encoders released"
    # Remove one entry of each kind: a new pass over the same folder encodes exactly those two.
    for key in (store.text_key(captions[2]), store.image_key(store.samples[4].image_path, store.samples[4].size)):
        next((tmp_path / "cache").rglob(f"{key}.safetensors")).unlink()
    again = make_store("qwen_image", tiny_qwen_image, sample_data, accelerator, tmp_path, cache)
    calls = count_encodings(again, monkeypatch)
    again.cache_pass()
    assert calls == {"text": [captions[2]], "images": [(1, 3, 64, 64)]}


def test_the_dataset_serves_the_cached_tensors(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                               accelerator: Accelerator) -> None:
    store = make_store("qwen_image", tiny_qwen_image, sample_data, accelerator, tmp_path, "save_cache_on_disk=false",
                       "data_config.caption_dropout_rate=0.5")
    store.cache_pass()
    dataset = ImageCaptionDataset(store.samples, store.reader())
    item = dataset[0]
    assert set(item) == {"index", "caption", "latents", "references", "text"}, "no pixels; one shared empty prompt"
    store.family.load_vae(torch.device("cpu"), torch.float32)
    assert torch.equal(item["latents"], store.family.encode_images(load_image(store.samples[0])[None])[0])
    assert torch.equal(item["text"]["prompt_embeds"], store.cached_text(store.samples[0].caption)["prompt_embeds"])
    # Through the loader's workers and collate: one batch of the two square images with the same size.
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=[[0, 2]], collate_fn=collate, num_workers=1)
    batch = next(iter(loader))
    assert batch["index"] == [0, 2] and batch["latents"].shape == (2, *item["latents"].shape)
    assert torch.equal(batch["latents"][0], item["latents"]) and batch["references"] == []
    text = store.batch_text(batch, batch["caption"], drop=[True, False])
    empty, caption = store.empty_text["prompt_embeds"], store.cached_text(store.samples[2].caption)["prompt_embeds"]
    assert torch.equal(text["prompt_embeds"][0, : len(empty)], empty), "the dropped caption is the empty prompt"
    assert torch.equal(text["prompt_embeds"][1, : len(caption)], caption)


def test_edit_samples_bring_references_and_their_own_dropout_prompt(
        tiny_qwen_image_edit: Path, edit_data: Path, tmp_path: Path, accelerator: Accelerator) -> None:
    store = make_store("qwen_image_edit", tiny_qwen_image_edit, edit_data, accelerator, tmp_path,
                       "save_cache_on_disk=false",
                       "data_config.caption_dropout_rate=0.3")
    store.cache_pass()
    item = ImageCaptionDataset(store.samples, store.reader())[1]
    sample = store.samples[1]
    assert len(item["references"]) == 1 and item["references"][0].shape[-2:] == (
        sample.reference_sizes[0][1] * 2 // store.family.pixel_multiple,
        sample.reference_sizes[0][0] * 2 // store.family.pixel_multiple)
    expected = store.text.get(store.text_key("", sample.references))["prompt_embeds"]
    assert torch.equal(item["text_drop"]["prompt_embeds"], expected), "the empty prompt with this sample's reference"
    assert not torch.equal(item["text_drop"]["prompt_embeds"],
                           ImageCaptionDataset(store.samples, store.reader())[0]["text_drop"]["prompt_embeds"])


def test_live_encoding_serves_pixels(tiny_qwen_image_edit: Path, edit_data: Path, tmp_path: Path,
                                    accelerator: Accelerator) -> None:
    store = make_store("qwen_image_edit", tiny_qwen_image_edit, edit_data, accelerator, tmp_path,
                       "precompute_text_embeddings=false", "precompute_image_embeddings=false")
    store.cache_pass()
    assert not list(tmp_path.rglob("*.safetensors")), "nothing cached"
    item = ImageCaptionDataset(store.samples, store.reader(), load_pixels=True)[0]
    assert set(item) == {"index", "caption", "pixels", "reference_pixels"}
    sample = store.samples[0]
    assert item["pixels"].shape == (3, sample.size[1], sample.size[0])
    assert [p.shape[1:] for p in item["reference_pixels"]] == [(h, w) for w, h in sample.reference_sizes]
    store.family.load_vae(torch.device("cpu"), torch.float32)
    refs = store.batch_references(collate([item]))
    assert len(refs) == 1 and torch.equal(refs[0], store.family.encode_images(item["reference_pixels"][0][None]))


def test_a_small_disk_cache_is_read_once_and_held(tiny_qwen_image: Path, sample_data: Path, tmp_path: Path,
                                                  accelerator: Accelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``HOLD_BYTES`` the run's entries are read when the loader is built, so no step reads a
    file; above it every sample is read from disk when it is served."""
    cache = tmp_path / "cache"
    store = make_store("qwen_image", tiny_qwen_image, sample_data, accelerator, tmp_path, f"cache_dir={cache}")
    store.cache_pass()
    before = ImageCaptionDataset(store.samples, store.reader())[3]
    monkeypatch.setattr(features, "HOLD_BYTES", 0)
    unheld = ImageCaptionDataset(store.samples, make_store(
        "qwen_image", tiny_qwen_image, sample_data, accelerator, tmp_path, f"cache_dir={cache}").reader())
    held = ImageCaptionDataset(store.samples, store.reader())  # the first store holds its entries
    shutil.rmtree(cache)
    after = held[3]
    assert torch.equal(after["latents"], before["latents"]) and torch.equal(
        after["text"]["prompt_embeds"], before["text"]["prompt_embeds"])
    with pytest.raises(FileNotFoundError):
        unheld[3]
