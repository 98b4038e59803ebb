"""The config schema: shipped YAMLs load, overrides apply, mistakes name the key and value."""

import copy
import dataclasses
import itertools
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trainer.config import (FLYMYAI_KEYS, QUANTO_WEIGHTS, TORCHAO_WEIGHTS, TrainConfig, config_to_yaml, flymyai_compat,
                            load_config)
from utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "train_configs").glob("*.yaml"))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


def base(data_dir: Path) -> list:
    return [f"data_config.img_dir={data_dir}", "pretrained_model_name_or_path=Qwen/Qwen-Image"]


ENTRY_FAMILIES = {"train.py": "qwen_image", "train_4090.py": "qwen_image", "train_full_qwen_image.py": "qwen_image",
                  "train_flux_lora.py": "flux", "train_flux2_lora.py": "flux2",
                  "train_qwen_edit_lora.py": "qwen_image_edit", "train_krea2_lora.py": "krea2",
                  "train_qwen_image21_lora.py": "qwen_image21", "train_wan_lora.py": "wan"}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_yaml_fits_the_schema(path: Path, data_dir: Path) -> None:
    command = path.read_text().splitlines()[1]
    assert path.read_text().startswith("#") and f"--config train_configs/{path.name}" in command, \
        "each YAML opens with a comment giving the command that runs it"
    script = next(word for word in command.split() if word.endswith(".py"))
    assert (ROOT / script).is_file(), f"{path.name} names {script}, which does not exist"
    # The data folders of a shipped profile are the user's; point them at an existing one to validate.
    raw = OmegaConf.load(path)
    folders = [f"data_config.img_dir={data_dir}"] + \
        ([f"data_config.control_dir={data_dir}"] if raw.data_config.get("control_dir") else []) + \
        ([f"data_config.video_dir={data_dir}"] if raw.data_config.get("video_dir") else [])
    if raw.get("datasets"):  # several datasets: each entry's folder
        folders = [f"datasets.{i}.img_dir={data_dir}" for i in range(len(raw.datasets))]
    cfg = load_config(path, folders, default_family=ENTRY_FAMILIES[script])
    assert cfg.family == raw.get("family", ENTRY_FAMILIES[script]), "the YAML's family key wins over the script's"
    assert cfg.max_train_steps >= 1


COMMENTED_VALIDATION = [p for p in SHIPPED if "\n# validation:\n" in p.read_text()]


@pytest.mark.parametrize("path", COMMENTED_VALIDATION, ids=[p.name for p in COMMENTED_VALIDATION])
def test_commented_validation_examples_fit_the_schema(path: Path, data_dir: Path, tmp_path: Path) -> None:
    """The commented-out `validation:` block a YAML shows is valid once uncommented."""
    lines = path.read_text().splitlines()
    start = lines.index("# validation:")
    block = [lines[start], *itertools.takewhile(lambda line: line.startswith("#   "), lines[start + 1:])]
    rest = lines[start + len(block):]
    uncommented = tmp_path / path.name
    uncommented.write_text("\n".join(lines[:start] + [line[2:] for line in block] + rest) + "\n")
    script = next(word for word in lines[1].split() if word.endswith(".py"))
    videos = [f"data_config.video_dir={data_dir}"] if OmegaConf.load(path).data_config.get("video_dir") else []
    cfg = load_config(uncommented, [f"data_config.img_dir={data_dir}", *videos], default_family=ENTRY_FAMILIES[script])
    assert cfg.validation.every_n_steps > 0 and cfg.validation.prompts


def test_flymyai_yaml_runs_unchanged(tmp_path: Path, data_dir: Path) -> None:
    """A YAML as FlyMyAI users have it (keys, 1e-4 floats, null report_to, duplicated batch size)."""
    yaml = tmp_path / "flymyai.yaml"
    yaml.write_text(f"""pretrained_model_name_or_path: Qwen/Qwen-Image
data_config:
  train_batch_size: 1
  num_workers: 4
  img_size: 1024
  caption_dropout_rate: 0.1
  img_dir: {data_dir}
  random_ratio: false
  caption_type: txt
report_to: null
train_batch_size: 1
output_dir: ./output
max_train_steps: 3000
learning_rate: 1e-4
lr_scheduler: constant
lr_warmup_steps: 10
adam_beta1: 0.9
adam_beta2: 0.999
adam_weight_decay: 0.01
adam_epsilon: 1e-8
max_grad_norm: 1.0
logging_dir: logs
mixed_precision: "bf16"
checkpointing_steps: 250
checkpoints_total_limit: 10
tracker_project_name: lora_test
resume_from_checkpoint: latest
gradient_accumulation_steps: 1
rank: 16
precompute_text_embeddings: true
precompute_image_embeddings: true
quantize: false
adam8bit: true
save_cache_on_disk: true
use_fastsafetensors: true
fastsafetensors_num_threads: 8
unified_memory: false
disable_cpu_offload: false
disable_quantization: false
disable_gradient_checkpointing: false
cuda_features:
  enable_flash_attention_3: false
  enable_fp8_training: false
  enable_tf32_compute: true
  enable_cudnn_sdp: true
""")
    cfg = load_config(yaml, default_family="qwen_image")
    assert cfg.learning_rate == pytest.approx(1e-4)
    assert cfg.adam_epsilon == pytest.approx(1e-8)
    assert cfg.mixed_precision == "bf16"
    assert cfg.optimizer == "adamw8bit"
    assert cfg.data_config.train_batch_size == 1 and cfg.rank == 16 and cfg.report_to is None


def test_overrides_apply_with_types(data_dir: Path) -> None:
    cfg = load_config(None, base(data_dir) + ["learning_rate=3e-4", "rank=4", "data_config.img_size=512",
                                              "lora_target_modules=[to_q,to_k]"])
    assert (cfg.learning_rate, cfg.rank, cfg.data_config.img_size) == (pytest.approx(3e-4), 4, 512)
    assert cfg.lora_target_modules == ["to_q", "to_k"]


def test_loads_share_one_schema_config_and_never_change_it(data_dir: Path) -> None:
    """The schema config built once per dataclass (``merged_with_schema``) is merged *into*, never changed: after
    loads that override nested keys and lists, and after a mistake, it equals a fresh ``OmegaConf.structured``,
    and the next load sees the defaults again."""
    from trainer.config.loading import _structured_once

    fresh = OmegaConf.to_container(OmegaConf.structured(TrainConfig))
    load_config(None, base(data_dir) + ["rank=4", "data_config.img_size=512", "lora_target_modules=[to_q]",
                                        "validation.prompts=[a cat]"])
    with pytest.raises(ConfigError):
        load_config(None, base(data_dir) + ["rank=zero"])
    assert OmegaConf.to_container(_structured_once(TrainConfig)) == fresh
    cfg = load_config(None, base(data_dir))
    assert (cfg.rank, cfg.data_config.img_size, cfg.lora_target_modules) == \
        (TrainConfig.rank, fresh["data_config"]["img_size"], fresh["lora_target_modules"])


def test_unknown_key_names_it_and_the_closest(data_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + ["learning_rat=1e-4", "data_config.img_siz=512"])
    msg = str(err.value)
    assert "unknown key 'learning_rat' (did you mean 'learning_rate'?)" in msg
    assert "unknown key 'data_config.img_siz' (did you mean 'data_config.img_size'?)" in msg


def test_wrong_type_names_key_and_value(data_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"key 'rank': value 'sixteen' is not a valid integer"):
        load_config(None, base(data_dir) + ["rank=sixteen"])


@pytest.mark.parametrize("override, expected", [
    ("learning_rate=-1", "key 'learning_rate': value -1.0 must be > 0"),
    ("rank=0", "key 'rank': value 0 must be >= 1"),
    ("data_config.img_dir=/nonexistent/folder", "folder '/nonexistent/folder' does not exist"),
    ("lr_scheduler=cosin", "key 'lr_scheduler': value 'cosin' is not one of"),
    ("mixed_precision=fp8", "key 'mixed_precision': value 'fp8' is not one of"),
    ("data_config.caption_dropout_rate=1.5", "must be in [0, 1]"),
    ("train_batch_size=4", "differs from data_config.train_batch_size 1"),
    ("quantization.weights=qint2", "key 'quantization.weights': value 'qint2' is not one of qfloat8, qint8, qint4"),
    ("blocks_to_swap=-1", "key 'blocks_to_swap': value -1 must be >= 0"),
    ("gradient_checkpointing=-2", "key 'gradient_checkpointing': value -2 must be true, false or a number of blocks"),
    ("gradient_checkpointing=some", "key 'gradient_checkpointing': value 'some' is not true, false or a whole number"),
    ("gradient_checkpointing=2.5", "key 'gradient_checkpointing': value '2.5' is not true, false or a whole number"),
    ("gpu_memory=lots", "key 'gpu_memory': cannot read 'lots' as a memory size; write e.g. 24GiB"),
])
def test_impossible_values_are_named(data_dir: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + [override])
    assert expected in str(err.value)


def test_all_problems_reported_at_once(data_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + ["rank=0", "learning_rate=0", "max_train_steps=0"])
    assert str(err.value).count("key '") == 3


def test_unknown_keys_wrong_types_and_values_come_in_one_round(data_dir: Path) -> None:
    """An unknown key, two wrong types (OmegaConf stops at the first), a bad item of a list and an
    impossible value: one error names all of them; a key whose type is wrong is not also blamed for
    its default's value."""
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + ["foo=1", "rank=abc", "learning_rate=xyz", "max_train_steps=0",
                                            "validation.prompts=[a, {prompt: b, seed: many}, 7]", "data_config=5"])
    message = str(err.value)
    for expected in ("unknown key 'foo'", "key 'rank': value 'abc' is not a valid integer",
                     "key 'learning_rate': value 'xyz' is not a valid number",
                     "key 'validation.prompts[1].seed': value 'many' is not a valid integer",
                     "key 'validation.prompts[2]': expected a mapping", "key 'max_train_steps': value 0 must be >= 1",
                     "key 'data_config': is a section"):
        assert expected in message, (expected, message)
    assert message.count("key '") == 7, message  # those seven, nothing else
    assert "data_config.img_dir" not in message, "the dropped section's default is not the user's problem"


# Each spelling reaches the environment through OmegaConf unless the parsed value is checked with its
# own grammar: YAML's \x24 and \u0024 escapes, a resolver name built from a key, an escaped backslash
# before a live interpolation (\\${...}), nested and spaced calls.
SECRET_SPELLINGS = {
    "x24 nested name": '"\\x24{oc.\\x24{tracker_project_name}:TRAINER_TEST_SECRET}"',
    "u0024": '"\\u0024{oc.env:TRAINER_TEST_SECRET}"',
    "escaped backslash": "'\\\\${oc.env:TRAINER_TEST_SECRET}'",
    "two escaped backslashes": "'\\\\\\\\${oc.env:TRAINER_TEST_SECRET}'",
    "nested": "'${oc.select:${oc.env:TRAINER_TEST_SECRET}}'",
    "spaced": "'${ oc.env:TRAINER_TEST_SECRET}'",
}


@pytest.mark.parametrize("where", ["yaml", "override"])
@pytest.mark.parametrize("spelling", SECRET_SPELLINGS.values(), ids=list(SECRET_SPELLINGS))
def test_no_spelling_of_a_resolver_reaches_the_environment(tmp_path: Path, data_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch, spelling: str,
                                                           where: str) -> None:
    monkeypatch.setenv("TRAINER_TEST_SECRET", "s3cr3t-token")
    monkeypatch.setenv("env", "s3cr3t-token")
    path = tmp_path / "cfg.yaml"
    path.write_text("tracker_project_name: env\n" + (f"wandb_run_name: {spelling}\n" if where == "yaml" else ""))
    overrides = base(data_dir) + ([f"wandb_run_name={spelling}"] if where == "override" else [])
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert "key 'wandb_run_name'" in str(err.value) and "resolver" in str(err.value)
    assert "s3cr3t" not in str(err.value)


def test_with_no_resolvers_registered_a_call_that_passes_every_check_still_reads_nothing(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Impossible by construction, not by pattern: with the check taken away, OmegaConf finds no
    resolver to call while a config is read; outside the scope the registry is OmegaConf's again."""
    from trainer.config import loading
    from trainer.config.interpolation import no_resolvers

    monkeypatch.setenv("TRAINER_TEST_SECRET", "s3cr3t-token")
    monkeypatch.setattr(loading, "_resolver_calls", lambda raw: [])
    with no_resolvers():
        assert not OmegaConf.has_resolver("oc.env")
    assert OmegaConf.has_resolver("oc.env")
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + ["wandb_run_name=${oc.env:TRAINER_TEST_SECRET}"])
    assert "key 'wandb_run_name'" in str(err.value) and "s3cr3t" not in str(err.value)
    assert OmegaConf.has_resolver("oc.env")


def test_a_key_reference_resolves_before_the_checks_that_use_it(data_dir: Path) -> None:
    """``cache_dir: output/${validation.negative_prompt}/../x`` is a reference (allowed); the checks see the
    resolved path: here the one in /etc is refused as the system folder it resolves to."""
    cfg = load_config(None, base(data_dir) + ['cache_dir="out/\\x24{validation.negative_prompt}/x"'])
    assert cfg.cache_dir == "out//x"
    with pytest.raises(ConfigError, match="key 'cache_dir': '/etc/x' is in the system folder /etc"):
        load_config(None, base(data_dir) + ["validation.negative_prompt=etc", "cache_dir=/${validation.negative_prompt}/x"])


def test_missing_file_and_bad_override_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(None, ["learning_rate"])


def test_yaml_is_data_not_code(tmp_path: Path, data_dir: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text("pretrained_model_name_or_path: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(evil)


def float_keys(node: object, prefix: str = "") -> list:
    """Every float key of the schema (sections, a dataset entry, a validation prompt), dotted."""
    from trainer.config import DatasetEntry, ValidationPrompt

    keys = []
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            keys += float_keys(value, f"{key}.")
        elif "float" in str(f.type) and "List" not in str(f.type):  # (a list of floats: its items)
            keys.append(key)
    if not prefix:
        keys += [f"datasets.0.{k}" for k in float_keys(DatasetEntry(), "_.")] + \
            [f"validation.prompts.0.{k}" for k in float_keys(ValidationPrompt(), "_.")]
    return [k.replace("_.", "") for k in keys]


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_every_float_key_refuses_numbers_that_are_not_finite(data_dir: Path, value: str) -> None:
    keys = float_keys(TrainConfig())
    assert {"learning_rate", "regularization_weight", "validation.cfg_scale", "datasets.0.caption_dropout_rate",
            "validation.prompts.0.guidance"} <= set(keys) and len(keys) >= 20
    entry = [f"datasets=[{{img_dir: {data_dir}}}]", "validation.prompts=[{prompt: a}]"]
    for key in keys:
        with pytest.raises(ConfigError) as err:
            load_config(None, ["pretrained_model_name_or_path=Qwen/Qwen-Image", *entry, f"{key}={value}"])
        shown = key.replace(".0.", "[0].")
        assert f"key '{shown}': value {float(value.replace('.', ''))} is not a finite number" in str(err.value)
        assert str(err.value).count(f"key '{shown}'") == 1, "one problem per key"


@pytest.mark.parametrize("where", ["yaml", "override"])
def test_a_config_is_data_resolvers_are_refused_literals_stay(tmp_path: Path, data_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    monkeypatch.setenv("TRAINER_TEST_SECRET", "s3cr3t-token")
    path = tmp_path / "cfg.yaml"
    for key, value in [("learning_rate", "${oc.env:TRAINER_TEST_SECRET}"), ("wandb_run_name", "${oc.decode:'1'}"),
                       ("data_config.trigger_word", "x-${oc.env:TRAINER_TEST_SECRET,none}")]:
        path.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist([f"{key}={value}"])) if where == "yaml" else "{}")
        with pytest.raises(ConfigError) as err:
            load_config(path, base(data_dir) + ([f"{key}={value}"] if where == "override" else []))
        assert f"key '{key}': {value!r} calls the OmegaConf resolver" in str(err.value)
        assert "s3cr3t" not in str(err.value)
    # A literal ${...} (escaped) stays literal everywhere: loaded, written as config.yaml, read back.
    path.write_text("data_config:\n  trigger_word: \\${oc.env:TRAINER_TEST_SECRET}\n"
                    "validation:\n  prompts: ['a \\${oc.env:TRAINER_TEST_SECRET}']\n"
                    "cache_dir: ${output_dir}/cache\n")
    cfg = load_config(path, base(data_dir))
    assert cfg.data_config.trigger_word == "${oc.env:TRAINER_TEST_SECRET}" == cfg.validation.prompts[0].prompt[2:]
    assert cfg.cache_dir == "./output/cache", "a reference to another key is data: resolved"
    saved = tmp_path / "config.yaml"
    saved.write_text(config_to_yaml(cfg))
    assert "s3cr3t" not in saved.read_text() and load_config(saved) == cfg


def test_defaults_are_sane() -> None:
    cfg = TrainConfig()
    assert cfg.lora_alpha is None and cfg.rank == 16
    assert cfg.precompute_text_embeddings and cfg.precompute_image_embeddings


# --------------------------------------------------------------------------- FlyMyAI's keys

@pytest.mark.parametrize("flymyai, canonical", [
    (["train_batch_size=1"], []),
    (["train_batch_size=2", "data_config.train_batch_size=2"], ["data_config.train_batch_size=2"]),
    (["adam8bit=true"], ["optimizer=adamw8bit"]),
    (["adam8bit=true", "optimizer=adafactor"], ["optimizer=adamw8bit"]),  # the switch wins, as before
    (["adam8bit=false"], []),
    (["disable_sampling=false", "sample_every=50", "sample_width=512", "sample_height=768", "sample_steps=12"],
     ["validation.every_n_steps=50", "validation.width=512", "validation.height=768", "validation.steps=12"]),
    (["disable_sampling=false"], ["validation.every_n_steps=250", "validation.steps=20"]),
    (["disable_sampling=false", "sample_every=50", "validation.every_n_steps=7"], ["validation.every_n_steps=7"]),
    (["disable_sampling=true", "sample_every=50", "sample_width=512"], []),
    (["double_blocks=null"], []),
    (["disable_gradient_checkpointing=true"], ["gradient_checkpointing=false"]),
    (["disable_gradient_checkpointing=false"], ["gradient_checkpointing=true"]),
    (["disable_gradient_checkpointing=false", "gradient_checkpointing=12"], ["gradient_checkpointing=12"]),
    (["disable_gradient_checkpointing=true", "gradient_checkpointing=0"], ["gradient_checkpointing=0"]),
], ids=lambda keys: " ".join(keys) or "-")
def test_each_flymyai_key_resolves_as_its_canonical_form(data_dir: Path, flymyai: list, canonical: list) -> None:
    old = load_config(None, base(data_dir) + flymyai)
    new = load_config(None, base(data_dir) + canonical)
    assert config_to_yaml(old) == config_to_yaml(new)
    written = OmegaConf.create(config_to_yaml(old))
    assert not set(written) & set(FLYMYAI_KEYS), "config.yaml shows the canonical names only"


def test_flymyai_keys_in_an_entry_scripts_defaults_are_translated_too(data_dir: Path) -> None:
    """train_4090.py passes `adam8bit: true` beneath the YAML; the YAML can still turn it off."""
    defaults = {"quantize": True, "adam8bit": True}
    assert load_config(None, base(data_dir), profile_defaults=defaults).optimizer == "adamw8bit"
    assert load_config(None, base(data_dir) + ["adam8bit=false"], profile_defaults=defaults).optimizer == "adamw"


def test_flymyai_key_mistakes_name_the_flymyai_key(data_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'adam8bt' \(did you mean 'adam8bit'\?\)"):
        load_config(None, base(data_dir) + ["adam8bt=true"])
    with pytest.raises(ConfigError, match=r"key 'sample_every': value 'often' is not a valid integer"):
        load_config(None, base(data_dir) + ["disable_sampling=false", "sample_every=often"])
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + ["double_blocks=[0,1]", "train_batch_size=3", "rank=0"])
    msg = str(err.value)
    assert "key 'double_blocks': choosing FLUX blocks is not yet supported" in msg
    assert "key 'train_batch_size': value 3 differs from data_config.train_batch_size 1" in msg
    assert "key 'rank': value 0 must be >= 1" in msg, "compat problems come with every other problem"


@pytest.mark.parametrize("keys, given", [
    (["disable_gradient_checkpointing=true", "gradient_checkpointing=12"], "12"),
    (["disable_gradient_checkpointing=true", "gradient_checkpointing=true"], "true"),
    (["disable_gradient_checkpointing=false", "gradient_checkpointing=false"], "false"),
    (["disable_gradient_checkpointing=false", "gradient_checkpointing=0"], "0"),
])
def test_contradictory_checkpointing_switches_are_one_line(data_dir: Path, keys: list, given: str) -> None:
    """FlyMyAI's disable_gradient_checkpointing still works; given with a gradient_checkpointing that says
    otherwise, the error is one line naming both."""
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + keys)
    disable = keys[0].partition("=")[2]
    assert f"key 'disable_gradient_checkpointing': value {disable} contradicts gradient_checkpointing: {given}; " \
           "set one of them" in str(err.value)
    assert "\n" not in str(err.value)


def test_an_override_of_one_checkpointing_name_replaces_the_yamls_other(tmp_path: Path, data_dir: Path) -> None:
    """A profile with FlyMyAI's disable_gradient_checkpointing, and gradient_checkpointing on the command line
    (or the other way round): the override wins, as any override does."""
    path = tmp_path / "p.yaml"
    path.write_text("disable_gradient_checkpointing: false\n")
    assert load_config(path, base(data_dir) + ["gradient_checkpointing=false"]).gradient_checkpointing is False
    path.write_text("gradient_checkpointing: 20\n")
    assert load_config(path, base(data_dir) + ["disable_gradient_checkpointing=true"]).gradient_checkpointing is False
    assert load_config(path, base(data_dir), profile_defaults={"disable_gradient_checkpointing": True}) \
        .gradient_checkpointing == 20, "the YAML wins over an entry script's default of the other name"


def test_gradient_checkpointing_takes_a_number_of_blocks(data_dir: Path) -> None:
    from trainer.model.activation_offload import checkpointed_blocks

    counts = {value: checkpointed_blocks(load_config(None, base(data_dir) + [f"gradient_checkpointing={value}"]), 60)
              for value in ("true", "false", "0", "1", "59", "60")}
    assert counts == {"true": 60, "false": 0, "0": 0, "1": 1, "59": 59, "60": 60}
    assert checkpointed_blocks(TrainConfig(), 60) == 60, "on by default, as before"
    with pytest.raises(ConfigError, match="key 'gradient_checkpointing': value 61 is more than the transformer's 60"):
        checkpointed_blocks(TrainConfig(gradient_checkpointing=61), 60)


def test_the_keys_a_user_set_are_known_to_the_config(tmp_path: Path, data_dir: Path) -> None:
    """auto_fit keeps what the user set: the YAML's keys (nested ones dotted) and the overrides', FlyMyAI's
    under the key they set, never an entry script's defaults."""
    path = tmp_path / "p.yaml"
    path.write_text("quantization:\n  backend: torchao\n  weights: int8_w8a8\nadam8bit: true\n")
    cfg = load_config(path, base(data_dir) + ["disable_gradient_checkpointing=true"],
                      profile_defaults={"blocks_to_swap": 3, "quantize": True})
    assert {"quantization", "quantization.backend", "quantization.weights", "optimizer", "gradient_checkpointing",
            "data_config", "data_config.img_dir", "pretrained_model_name_or_path"} == set(cfg.explicit_keys)
    assert cfg.blocks_to_swap == 3 and "blocks_to_swap" not in cfg.explicit_keys
    assert TrainConfig().explicit_keys == frozenset()


def test_flymyai_compat_leaves_its_input_alone() -> None:
    raw = {"adam8bit": True, "disable_sampling": False, "data_config": {"img_dir": "x"}}
    before = copy.deepcopy(raw)
    translated, problems = flymyai_compat(raw)
    assert raw == before and problems == []
    assert translated == {"optimizer": "adamw8bit", "data_config": {"img_dir": "x"},
                          "validation": {"every_n_steps": 250, "width": 1024, "height": 1024, "steps": 20}}


# --------------------------------------------------------------------------- choices beside their fields

def choice_fields(schema: type = TrainConfig, prefix: str = ""):
    """(dotted key, section class, field) of every field with metadata["choices"], sections included."""
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            yield from choice_fields(f.default_factory, f"{prefix}{f.name}.")
        elif "choices" in f.metadata:
            yield f"{prefix}{f.name}", schema, f


def test_every_fixed_set_of_values_is_in_field_metadata() -> None:
    """A form built from dataclasses.fields(TrainConfig) sees every choice list."""
    assert {key for key, _, _ in choice_fields()} == {
        "family", "training_mode", "report_to", "lr_scheduler", "optimizer", "mixed_precision", "timestep_sampling",
        "timestep_shift", "loss_weighting", "adapter_type", "lora_init", "lora_target", "lora_export_formats",
        "attention_backend", "compile_mode", "data_config.bucket_mode", "data_config.clip_mode", "quantization.backend",
        "quantization.weights", "train_expert", "task"}
    assert dict((key, f.metadata["choices"]) for key, _, f in choice_fields())["adapter_type"] == ("lora", "lokr", "loha")


# Keys a choice needs set to load at all: the whole-model compile modes need no gradient checkpointing.
CHOICE_NEEDS = {"compile_mode": ["gradient_checkpointing=false"]}


@pytest.mark.parametrize("key", [key for key, _, _ in choice_fields()])
def test_choices_come_from_field_metadata(data_dir: Path, key: str) -> None:
    """Each listed value loads; any other is refused with the metadata's list in the message."""
    _, section, f = next(c for c in choice_fields() if c[0] == key)
    by = f.metadata.get("choices_by")
    prefix = key.rpartition(".")[0] + "." if "." in key else ""
    # A field whose choices depend on this one (the weight formats on the backend) takes a fitting value.
    dependents = [g for g in dataclasses.fields(section) if g.metadata.get("choices_by", ("",))[0] == f.name]
    listy = key == "lora_export_formats"
    for value in f.metadata["choices"]:
        context = [f"{prefix}{by[0]}={b}" for b, formats in by[1].items() if value in formats] if by else []
        context += [f"{prefix}{g.name}={g.metadata['choices_by'][1][value][0]}" for g in dependents]
        context += CHOICE_NEEDS.get(key, [])
        cfg = load_config(None, base(data_dir) + context + [f"{key}=[{value}]" if listy else f"{key}={value}"])
        assert OmegaConf.select(OmegaConf.structured(cfg), key) == ([value] if listy else value)
    with pytest.raises(ConfigError) as err:
        load_config(None, base(data_dir) + [f"{key}=[diffusers,bogus]" if listy else f"{key}=bogus"])
    listed = by[1][getattr(section(), by[0])] if by else f.metadata["choices"]
    assert f"key '{key}': value 'bogus' is not one of {', '.join(listed)}" in str(err.value)


def test_weight_formats_have_one_home() -> None:
    from trainer.model.quantization import TORCHAO_CONFIGS, W8A8_WEIGHTS

    assert set(TORCHAO_CONFIGS) | set(W8A8_WEIGHTS) == set(TORCHAO_WEIGHTS)
    assert QUANTO_WEIGHTS == ("qfloat8", "qint8", "qint4")


def test_attention_backend_choices_are_the_platform_layers() -> None:
    """The schema lists them without importing torch; they must stay utils.attention's."""
    from utils.attention import BACKEND_CHOICES

    (backend,) = [f for f in dataclasses.fields(TrainConfig) if f.name == "attention_backend"]
    assert backend.metadata["choices"] == BACKEND_CHOICES
