"""The averaging probe: every parameter the mean of the checkpoints', the first one's config and tokenizer kept."""

from __future__ import annotations

import json

import pytest
import torch

from acache.models.loader import load_model
from acache_lab.probes.average_checkpoints import average_checkpoints
from tests.conftest import tiny_checkpoint


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = tmp_path_factory.mktemp("soup")
    dirs = [tiny_checkpoint(root / f"m{seed}", "llada", seed=seed) for seed in (1, 2, 3)]
    record = {"affix_isolation": 0.8, "steps": 10, "init_from": None, "layouts": ["prefix"]}
    config = json.loads((dirs[0] / "config.json").read_text())
    (dirs[0] / "config.json").write_text(json.dumps({**config, "acache_affix_training": record}))
    return dirs


def test_each_parameter_is_the_mean_and_the_first_gives_the_config(three, tmp_path):
    out = average_checkpoints(three, tmp_path / "avg")
    soup = dict(load_model(out).named_parameters())
    members = [dict(load_model(d).named_parameters()) for d in three]
    assert soup.keys() == members[0].keys()
    for name, t in soup.items():
        torch.testing.assert_close(t, (members[0][name] + members[1][name] + members[2][name]) / 3, rtol=0, atol=1e-7)
    assert not torch.equal(soup["embed.weight"], members[0]["embed.weight"])  # the members differ
    record = load_model(out).config.affix_training
    assert record["affix_isolation"] == 0.8 and record["averaged_from"] == [str(d) for d in three]
    assert (out / "tokenizer.json").read_bytes() == (three[0] / "tokenizer.json").read_bytes()


def test_two_identical_checkpoints_average_to_the_same_bytes(three, tmp_path):
    out = average_checkpoints([three[1], three[1]], tmp_path / "same")
    assert (out / "model.safetensors").read_bytes() == (three[1] / "model.safetensors").read_bytes()
    assert "acache_affix_training" not in json.loads((out / "config.json").read_text())


def test_one_checkpoint_is_refused(three, tmp_path):
    with pytest.raises(ValueError, match="averaging needs at least two checkpoints, got 1"):
        average_checkpoints(three[:1], tmp_path / "one")


def test_a_missing_checkpoint_is_named(three, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path / 'nowhere'}"):
        average_checkpoints([three[0], tmp_path / "nowhere"], tmp_path / "out")


def test_another_shape_is_refused(three, tmp_path):
    wider = tiny_checkpoint(tmp_path / "wide", "llada", hidden_size=128)
    with pytest.raises(ValueError, match=f"{wider} does not have the shape of {three[0]}"):
        average_checkpoints([three[0], wider], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_writing_over_a_member_is_refused(three):
    with pytest.raises(ValueError, match="is one of the checkpoints averaged"):
        average_checkpoints(three[:2], three[1])


def test_weights_give_the_weighted_sum_and_are_recorded(three, tmp_path):
    out = average_checkpoints([three[0], three[2]], tmp_path / "tilted", weights=[0.75, 0.25])
    soup = dict(load_model(out).named_parameters())
    a, c = dict(load_model(three[0]).named_parameters()), dict(load_model(three[2]).named_parameters())
    for name, t in soup.items():
        torch.testing.assert_close(t, 0.75 * a[name] + 0.25 * c[name], rtol=0, atol=1e-7)
    record = load_model(out).config.affix_training
    assert record["averaged_weights"] == [0.75, 0.25]


@pytest.mark.parametrize(("weights", "message"), [
    ([1.0], "1 weights for 2 checkpoints: give one a checkpoint"),
    ([0.5, 0.25, 0.25], "3 weights for 2 checkpoints"),
    ([1.5, -0.5], r"the weights must be >= 0 and sum to 1, not \[1.5, -0.5\]"),
    ([0.5, 0.4], r"the weights must be >= 0 and sum to 1, not \[0.5, 0.4\]"),
    ([float("nan"), 1.0], "the weights must be >= 0 and sum to 1"),
])
def test_bad_weights_are_refused(three, tmp_path, weights, message):
    with pytest.raises(ValueError, match=message):
        average_checkpoints(three[:2], tmp_path / "out", weights=weights)
    assert not (tmp_path / "out").exists()


def test_the_command_line_names_the_problem(three, tmp_path, monkeypatch):
    from acache_lab.probes.average_checkpoints import main

    monkeypatch.setattr("sys.argv", ["average_checkpoints", "--out", str(tmp_path / "o"), "--weights", "0.5,x",
                                     str(three[0]), str(three[1])])
    with pytest.raises(SystemExit, match="error: --weights: 'x' is not a number"):
        main()
    monkeypatch.setattr("sys.argv", ["average_checkpoints", "--out", str(tmp_path / "o"), str(three[0]),
                                     str(tmp_path / "absent")])
    with pytest.raises(SystemExit, match=f"error: no checkpoint at {tmp_path / 'absent'}"):
        main()
