"""A training config's JSON values checked against their fields (acache_lab.train.json_fields), through
TrainConfig.from_file as ``acache train`` reads a config."""

from __future__ import annotations

import json

import pytest

from acache_lab.train.trainer import TrainConfig


@pytest.mark.parametrize("change, message", [
    ({"steps": "20"}, "'steps' must be a whole number, got '20'"),
    ({"batch_size": 4.0}, "'batch_size' must be a whole number, got 4.0"),
    ({"seed": 1.5}, "'seed' must be a whole number, got 1.5"),
    ({"bf16": "no"}, "'bf16' must be true or false, got 'no'"),
    ({"tasks": "qa1"}, "'tasks' must be a list of strings, got 'qa1'"),
    ({"model": {"layers": "2"}}, "'model.layers' must be a whole number, got '2'"),
    ({"model": {"layerz": 2}}, r"unknown model options \['layerz'\]"),
    ({"warmup": -5}, "warmup must be 0 or more steps, not -5"),
], ids=["steps", "batch", "seed", "bf16", "tasks", "model-type", "model-key", "warmup"])
def test_a_config_value_of_the_wrong_type_is_named_by_its_field(tmp_path, change, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"out": str(tmp_path / "run"), "steps": 6, "batch_size": 4, **change}))
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_file(path)
