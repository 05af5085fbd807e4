"""Evaluation in one process: a split with nothing to score is refused by name; eval.json is written whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.data.config import Config
from harness.data.corpus import make_corpus
from harness.model import build_model
from harness.training.evaluation import EVAL_FILE, evaluate_model, write_eval


def test_a_split_without_supervised_tokens_is_a_value_error_naming_it() -> None:
    """0/0 would be NaN in eval.json (or a ZeroDivisionError): refuse with the split's name instead."""
    config = Config()
    rows = [r for r in make_corpus(config) if r.split != "val"]
    model = build_model(config)
    with pytest.raises(ValueError, match=r"split 'val' has no supervised tokens \(0 sequences"):
        evaluate_model(model, rows, config, torch.device("cpu"), splits=("test", "val"))
    result = evaluate_model(model, rows, config, torch.device("cpu"), splits=("test",))
    assert 0 < result["test_tokens"]


def test_eval_json_is_written_whole_with_no_temporary_left(tmp_path: Path) -> None:
    """write_eval goes through write_atomic: the JSON is whole and no temporary remains."""
    path = write_eval(tmp_path / "run", {"test_loss": 1.5}, step=100)
    assert path == tmp_path / "run" / EVAL_FILE
    assert {"step": 100, "test_loss": 1.5} == json.loads(path.read_text())
    assert [EVAL_FILE] == [p.name for p in path.parent.iterdir()]
