"""Run configuration: one dataclass, loaded from YAML one key to one field.

An unknown key or an invalid value is an error that names the key, the value and the fix; nothing is
silently ignored, because a typo in a config that shapes the data would change every number downstream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.compare import PRECISIONS

OPTIMIZERS = ("sgd",)


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """Everything that shapes the corpus, the plan, the model and the optimizer."""

    seed: int = 1234
    """Seeds the corpus, the plan (``seed + 10``, as in seed 000) and the initial weights."""

    train_size: int = 1024
    """Training sequences in the corpus."""

    val_size: int = 128
    """Validation sequences."""

    test_size: int = 256
    """Test sequences, evaluated after training."""

    min_len: int = 16
    """Shortest sequence, in tokens (prompt included)."""

    max_len: int = 128
    """Longest sequence, in tokens; the plan's length bands divide ``(0, max_len]`` into equal widths."""

    vocab_size: int = 32
    """Token ids are ``1 .. vocab_size - 1``; id 0 is ``PAD``."""

    prompt_fraction: float = 0.3
    """Share of sequences that start with an unsupervised prompt prefix."""

    prompt_max: int = 8
    """Longest prompt prefix, in tokens (the shortest is 2)."""

    noise: float = 0.1
    """Probability that a token breaks its sequence's pattern (keeps the task from being trivial)."""

    world_size: int = 2
    """Ranks of the training run."""

    batch_size_per_rank: int = 4
    """Sequences per microbatch on each rank."""

    accumulation: int = 2
    """Microbatches per rank per optimizer step (the accumulation window)."""

    updates: int = 100
    """Optimizer steps of a full run."""

    stop_at: int = 50
    """Step at which the default (non-continuous) run stops after writing its checkpoint."""

    checkpoint_every: int = 10
    """Write a checkpoint every this many steps (and at ``stop_at`` and at the end)."""

    optimizer: str = "sgd"
    """Only ``sgd`` (with momentum) is supported."""

    lr: float = 0.05
    """Peak learning rate."""

    momentum: float = 0.9
    """SGD momentum; non-zero so that optimizer state matters on resume."""

    warmup: int = 10
    """Linear warm-up steps; the schedule then decays linearly to zero at ``updates``."""

    precision: str = "fp32"
    """``fp32`` or ``fp64``: the dtype of the model's parameters and logits."""

    d_model: int = 32
    """Width of the model."""

    n_layers: int = 1
    """Transformer blocks."""

    n_heads: int = 2
    """Attention heads; must divide ``d_model``."""

    dropout: float = 0.1
    """Dropout probability during training (the battery always runs with 0)."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def dtype(self) -> Any:
        return PRECISIONS[self.precision]

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str}


def _positive_ints(c: Config) -> tuple[str, ...]:
    return (
        "train_size", "val_size", "test_size", "min_len", "max_len", "vocab_size", "world_size",
        "batch_size_per_rank", "accumulation", "updates", "stop_at", "checkpoint_every", "d_model",
        "n_layers", "n_heads",
    )


def _fail(key: str, value: Any, rule: str, where: str) -> None:
    msg = f"{key}={value!r} {rule}; {where}"
    raise ValueError(msg)


def _validate(c: Config, where: str = "fix it in the config file or the keyword argument") -> None:
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        expected = _FIELD_TYPES[str(f.type)]
        if isinstance(value, bool) or not isinstance(value, expected):
            _fail(f.name, value, f"must be of type {f.type}", where)
    for key in _positive_ints(c):
        if getattr(c, key) <= 0:
            _fail(key, getattr(c, key), "must be a positive integer", where)
    if c.min_len < 3:
        _fail("min_len", c.min_len, "must be at least 3 (a prompt of 2 and one supervised token)", where)
    if c.max_len < c.min_len:
        _fail("max_len", c.max_len, f"must be at least min_len={c.min_len}", where)
    if c.prompt_max < 2 or c.prompt_max > c.min_len - 1:
        _fail("prompt_max", c.prompt_max, f"must be between 2 and min_len - 1 = {c.min_len - 1}", where)
    if c.vocab_size < 4:
        _fail("vocab_size", c.vocab_size, "must be at least 4 (PAD plus three token ids)", where)
    for key in ("prompt_fraction", "noise", "dropout"):
        v = getattr(c, key)
        if not 0.0 <= v < 1.0:
            _fail(key, v, "must be in [0, 1)", where)
    if c.stop_at > c.updates:
        _fail("stop_at", c.stop_at, f"must not exceed updates={c.updates}", where)
    if c.warmup < 0 or c.warmup >= c.updates:
        _fail("warmup", c.warmup, f"must be in [0, updates={c.updates})", where)
    if not c.lr > 0:
        _fail("lr", c.lr, "must be positive", where)
    if not 0.0 <= c.momentum < 1.0:
        _fail("momentum", c.momentum, "must be in [0, 1)", where)
    if c.optimizer not in OPTIMIZERS:
        _fail("optimizer", c.optimizer, f"must be one of {OPTIMIZERS}", where)
    if c.precision not in PRECISIONS:
        _fail("precision", c.precision, f"must be one of {tuple(PRECISIONS)}", where)
    if c.d_model % c.n_heads:
        _fail("n_heads", c.n_heads, f"must divide d_model={c.d_model}", where)


def load_config(path: str | Path, **overrides: Any) -> Config:
    """Read a YAML mapping whose keys are exactly :class:`Config`'s fields (any subset)."""
    import yaml  # here, not at the top: a machine without PyYAML fails only where YAML is read

    p = Path(path)
    if not p.is_file():
        msg = f"config={str(path)!r} does not exist; pass a YAML file such as configs/minimum.yaml"
        raise ValueError(msg)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        msg = f"config={str(path)!r} is not valid YAML ({exc}); fix the file"
        raise ValueError(msg) from exc
    if not isinstance(data, dict):
        msg = f"config={str(path)!r} must hold a mapping of keys to values, got {type(data).__name__}"
        raise ValueError(msg)
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - known)
    if unknown:
        msg = f"{unknown[0]}={data[unknown[0]]!r} is not a config key (in {p}); known keys: {', '.join(sorted(known))}"
        raise ValueError(msg)
    bad = sorted(set(overrides) - known)
    if bad:
        msg = f"{bad[0]}={overrides[bad[0]]!r} is not a config key; known keys: {', '.join(sorted(known))}"
        raise ValueError(msg)
    data.update(overrides)
    try:
        return Config(**data)
    except ValueError as exc:
        msg = f"{exc} (in {p})"
        raise ValueError(msg) from None
