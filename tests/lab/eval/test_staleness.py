"""Staleness of a cached affix (alone vs in context) and BiCache's depth table profiled from it."""

from __future__ import annotations

import json

import pytest

from acache.affix.bicache import BiCacheProfile
from acache.affix.store import AffixStore
from acache.models.tokenizer import Tokenizer
from acache.sampling_params import SamplingParams
from acache_lab.eval.staleness import measure_staleness, profile_bicache
from acache_lab.tasks.calibration import calibration_prompts
from tests.affix.helpers import affix_run, layouts
from tests.helpers import tokens

BASE = dict(gen_length=16, block_length=8, threshold=0.5)


def test_staleness_layer_zero_is_context_free(family_model):
    s = measure_staleness(AffixStore(family_model), layouts()["infix"], gen_length=16)
    n = family_model.config.num_layers
    assert len(s.key_cosine) == len(s.value_cosine) == n
    assert s.key_cosine[0] == pytest.approx(1.0, abs=1e-5) and s.value_cosine[0] == pytest.approx(1.0, abs=1e-5)
    assert min(s.key_cosine[1:] + s.value_cosine[1:]) < 0.9999  # deeper layers see the context
    assert s.affix_share == pytest.approx(20 / (26 + 16))
    assert s.safe_layers(tau=2.0) == 0 and s.safe_layers(tau=-1.0) == n


def test_profile_table_and_its_use(tmp_path, llada_dir):
    from acache.models.loader import load_model

    model = load_model(llada_dir)
    tok = Tokenizer.from_dir(llada_dir)
    prompts = calibration_prompts(tok, model.config, None, samples=6, seed=1)
    store = AffixStore(model)
    lenient = profile_bicache(store, prompts, gen_length=16, tau=-1.0, bins=4)
    strict = profile_bicache(store, prompts, gen_length=16, tau=2.0, bins=4)
    assert lenient.safe_layers == [2, 2, 2, 2] and strict.safe_layers == [0, 0, 0, 0]
    assert sum(lenient.samples) == 6 and lenient.depth(0.3) == 0 and strict.depth(0.3) == 2
    mid = BiCacheProfile(num_layers=2, tau=0.97, max_share=[0.5, 1.0], safe_layers=[0, 2], samples=[1, 1])
    assert mid.depth(0.2) == 2 and mid.depth(0.7) == 0
    path = lenient.save(tmp_path / "profile.json")
    assert BiCacheProfile.load(path, model) == lenient
    bad = json.loads(path.read_text())
    bad["num_layers"] = 5
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="made for 5 layers"):
        BiCacheProfile.load(tmp_path / "bad.json", model)
    prompt = layouts()["prefix"]
    direct = affix_run(model, prompt, SamplingParams(**BASE, selector="none"), store)
    profiled_params = SamplingParams(**BASE, selector="bicache-profiled")
    profiled = affix_run(model, prompt, profiled_params, store, bicache_profile=lenient)
    assert tokens(profiled) == tokens(direct) and profiled[0].bicache_depth == 0
    with pytest.raises(ValueError, match="needs a BiCache profile"):
        affix_run(model, prompt, SamplingParams(**BASE, selector="bicache-profiled"), store)


def test_profile_bins_match_depth_lookup_at_the_edges(llada_dir, monkeypatch):
    """A share of exactly k/bins is profiled into the bin that depth() reads it from."""
    from acache.models.loader import load_model
    from acache_lab.eval import staleness
    from acache_lab.eval.staleness import Staleness

    model = load_model(llada_dir)
    shares = iter([0.25, 0.5, 0.75, 1.0])
    safe = {0.25: 0, 0.5: 1, 0.75: 2, 1.0: 2}

    def fake(store, prompt, gen_length):
        s = next(shares)
        return Staleness([1.0] * safe[s] + [0.0] * (2 - safe[s]), [1.0] * 2, s)

    monkeypatch.setattr(staleness, "measure_staleness", fake)
    profile = staleness.profile_bicache(AffixStore(model), [layouts()["prefix"]] * 4, 8, tau=0.5, bins=4)
    assert profile.safe_layers == [0, 1, 2, 2] and profile.samples == [1, 1, 1, 1]
    assert [profile.depth(s) for s in (0.25, 0.5, 0.75, 1.0)] == [2, 1, 0, 0]
    with pytest.raises(ValueError, match="bins must be a positive integer"):
        staleness.profile_bicache(AffixStore(model), [layouts()["prefix"]], 8, bins=0)


@pytest.mark.parametrize("argv", [["eval", "staleness", "--examples", "1"], ["bicache-profile", "--samples", "3"]])
@pytest.mark.parametrize("model", ["models/acache-tiny-ssm", "models/acache-tiny-r2lm"])
def test_studies_of_affix_kv_refuse_a_family_without_it_by_name(tmp_path, capsys, argv, model):
    """They ended in an AttributeError from inside (the store is None for these families), after loading."""
    from acache.cli import main

    out = ["--out", str(tmp_path / ("p.json" if argv[0] == "bicache-profile" else "s"))]
    assert main([*argv, "--model", model, *out]) == 2
    assert "measures an affix's K/V computed alone, which a" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--gen-length", "-4"), ("--gen-length", "0"), ("--tau", "5"),
                                           ("--tau", "0"), ("--tau", "nan")])
def test_bicache_profile_refuses_bad_settings_by_name(tmp_path, capsys, option, value):
    from acache.cli import main

    with pytest.raises(SystemExit):
        main(["bicache-profile", "--out", str(tmp_path / "p.json"), option, value])
    assert f"argument {option}: not a" in capsys.readouterr().err and not (tmp_path / "p.json").exists()

