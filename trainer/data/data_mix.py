"""The run's datasets: each folder of ``datasets`` (or ``data_config``'s one folder) scanned with its own
settings, the batch sampler that draws from all of them, and what a run drew of each.

Batches never mix datasets (nor sizes): a batch belongs to one dataset, so the step applies that
dataset's caption settings and the per-dataset loss is the loss of its batches. Each dataset's
batches are drawn in proportion to ``images x repeats`` (every sample ``repeats`` times an epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

from loguru import logger

from image_datasets.buckets import at_resolutions, bucket_report
from image_datasets.checks import check_before_training
from image_datasets.dataset import (Sample, SizeGroupedBatchSampler, add_trigger_word, find_control_dirs,
                                    scan_image_folder)
from image_datasets.clips import ClipDrawing, scan_video_folder
from trainer.families.base import ModelFamily, as_reference_family
from trainer.config import EVAL_ROLE, REGULARIZATION, DatasetEntry, TrainConfig, dataset_entries, same_folder_warnings
from utils.errors import DataError


def scan_dataset(entry: DatasetEntry, family: ModelFamily) -> List[Sample]:
    """The training samples of one dataset: its images (after the dataset checks) and its clips (a bad clip
    named and left out), before any model loads."""
    samples = scan_images(entry, family) if entry.img_dir else []
    if entry.video_dir:
        clips, skipped = scan_video_folder(entry.video_dir, entry.caption_type, entry.img_size, family.pixel_multiple,
                                           clip_drawing(entry, family.frame_rate))
        for clip in skipped:
            logger.warning(f"{entry.name}: {clip}")
        samples += clips
    samples = at_resolutions(samples, entry.resolutions or [entry.img_size], family.pixel_multiple, entry.bucket_mode)
    logger.info(f"buckets of {entry.name} ({entry.bucket_mode}): {bucket_report(samples)}")
    return add_trigger_word(samples, entry.trigger_word)


def clip_drawing(entry: DatasetEntry, model_frame_rate: float) -> ClipDrawing:
    """How the entry's clips are drawn: its frames, its frame rate (else the model's), mode and clips per video."""
    return ClipDrawing(entry.num_frames or 1, entry.frame_rate or model_frame_rate or None, entry.clip_mode,
                       entry.clips_per_video)


def scan_images(entry: DatasetEntry, family: ModelFamily) -> List[Sample]:
    """The image samples of one folder, after the dataset checks."""
    control_dirs: List[Path] = []
    reference_size = None
    if family.uses_references:
        edit = as_reference_family(family)
        reference_size = edit.reference_size
        control_dirs = find_control_dirs(entry.img_dir, entry.control_dir, entry.control_dirs)
        if not control_dirs and not family.spec.references_optional:
            raise DataError(f"{family.name} trains on reference images: set data_config.control_dir (or "
                            f"control_dirs), or put them in a control/ folder beside {entry.img_dir}")
        edit.check_references(len(control_dirs))
        logger.info(f"reference folders: {', '.join(map(str, control_dirs)) or 'none (text-to-image)'}")
    skip = check_before_training(entry.img_dir, entry.caption_type, entry.img_size, family.pixel_multiple,
                                 control_dirs, skip_bad=entry.skip_bad_samples)
    return scan_image_folder(entry.img_dir, entry.caption_type, entry.img_size, family.pixel_multiple,
                             control_dirs, reference_size, exclude=skip)


@dataclass
class TrainingData:
    """Every dataset's samples in one list, and which dataset each sample comes from."""

    entries: List[DatasetEntry]
    samples: List[Sample]
    dataset_of: List[int]  # sample index -> index in ``entries``

    @classmethod
    def scan(cls, cfg: TrainConfig, family: ModelFamily) -> "TrainingData":
        """Scan every dataset of ``cfg``; a problem names the dataset it is in."""
        every = dataset_entries(cfg)
        for warning in same_folder_warnings(every):
            logger.warning(warning)
        entries = [e for e in every if e.role != EVAL_ROLE]  # held-out sets: trainer/evaluation/held_out.py
        samples: List[Sample] = []
        dataset_of: List[int] = []
        for index, entry in enumerate(entries):
            try:
                found = scan_dataset(entry, family)
            except DataError as exc:
                if not cfg.datasets:
                    raise
                raise DataError(f"datasets[{every.index(entry)}] ({entry.name}): {exc}") from None
            samples += found
            dataset_of += [index] * len(found)
        data = cls(entries, samples, dataset_of)
        where = entries[0].img_dir or entries[0].video_dir if len(entries) == 1 else f"{len(entries)} datasets"
        logger.info(f"{len(samples)} samples from {where}: " + ", ".join(
            f"{e.name} {data.count(i)} x{e.repeats}" + (" (regularization)" if e.role == REGULARIZATION else "")
            for i, e in enumerate(entries)))
        return data

    def count(self, dataset: int) -> int:
        """The samples of one dataset (images x resolutions)."""
        return self.dataset_of.count(dataset)

    def batch_sampler(self, batch_size: int, seed: int) -> SizeGroupedBatchSampler:
        """Batches of one dataset and one size each, every sample ``repeats`` times an epoch."""
        groups = [(d, s.group) for d, s in zip(self.dataset_of, self.samples)]
        repeats = [self.entries[d].repeats for d in self.dataset_of]
        return SizeGroupedBatchSampler(groups, batch_size, shuffle=True, seed=seed, repeats=repeats)

    def random_crops(self) -> List[bool]:
        """Per sample: whether its crop window is placed at random (its dataset's ``random_crop``)."""
        return [self.entries[d].random_crop for d in self.dataset_of]

    def dataset(self, batch: Dict[str, Any]) -> int:
        """The dataset of a batch (all its samples share one)."""
        return self.dataset_of[batch["index"][0]]

    def entry(self, batch: Dict[str, Any]) -> DatasetEntry:
        """The settings of a batch's dataset (caption dropout, tag shuffling, trigger word)."""
        return self.entries[self.dataset(batch)]

    def trigger_word(self) -> str:
        """The first train dataset's trigger word ("[trigger]" in validation prompts)."""
        return next((e.trigger_word for e in self.entries if e.role == "train" and e.trigger_word), "")

    def samples_seen(self, sampler: SizeGroupedBatchSampler, state: Any, processes: int) -> Dict[str, int]:
        """Samples drawn per dataset name so far: what the run had drawn where its sampler started
        (``state.seen_before``, from a checkpoint: the datasets may have changed since) plus what this
        sampler drew from there (``state.since``) to where the loop stands."""
        now = sampler.drawn(state.epoch, state.micro_batches_done, processes)
        start = sampler.drawn(*state.since, processes)
        seen = dict(state.seen_before) if state.seen_before is not None else {}
        if state.seen_before is None:  # an older checkpoint: as if this sampler had drawn from step 0
            start = [0] * len(now)
        for index, entry in enumerate(self.entries):
            drawn = sum(now[i] - start[i] for i, d in enumerate(self.dataset_of) if d == index)
            seen[entry.name] = seen.get(entry.name, 0) + drawn
        return seen

    def summary(self, sampler: SizeGroupedBatchSampler, state: Any, processes: int) -> List[Dict[str, Any]]:
        """``summary.json``'s ``datasets``: each folder, its role, images, repeats and the samples the
        run drew from it (``samples_seen``); a dataset the run drew from before a resume dropped it is
        listed with its count alone."""
        seen = self.samples_seen(sampler, state, processes)
        out = []
        for index, entry in enumerate(self.entries):
            mine = [i for i, d in enumerate(self.dataset_of) if d == index]
            out.append({"name": entry.name, "path": entry.img_dir or entry.video_dir, "role": entry.role,
                        "images": len({self.samples[i].image_path for i in mine}), "repeats": entry.repeats,
                        "samples_seen": seen.pop(entry.name)})
        return out + [{"name": name, "samples_seen": count, "removed": True} for name, count in seen.items()]
