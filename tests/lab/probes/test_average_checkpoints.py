"""The averaging probe: every parameter the mean of the checkpoints', the first one's config and tokenizer kept."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from safetensors import safe_open

from acache.models.loader import load_model
from acache_lab.probes.average_checkpoints import average_checkpoints
from tests.conftest import tiny_checkpoint


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = tmp_path_factory.mktemp("soup")
    dirs = [tiny_checkpoint(root / f"m{seed}", "llada", seed=seed) for seed in (1, 2, 3)]
    for steps, d in enumerate(dirs, start=10):  # each with its own record: the first one's is kept
        record = {"affix_isolation": 0.8, "steps": steps, "init_from": None, "layouts": ["prefix"]}
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "acache_affix_training": record}))
    return dirs


def test_each_parameter_is_the_mean_and_the_first_gives_the_config(three, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every member carries a record: nothing to warn about
        out = average_checkpoints(three, tmp_path / "avg")
    soup = dict(load_model(out).named_parameters())
    members = [dict(load_model(d).named_parameters()) for d in three]
    assert soup.keys() == members[0].keys()
    for name, t in soup.items():
        torch.testing.assert_close(t, (members[0][name] + members[1][name] + members[2][name]) / 3, rtol=0, atol=1e-7)
    assert not torch.equal(soup["embed.weight"], members[0]["embed.weight"])  # the members differ
    assert load_model(out).config.affix_training["steps"] == 10  # the first's record
    config = json.loads((out / "config.json").read_text())
    assert config["acache_averaged"] == {"from": [str(d) for d in three], "weights": None}
    assert (out / "tokenizer.json").read_bytes() == (three[0] / "tokenizer.json").read_bytes()


def test_two_identical_checkpoints_average_to_the_same_bytes(three, tmp_path):
    out = average_checkpoints([three[1], three[1]], tmp_path / "same")
    assert (out / "model.safetensors").read_bytes() == (three[1] / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text())["acache_affix_training"]["steps"] == 11


def test_the_first_ones_dtype_is_kept(tmp_path):
    halves = [tiny_checkpoint(tmp_path / f"h{seed}", "llada", seed=seed, dtype="bfloat16") for seed in (1, 2)]
    full = tiny_checkpoint(tmp_path / "f", "llada", seed=3)
    for members, dtype in ((halves, torch.bfloat16), ([full, halves[0]], torch.float32),
                           ([halves[1], full], torch.bfloat16)):
        out = average_checkpoints(members, tmp_path / "avg", overwrite=True)
        with safe_open(out / "model.safetensors", "pt") as f:
            names = f.keys()
            assert {f.get_tensor(k).dtype for k in names} == {dtype}
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")


def test_members_that_differ_in_the_affix_record_warn(three, tmp_path):
    plain = tiny_checkpoint(tmp_path / "plain", "llada", seed=4)
    with pytest.warns(UserWarning, match=r"only some of the checkpoints carry an affix-training record \(1 of 2\)"):
        out = average_checkpoints([plain, three[0]], tmp_path / "mixed")
    assert load_model(out).config.affix_training is None  # the first one's: none


def test_one_checkpoint_is_refused(three, tmp_path):
    with pytest.raises(ValueError, match="averaging needs at least two checkpoints, got 1"):
        average_checkpoints(three[:1], tmp_path / "one")


def test_a_missing_checkpoint_is_named(three, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {re.escape(str(tmp_path / 'nowhere'))}"):
        average_checkpoints([three[0], tmp_path / "nowhere"], tmp_path / "out")


def test_another_shape_is_refused(three, tmp_path):
    wider = tiny_checkpoint(tmp_path / "wide", "llada", hidden_size=128)
    with pytest.raises(ValueError, match=re.escape(f"{wider} is not the model of {three[0]} (hidden_size 64 != 128)")):
        average_checkpoints([three[0], wider], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("change", "named"), [
    (lambda c: {**c, "rope_theta": 10000.0}, "rope_theta 500000.0 != 10000.0"),
    (lambda c: {**c, "mask_token_id": 5}, "mask_token_id"),
])
def test_another_config_of_the_same_shapes_is_refused(three, tmp_path, change, named):
    """Tensors of the same shapes are not enough: a model read under another config is another model."""
    other = tiny_checkpoint(tmp_path / "other", "llada", seed=5)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(change(config)))
    with pytest.raises(ValueError, match=re.escape(f"{other} is not the model of {three[1]} ({named}")):
        average_checkpoints([three[1], other], tmp_path / "out")


def test_more_kv_heads_of_the_same_shapes_are_refused(three, tmp_path):
    other = tiny_checkpoint(tmp_path / "heads", "llada", heads=8, kv_heads=4)
    with pytest.raises(ValueError, match="num_heads 4 != 8"):
        average_checkpoints([three[1], other], tmp_path / "out")


def test_another_tokenizer_is_refused(three, tmp_path):
    other = tiny_checkpoint(tmp_path / "tok", "llada", seed=5)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace("}", " }", 1))
    with pytest.raises(ValueError, match=re.escape(f"{other} has another tokenizer than {three[1]}")):
        average_checkpoints([three[1], other], tmp_path / "out")


def test_a_full_out_is_refused_unless_overwritten_and_then_cleared(three, tmp_path):
    out = tmp_path / "full"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")  # an older sharded checkpoint's index
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        average_checkpoints(three[:2], out)
    average_checkpoints(three[:2], out, overwrite=True)
    assert not (out / "model.safetensors.index.json").exists()  # else the loader would read the old shards
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        average_checkpoints(three[:2], tmp_path / "file", overwrite=True)


def test_writing_over_a_member_or_its_folder_is_refused(three):
    for out in (three[1], three[1].parent):  # the folder holding the members: build/run for build/run/step-N
        with pytest.raises(ValueError, match="one of the checkpoints averaged: write elsewhere"):
            average_checkpoints(three[:2], out, overwrite=True)
        assert (three[1] / "config.json").is_file()


def test_weights_give_the_weighted_sum_and_are_recorded(three, tmp_path):
    out = average_checkpoints([three[0], three[2]], tmp_path / "tilted", weights=[0.75, 0.25])
    soup = dict(load_model(out).named_parameters())
    a, c = dict(load_model(three[0]).named_parameters()), dict(load_model(three[2]).named_parameters())
    for name, t in soup.items():
        torch.testing.assert_close(t, 0.75 * a[name] + 0.25 * c[name], rtol=0, atol=1e-7)
    assert json.loads((out / "config.json").read_text())["acache_averaged"] == {
        "from": [str(three[0]), str(three[2])], "weights": [0.75, 0.25]}


@pytest.mark.parametrize(("weights", "message"), [
    ([1.0], "1 weights for 2 checkpoints: give one per checkpoint"),
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
    with pytest.raises(SystemExit, match=f"error: no checkpoint at {re.escape(str(tmp_path / 'absent'))}"):
        main()
    monkeypatch.setattr("sys.argv", ["average_checkpoints", "--out", str(tmp_path / "o"), "--weights", "",
                                     str(three[0]), str(three[1])])
    with pytest.raises(SystemExit, match="error: --weights: '' is not a number"):
        main()


@pytest.mark.parametrize("family", ["blockdiff_ssm", "r2lm"])
def test_the_state_cache_families_average_and_are_told_apart(three, tmp_path, family):
    """Their configs are classes of their own: averaged like the others, never with a LLaDA checkpoint."""
    pair = [tiny_checkpoint(tmp_path / f"{family}{seed}", family, seed=seed) for seed in (1, 2)]
    out = average_checkpoints(pair, tmp_path / "avg")
    soup = dict(load_model(out).named_parameters())
    a, b = (dict(load_model(p).named_parameters()) for p in pair)
    for name, t in soup.items():
        torch.testing.assert_close(t, (a[name] + b[name]) / 2, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"is not the model of .* \(config "):
        average_checkpoints([three[1], pair[0]], tmp_path / "mixed")
