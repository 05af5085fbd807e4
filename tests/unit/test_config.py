"""Config: the YAML maps one key to one field, and every invalid key or value is an error that names it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from harness.data.config import Config, load_config

MINIMUM = Path(__file__).resolve().parents[2] / "configs" / "minimum.yaml"

# (key, value): each one breaks exactly one rule of Config's validation, starting from the defaults.
INVALID = {
    "seed-str": ("seed", "1234"),
    "train_size-zero": ("train_size", 0),
    "train_size-negative": ("train_size", -1),
    "train_size-float": ("train_size", 1.5),
    "val_size-zero": ("val_size", 0),
    "test_size-negative": ("test_size", -5),
    "min_len-below-3": ("min_len", 2),
    "max_len-below-min_len": ("max_len", 10),
    "vocab_size-below-4": ("vocab_size", 3),
    "vocab_size-zero": ("vocab_size", 0),
    "prompt_fraction-one": ("prompt_fraction", 1.0),
    "prompt_fraction-negative": ("prompt_fraction", -0.1),
    "prompt_fraction-nan": ("prompt_fraction", math.nan),
    "prompt_max-below-2": ("prompt_max", 1),
    "prompt_max-not-below-min_len": ("prompt_max", 16),
    "noise-above-one": ("noise", 1.5),
    "world_size-zero": ("world_size", 0),
    "world_size-bool": ("world_size", True),
    "batch_size_per_rank-negative": ("batch_size_per_rank", -1),
    "accumulation-zero": ("accumulation", 0),
    "updates-zero": ("updates", 0),
    "stop_at-zero": ("stop_at", 0),
    "stop_at-beyond-updates": ("stop_at", 101),
    "checkpoint_every-zero": ("checkpoint_every", 0),
    "optimizer-adam": ("optimizer", "adam"),
    "lr-zero": ("lr", 0.0),
    "lr-negative": ("lr", -0.1),
    "lr-nan": ("lr", math.nan),
    "lr-str": ("lr", "fast"),
    "momentum-one": ("momentum", 1.0),
    "momentum-negative": ("momentum", -0.5),
    "warmup-negative": ("warmup", -1),
    "warmup-equal-to-updates": ("warmup", 100),
    "precision-bf16": ("precision", "bf16"),
    "precision-int": ("precision", 32),
    "d_model-zero": ("d_model", 0),
    "n_layers-zero": ("n_layers", 0),
    "n_heads-zero": ("n_heads", 0),
    "n_heads-not-dividing-d_model": ("n_heads", 3),
    "dropout-negative": ("dropout", -0.1),
    "dropout-none": ("dropout", None),
}

# Boundary values that are allowed.
VALID = {
    "prompt_fraction-zero": {"prompt_fraction": 0.0},
    "noise-zero": {"noise": 0.0},
    "dropout-zero": {"dropout": 0.0},
    "momentum-zero": {"momentum": 0.0},
    "warmup-zero": {"warmup": 0},
    "stop_at-equal-to-updates": {"stop_at": 100},
    "shortest-sequences": {"min_len": 3, "max_len": 3, "prompt_max": 2},
    "prompt_max-min_len-minus-one": {"prompt_max": 15},
    "smallest-vocab": {"vocab_size": 4},
    "n_heads-divides-d_model": {"d_model": 8, "n_heads": 4},
    "fp64": {"precision": "fp64"},
    "int-lr": {"lr": 1},
    "one-rank": {"world_size": 1},
}


def _write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _minimum_with(tmp_path: Path, **changes: object) -> Path:
    data = yaml.safe_load(MINIMUM.read_text())
    data.update(changes)
    return _write(tmp_path, yaml.safe_dump(data))


def _names_key_and_value(message: str, key: str, value: object) -> bool:
    return f"{key}={value!r}" in message


# --- valid configs ---------------------------------------------------------------------------------------------------


def test_minimum_yaml_loads_the_seed_r1_setup() -> None:
    """configs/minimum.yaml gives seed 000's set-up: 2 ranks, 4 rows per microbatch, 2 microbatches, 100 updates."""
    c = load_config(MINIMUM)
    got = (c.seed, c.world_size, c.batch_size_per_rank, c.accumulation, c.updates, c.stop_at, c.min_len, c.max_len)
    assert (1234, 2, 4, 2, 100, 50, 16, 128) == got


def test_minimum_yaml_sets_every_field() -> None:
    """The example file names every field of Config, so it documents the whole surface."""
    keys = set(yaml.safe_load(MINIMUM.read_text()))
    assert {f.name for f in dataclasses.fields(Config)} == keys


def test_load_config_applies_overrides() -> None:
    """Keyword overrides replace the file's values."""
    assert 3 == load_config(MINIMUM, world_size=3).world_size


def test_an_empty_yaml_file_gives_the_defaults(tmp_path: Path) -> None:
    """An empty file is an empty mapping: every field keeps its default."""
    assert Config() == load_config(_write(tmp_path, ""))


def test_a_partial_yaml_file_keeps_the_other_defaults(tmp_path: Path) -> None:
    """Any subset of keys is allowed; the rest keep their defaults."""
    assert Config(world_size=3, lr=0.1) == load_config(_write(tmp_path, "world_size: 3\nlr: 0.1\n"))


@pytest.mark.parametrize("changes", list(VALID.values()), ids=list(VALID))
def test_boundary_values_are_accepted(changes: dict[str, object]) -> None:
    """Values on the edge of each rule are valid and kept as given."""
    c = Config(**changes)
    assert changes == {k: getattr(c, k) for k in changes}


def test_fp64_precision_gives_float64_dtype() -> None:
    """precision=fp64 maps to torch.float64, fp32 to torch.float32."""
    import torch

    assert (torch.float64, torch.float32) == (Config(precision="fp64").dtype, Config().dtype)


def test_config_is_frozen() -> None:
    """A Config cannot be changed in place; replace() makes a validated copy."""
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.world_size = 3  # type: ignore[misc]


# --- invalid values --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), list(INVALID.values()), ids=list(INVALID))
def test_invalid_value_raises_naming_key_and_value(key: str, value: object) -> None:
    """Config(key=value) raises ValueError whose message contains ``key=value``."""
    with pytest.raises(ValueError) as info:
        Config(**{key: value})
    assert _names_key_and_value(str(info.value), key, value), str(info.value)


@pytest.mark.parametrize(("key", "value"), list(INVALID.values()), ids=list(INVALID))
def test_invalid_value_in_yaml_raises_naming_key_value_and_path(tmp_path: Path, key: str, value: object) -> None:
    """The same invalid value read from a file raises ValueError naming the key, the value and the file."""
    path = _minimum_with(tmp_path, **{key: value})
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert _names_key_and_value(message, key, value), message
    assert str(path) in message


@pytest.mark.parametrize(("key", "value"), [("world_size", 0), ("n_heads", 5)], ids=["world_size-zero", "n_heads-5"])
def test_replace_validates_the_copy(key: str, value: object) -> None:
    """Config.replace() runs the same validation as the constructor."""
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        Config().replace(**{key: value})


def test_invalid_override_raises_naming_key_value_and_path() -> None:
    """An override passed to load_config is validated like a value in the file."""
    with pytest.raises(ValueError, match=r"world_size=0 .*minimum\.yaml"):
        load_config(MINIMUM, world_size=0)


def test_unknown_key_raises_naming_the_key(tmp_path: Path) -> None:
    """A misspelt key is an error that names it and the file, never silently ignored."""
    path = _minimum_with(tmp_path, world_sise=2)
    with pytest.raises(ValueError, match=r"world_sise=2 is not a config key") as info:
        load_config(path)
    assert str(path) in str(info.value)


# --- invalid files ---------------------------------------------------------------------------------------------------


def test_missing_file_raises_naming_the_path(tmp_path: Path) -> None:
    """A path that does not exist is a ValueError that names it."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ValueError, match="does not exist") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_yaml_raises_naming_the_path(tmp_path: Path) -> None:
    """A file that is not YAML is a ValueError that names it."""
    path = _write(tmp_path, "seed: [1, 2\nlr: 0.1\n")
    with pytest.raises(ValueError, match="not valid YAML") as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "42\n", "just a string\n"], ids=["list", "int", "str"])
def test_non_mapping_yaml_raises_naming_the_path(tmp_path: Path, text: str) -> None:
    """A YAML document that is not a mapping is a ValueError that names the file."""
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match="must hold a mapping") as info:
        load_config(path)
    assert str(path) in str(info.value)
