"""A deepened checkpoint computes what the original did (logit for logit, token for token), its new layers can
learn, and bad requests are named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from acache.models.loader import load_model
from acache.reference import reference_generate
from acache.sampling_params import SamplingParams
from acache_lab.train.expand import expand_checkpoint, expand_layers, main
from acache_lab.train.trainer import write_affix_training


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("every, layers", [(1, 4), (2, 3)])
def test_a_deepened_model_computes_what_it_did(family, every, layers, llada_dir, dream_dir):
    model = load_model(llada_dir if family == "llada" else dream_dir)
    deeper = expand_layers(model, every)
    assert len(model.layers) == 2 and len(deeper.layers) == deeper.config.num_layers == layers
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, -1)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 9:] = False
    with torch.inference_mode():
        want = model.logits(model(ids, positions, valid).hidden)
        got = deeper.logits(deeper(ids, positions, valid).hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    silent = deeper.layers[every]  # the first inserted layer: the copy of the one before it, its outputs zero
    assert not silent.o_proj.weight.any() and not silent.down_proj.weight.any()
    assert torch.equal(silent.q_proj.weight, model.layers[every - 1].q_proj.weight)
    assert model.layers[0].o_proj.weight.any()  # the original is untouched


def test_the_new_layers_learn(llada_dir):
    """At first only their zero output projections get a gradient (nothing flows back through a zero matrix to the
    rest of the layer); a step makes those nonzero, and from then on the whole layer learns."""
    deeper = expand_layers(load_model(llada_dir)).requires_grad_(True)
    ids = torch.randint(0, deeper.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    silent = deeper.layers[1]

    def backward() -> None:
        deeper.zero_grad()
        deeper.logits(deeper(ids, torch.arange(10)[None]).hidden).logsumexp(-1).sum().backward()

    backward()
    assert silent.o_proj.weight.grad.abs().sum() > 0 and silent.down_proj.weight.grad.abs().sum() > 0
    assert not silent.q_proj.weight.grad.any() and not silent.up_proj.weight.grad.any()
    torch.optim.SGD(deeper.parameters(), lr=0.1).step()
    backward()
    assert silent.q_proj.weight.grad.abs().sum() > 0 and silent.up_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_written_checkpoint_decodes_the_same_tokens(tmp_path, family, llada_dir, dream_dir):
    """Written, loaded back with its tokenizer files, it decodes what the original does; a record of affix-aware
    training in the original's config.json is not carried over (the deeper model has not been trained so)."""
    src = tmp_path / "src"
    shutil.copytree(llada_dir if family == "llada" else dream_dir, src)
    write_affix_training(src, {"affix_isolation": 0.5, "steps": 1, "init_from": None, "layouts": ["prefix"]})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Model"}}))
    original = load_model(src)
    assert original.config.affix_training is not None and expand_layers(original).config.affix_training is None
    out = expand_checkpoint(src, tmp_path / "deep")
    deeper = load_model(out)
    assert deeper.config.num_layers == 4 and deeper.config.affix_training is None
    assert json.loads((out / "config.json").read_text())["auto_map"] == {"AutoModel": "modeling.Model"}  # kept
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    params = SamplingParams(gen_length=8, block_length=4, steps=8, cache="dual")
    prompt = list(range(3, 23))
    assert reference_generate(deeper, prompt, params).token_ids == reference_generate(original, prompt,
                                                                                      params).token_ids


@pytest.mark.parametrize("every", [0, -1, True, 1.5])
def test_bad_every_is_named(every, llada_dir):
    with pytest.raises(ValueError, match="every must be a positive number of layers"):
        expand_layers(load_model(llada_dir), every)


def test_a_block_causal_family_is_refused(blockdiff_dir):
    with pytest.raises(ValueError, match="fast_dllm_v2 cannot be deepened"):
        expand_layers(load_model(blockdiff_dir))


def test_an_existing_output_is_kept_unless_overwritten(tmp_path, llada_dir):
    out = tmp_path / "deep"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        expand_checkpoint(llada_dir, out)
    assert (out / "keep.txt").read_text() == "mine"
    expand_checkpoint(llada_dir, out, overwrite=True)  # replaced whole: no stale file left beside the new weights
    assert load_model(out).config.num_layers == 4 and not (out / "keep.txt").exists()


def test_the_source_directory_is_not_written_over(tmp_path, llada_dir):
    src = tmp_path / "runs" / "src"
    shutil.copytree(llada_dir, src)
    for out in (src, src.parent):  # the source itself, or a directory that holds it
        with pytest.raises(ValueError, match="needs a directory of its own"):
            expand_checkpoint(src, out, overwrite=True)
    assert load_model(src).config.num_layers == 2


def test_a_bad_source_leaves_the_output_alone(tmp_path):
    out = tmp_path / "deep"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileNotFoundError):
        expand_checkpoint(tmp_path / "missing", out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        expand_checkpoint(tmp_path / "missing", tmp_path / "file")


def test_a_compiled_model_is_refused(llada_dir):
    model = load_model(llada_dir)
    model._layers_compiled = True  # what compile_layers marks; compiling itself is not needed to refuse
    with pytest.raises(ValueError, match="deepen the model as loaded"):
        expand_layers(model)


def test_the_command_names_a_bad_model_path(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "deep")])
    assert exit_info.value.code == 2
    assert "missing" in capsys.readouterr().err
