"""``python -m trainer.judge RUN_DIR [--json] [--holdout DIR]``: which checkpoint of a run to keep.

Prints a table of the run's checkpoints (step, smoothed training loss, held-out loss, image metrics
when the run logged them) from its ``metrics.jsonl``, and names the checkpoint with the lowest
held-out loss. With ``--holdout DIR`` it evaluates every checkpoint on the images (and captions) in
DIR itself, with the run's own evaluation code (trainer/evaluation/held_out.py): for a finished run that had
no evaluation section, or to judge on other images.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from utils.errors import UserError

IMAGE_METRIC_PREFIX = "eval/"  # DINOv2 / CLIP scores of the validation samples (trainer/evaluation/image_metrics.py)


def checkpoint_steps(run_dir: Path) -> List[int]:
    """The steps of the run's complete checkpoints, oldest first."""
    from trainer.run_folder.checkpoint import list_checkpoints

    return [int(p.name.split("-", 1)[1]) for p in list_checkpoints(run_dir)]


def read_records(run_dir: Path) -> List[Dict[str, Any]]:
    """``metrics.jsonl``'s records (a torn line skipped)."""
    path, records = run_dir / "metrics.jsonl", []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def metrics_problem(run_dir: Path, records: Sequence[Dict[str, Any]]) -> Optional[str]:
    """What is wrong with a ``metrics.jsonl`` that has lines but not one record (garbage, another
    file), or None: the verdict names it instead of advising an evaluation section the run had."""
    path = run_dir / "metrics.jsonl"
    if records or not path.is_file() or not path.read_text(errors="replace").strip():
        return None
    return f"{path} holds no metrics record (no line is a JSON object with a step): it is damaged or not a metrics file"


def read_summary(run_dir: Path, records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The run's ``summary.json``, or {} (said in one line) when there is none, it is cut short or not an
    object, or it is another run's: its best held-out loss is not the one ``metrics.jsonl`` logged at
    that step (a folder started over by a version that left the old summary). Only its over-fitting
    step is read."""
    from loguru import logger

    path = run_dir / "summary.json"
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as exc:
        why = f"is cut short or unreadable ({str(exc).splitlines()[0][:120]})"
    else:
        if not isinstance(summary, dict):
            why = f"holds a JSON {type(summary).__name__}, not an object"
        elif not _matches(summary, records):
            why = "does not match metrics.jsonl (a previous run's)"
        else:
            return summary
    logger.warning(f"{path} {why}: the run's over-fitting step, if any, is not reported")
    return {}


def _matches(summary: Dict[str, Any], records: Sequence[Dict[str, Any]]) -> bool:
    """The summary's best held-out loss is the one logged at its step (or that step was not logged)."""
    evaluation = summary.get("evaluation")
    if not isinstance(evaluation, dict):
        return True
    logged = [r["eval_loss"] for r in records if r["step"] == evaluation.get("best_step") and "eval_loss" in r]
    return not logged or logged[-1] == evaluation.get("best_eval_loss")


def table(run_dir: Path, records: Sequence[Dict[str, Any]], steps: Sequence[int],
          evaluated: Optional[Dict[int, Dict[str, float]]] = None) -> List[Dict[str, Any]]:
    """One row per checkpoint step: its smoothed training loss (the tensorboard smoothing of every
    logged step up to it), its held-out loss (``evaluated``, else the run's own) and image metrics."""
    from trainer.reporting.summary import smoothed

    losses = [(r["step"], float(r["loss"])) for r in records if isinstance(r.get("loss"), (int, float))]
    curve = dict(zip([s for s, _ in losses], smoothed([v for _, v in losses])))
    logged: Dict[int, Dict[str, float]] = {}
    for r in records:
        fields = {k: v for k, v in r.items() if (k.startswith("eval_loss") or k.startswith(IMAGE_METRIC_PREFIX))
                  and isinstance(v, (int, float))}
        if fields:
            logged.setdefault(r["step"], {}).update(fields)
    rows = []
    for step in steps:
        upto = [s for s in curve if s <= step]
        row: Dict[str, Any] = {"step": step, "checkpoint": f"checkpoint-{step}",
                               "train_loss_smoothed": curve[max(upto)] if upto else None}
        row.update(logged.get(step, {}))
        if evaluated is not None:
            row.update(evaluated.get(step, {}))
        rows.append(row)
    return rows


def verdict(rows: Sequence[Dict[str, Any]], summary: Dict[str, Any], problem: Optional[str] = None) -> Dict[str, Any]:
    """The checkpoint to keep (lowest held-out loss) and why (``problem``: what is wrong with the metrics)."""
    scored = [r for r in rows if isinstance(r.get("eval_loss"), (int, float)) and math.isfinite(r["eval_loss"])]
    evaluation = summary.get("evaluation")
    overfit = evaluation.get("overfitting_detected_at") if isinstance(evaluation, dict) else None
    if not scored:
        why = problem or "train with an evaluation section (evaluation.holdout: N)"
        return {"keep": None, "reason": f"no checkpoint has a held-out loss: {why}; or give --holdout DIR"}
    best = min(scored, key=lambda r: r["eval_loss"])
    latest = rows[-1]
    reason = f"lowest held-out loss {best['eval_loss']:.6f} of {len(scored)} checkpoint(s)"
    if best is not latest and isinstance(latest.get("eval_loss"), (int, float)):
        reason += f" (the last, {latest['checkpoint']}, has {latest['eval_loss']:.6f})"
    if overfit is not None:
        reason += f"; the run detected over-fitting at step {overfit}"
    return {"keep": best["checkpoint"], "step": best["step"], "eval_loss": best["eval_loss"], "reason": reason,
            "overfitting_detected_at": overfit}


def evaluate_checkpoints(run_dir: Path, holdout: Path, steps: Sequence[int]) -> Dict[int, Dict[str, float]]:
    """The held-out loss of each checkpoint on the images of ``holdout``, computed as a run computes it
    (the run's config, levels and seed; one process)."""
    from trainer.assembly import autocast_for, build_accelerator, build_model, cached_dataset, compute_dtype, \
        load_live_encoders
    from trainer.config import dataset_entries, load_config
    from trainer.data.data_mix import TrainingData, scan_dataset
    from trainer.evaluation.held_out import Evaluator, default_levels, split_held_out
    from trainer.families.base import load_family
    from trainer.data.features import FeatureStore
    from trainer.precision import choose_mixed_precision

    if not holdout.is_dir():
        raise UserError(f"--holdout: folder '{holdout}' does not exist (a folder of images with captions)")
    cfg = load_config(run_dir / "config.yaml", [f"output_dir={run_dir}"])
    accelerator = build_accelerator(cfg, choose_mixed_precision(cfg.mixed_precision))
    device, dtype = accelerator.device, compute_dtype(accelerator.mixed_precision)
    family = load_family(cfg)
    # The first train dataset's settings (size, buckets, captions); references beside DIR (Edit).
    first = next(e for e in dataset_entries(cfg) if e.role == "train")
    entry = dataclasses.replace(first, img_dir=str(holdout), name="holdout", role="eval", control_dir=None,
                                control_dirs=None, repeats=1)
    samples = scan_dataset(entry, family)
    data = TrainingData.scan(cfg, family)  # the noise levels follow the run's training sizes,
    split_held_out(cfg, family, data)  # without its own held-out images, as in the run
    training = data.samples
    features = FeatureStore(cfg, family, samples, accelerator, dtype, keep_encoders=False)
    features.cache_pass()
    load_live_encoders(cfg, family, device, dtype)
    dataset = cached_dataset(cfg, features.reader(), samples)
    evaluator = Evaluator(cfg, family, features, dataset, 0, samples, default_levels(cfg, family, training))
    model = build_model(cfg, family, device, dtype)  # as the run built it: adapters, placement, block swap
    checkpoints = checkpoint_reader(model.weights, model.transformer)
    autocast = autocast_for(accelerator)
    results = {}
    for step in steps:
        if not load_checkpoint(checkpoints, run_dir / f"checkpoint-{step}"):
            continue
        result = evaluator.evaluate(model.transformer, dtype, autocast, after_forward=model.ready.swapper.release_all)
        results[step] = {k: v for k, v in result.fields().items() if k != "eval_seconds"}
        print(f"checkpoint-{step}: held-out loss {result.loss:.6f} ({result.seconds:.1f} s)", file=sys.stderr)
    return results


def checkpoint_reader(weights: Any, model: Any) -> Any:
    """A ``Checkpointer`` with the run's weights part (as the engine registers it) reading into ``model``."""
    from trainer.run_folder.checkpointer import Checkpointer, weights_part

    reader = Checkpointer(lambda: None)  # resumes nothing: it reads checkpoints' weights
    reader.attach(None, [weights_part(weights, lambda: model)])
    return reader


def load_checkpoint(checkpoints: Any, folder: Path) -> bool:
    """Load ``folder``'s trained weights through ``checkpoints`` (``checkpoint_reader``); False (said) when the
    run pruned it meanwhile (checkpoints_total_limit: a run in progress deletes old ones while the judge loads
    the model)."""
    try:
        checkpoints.read_files(folder)
    except OSError as exc:
        if folder.is_dir():
            raise UserError(f"{folder}: cannot read its weights ({exc})") from None
        print(f"{folder.name}: skipped, removed while the judge ran (the run prunes old checkpoints: "
              "checkpoints_total_limit)", file=sys.stderr)
        return False
    return True


def judge(run_dir: Path, holdout: Optional[Path] = None) -> Dict[str, Any]:
    """The table and the verdict of ``run_dir`` (evaluating on ``holdout`` when given)."""
    if not run_dir.is_dir():
        raise UserError(f"RUN_DIR '{run_dir}' is not a folder (a run's output_dir)")
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise UserError(f"{run_dir}: no complete checkpoint-N folder to judge (is it a run's output_dir?)")
    evaluated = None
    if holdout is not None:
        evaluated = evaluate_checkpoints(run_dir, holdout, steps)
        steps = [step for step in steps if step in evaluated]  # (not those pruned meanwhile)
        if not steps:
            raise UserError(f"{run_dir}: every checkpoint was removed while the judge ran (the run prunes them: "
                            "checkpoints_total_limit); run the judge again, or once the run has ended")
    records = read_records(run_dir)
    rows = table(run_dir, records, steps, evaluated)
    return {"run": str(run_dir), "holdout": str(holdout) if holdout else None, "checkpoints": rows,
            **verdict(rows, read_summary(run_dir, records), metrics_problem(run_dir, records))}


def format_table(result: Dict[str, Any]) -> str:
    """The verdict as a text table, the kept checkpoint marked."""
    rows = result["checkpoints"]
    extra = sorted({k for r in rows for k in r if k.startswith(IMAGE_METRIC_PREFIX)})
    head = ["checkpoint", "step", "train loss (smoothed)", "held-out loss", *extra]
    fmt = lambda v: "-" if v is None else (f"{v:.6f}" if isinstance(v, float) else str(v))  # noqa: E731
    body = [[r["checkpoint"], r["step"], r.get("train_loss_smoothed"), r.get("eval_loss"), *[r.get(k) for k in extra]]
            for r in rows]
    cells = [head] + [[fmt(v) for v in line] for line in body]
    widths = [max(len(line[i]) for line in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    for i, r in enumerate(rows, start=1):
        if r["checkpoint"] == result.get("keep"):
            lines[i] += "   <- keep"
    keep = result.get("keep")
    lines.append("")
    lines.append(f"keep {Path(result['run']) / keep}: {result['reason']}" if keep else result["reason"])
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.judge", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run's output_dir")
    parser.add_argument("--json", action="store_true", help="print the table and verdict as JSON")
    parser.add_argument("--holdout", type=Path, metavar="DIR",
                        help="evaluate every checkpoint on the images and captions in DIR")
    args = parser.parse_args(argv)
    from loguru import logger

    logger.remove()  # the table is the output; the loading steps' lines only when something is wrong
    logger.add(sys.stderr, level="WARNING", format="{level}: {message}")
    try:
        result = judge(args.run_dir, args.holdout)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
