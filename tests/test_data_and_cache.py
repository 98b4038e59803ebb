"""Dataset scanning, resizing, size-grouped batches and the content-addressed cache."""

from pathlib import Path

import pytest
import torch
from PIL import Image

from image_datasets.cache import FeatureCache, cache_key
from image_datasets.dataset import SizeGroupedBatchSampler, load_image, scan_image_folder, target_size
from image_datasets.sample_data import make_sample_dataset
from utils.errors import DataError


def test_target_size_keeps_aspect_and_grid() -> None:
    assert target_size(2000, 1000, 1024, 16) == (1024, 512)
    assert target_size(1000, 1000, 1024, 16) == (1024, 1024)
    w, h = target_size(1920, 1080, 1024, 16)
    assert (w, h) == (1024, 576) and w % 16 == 0 and h % 16 == 0
    assert target_size(10, 1000, 64, 16) == (16, 64)  # never below one grid cell


def test_sample_dataset_scans_all_formats(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path, size=64, count=6)
    samples = scan_image_folder(tmp_path, "txt", 64, 16)
    assert [s.key for s in samples] == [f"img{i}" for i in range(1, 7)]
    assert {s.image_path.suffix for s in samples} == {".png", ".jpg", ".webp"}
    assert samples[1].size == (64, 32)  # the landscape one: longest side 64
    assert samples[0].caption.startswith("a red circle")
    pixels = load_image(samples[1])
    assert pixels.shape == (3, 32, 64) and -1 <= pixels.min() < pixels.max() <= 1


def test_every_data_problem_is_named(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path, count=3)
    (tmp_path / "img2.txt").unlink()
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "broken.txt").write_text("x")
    with pytest.raises(DataError) as err:
        scan_image_folder(tmp_path, "txt", 64, 16)
    msg = str(err.value)
    assert "2 problem(s)" in msg and "img2.jpg: caption file img2.txt is missing" in msg
    assert "broken.png: cannot read the image" in msg


def test_empty_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no images found"):
        scan_image_folder(tmp_path, "txt", 64, 16)


def test_batches_share_a_size_and_cover_each_sample_once() -> None:
    sizes = [(64, 64)] * 5 + [(64, 32)] * 3
    sampler = SizeGroupedBatchSampler(sizes, batch_size=2, seed=1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == 5
        assert sorted(i for b in batches for i in b) == list(range(8))
        assert all(len({sizes[i] for i in b}) == 1 for b in batches)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first  # a new order each epoch


def test_cache_key_depends_on_every_part() -> None:
    k = cache_key("qwen_image", "model", "text", "a cat")
    assert k == cache_key("qwen_image", "model", "text", "a cat")
    assert k != cache_key("qwen_image", "model", "text", "a cat ")
    assert k != cache_key("qwen_image", "model2", "text", "a cat")
    assert cache_key("ab", "c") != cache_key("a", "bc")


@pytest.mark.parametrize("on_disk", [False, True])
def test_feature_cache_round_trip(tmp_path: Path, on_disk: bool) -> None:
    cache = FeatureCache("text", tmp_path if on_disk else None)
    key = cache_key("x")
    assert key not in cache
    value = {"prompt_embeds": torch.randn(5, 8, dtype=torch.bfloat16)}
    cache.put(key, value)
    assert key in cache
    got = cache.get(key)
    assert got["prompt_embeds"].dtype == torch.bfloat16 and torch.equal(got["prompt_embeds"], value["prompt_embeds"])
    if on_disk:
        assert FeatureCache("text", tmp_path).get(key)["prompt_embeds"].shape == (5, 8)  # survives a new run
        assert not list((tmp_path / "text").rglob("*.tmp"))


def test_changed_image_gets_a_new_content_hash(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path, count=1)
    sample = scan_image_folder(tmp_path, "txt", 64, 16)[0]
    before = sample.content_hash()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(sample.image_path)
    assert sample.content_hash() != before


def test_aspect_buckets_keep_the_area_and_the_grid() -> None:
    from image_datasets.buckets import aspect_buckets, nearest_bucket

    buckets = aspect_buckets(1024, 16)
    assert (1024, 1024) in buckets
    for w, h in buckets:
        assert w % 16 == 0 and h % 16 == 0 and w * h <= 1024 * 1024 and max(w / h, h / w) <= 4
        if max(w / h, h / w) <= 2:
            assert w * h >= 0.95 * 1024 * 1024, (w, h)
    wide = nearest_bucket(1920, 1080, buckets)
    assert 1.7 < wide[0] / wide[1] < 1.85 and nearest_bucket(1080, 1920, buckets) == wide[::-1]


def test_multi_resolution_expands_each_sample(tmp_path: Path) -> None:
    from image_datasets.buckets import at_resolutions, bucket_report

    make_sample_dataset(tmp_path, count=3)
    samples = scan_image_folder(tmp_path, "txt", 64, 16)
    multi = at_resolutions(samples, [32, 64], 16, "area")
    assert len(multi) == 6 and {s.key for s in multi} == {f"img{i}@{r}" for i in (1, 2, 3) for r in (32, 64)}
    assert {s.size for s in multi if s.key.endswith("@64") and s.key != "img2@64"} == {(64, 64)}
    assert "64x64: 2" in bucket_report(multi)
    assert at_resolutions(samples, [64], 16, "longest_side") == samples, "the default changes nothing"


def test_random_crop_moves_the_window(tmp_path: Path) -> None:
    make_sample_dataset(tmp_path, count=2)
    wide = scan_image_folder(tmp_path, "txt", 32, 16)[1]  # 96x64 source, trained at 32x16 after resize
    square = type(wide)(wide.key, wide.image_path, wide.caption, (32, 32))
    crops = {load_image(square, random_crop=True).sum().item() for _ in range(8)}
    assert len(crops) > 1 and load_image(square).shape == (3, 32, 32)
