"""A model whose config.json records affix-aware training is served by direct reuse by default (no anchors, no
selection), anchors still on request; the model card, the CLI and the demo say which mode a model is in."""

from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from acache import LLM, SamplingParams
from acache.models.config import AFFIX_TRAINING_KEY
from acache.paths import SHIPPED_MODEL
from acache.server.app import create_app

STORY = "mary moved to the kitchen . john went to the garden ."


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """The shipped model's weights with the record affix-aware training leaves (the weights do not matter here:
    the front ends read the record)."""
    out = tmp_path_factory.mktemp("affix-trained")
    for item in SHIPPED_MODEL.iterdir():
        if item.is_file():
            shutil.copy(item, out / item.name)
    config = json.loads((out / "config.json").read_text())
    config[AFFIX_TRAINING_KEY] = {"affix_isolation": 0.5, "steps": 10, "init_from": None, "layouts": ["prefix"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_default_selector_follows_the_record(trained_dir):
    assert LLM(trained_dir).default_selector == "none"
    assert LLM(SHIPPED_MODEL).default_selector == "attention"


def test_a_trained_model_is_served_by_direct_reuse_by_default(trained_dir):
    llm = LLM(trained_dir)
    with TestClient(create_app(llm, "trained")) as client:
        card = client.get("/v1/models/trained").json()
        affix = client.post("/v1/affixes", json={"text": f"story : {STORY}"}).json()["id"]
        body = {"prompt": "question : where is mary ? answer :", "affix": affix, "max_tokens": 2}
        default = client.post("/v1/completions", json=body).json()
        anchored = client.post("/v1/completions", json={**body, "selector": "attention"}).json()
        messages = [{"role": "system", "content": STORY}, {"role": "user", "content": "where is john ?"}]
        client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                         "affix_reuse": "always"}).json()
    assert card["affix_reuse"] == {"default_selector": "none", "affix_trained": True,
                                   "mode": "direct reuse (trained to be reused)"}
    segments = [f"story : {STORY}", "question : where is mary ? answer :"]
    from acache import GEN, Affix

    prompt = [[Affix(segments[0], name="a"), segments[1], GEN]]
    params = {"gen_length": 2, "block_length": 2}
    direct = llm.generate(prompt, SamplingParams(**params, selector="none"), use_tqdm=False)[0]
    with_anchors = llm.generate(prompt, SamplingParams(**params, selector="attention"), use_tqdm=False)[0]
    assert default["choices"][0]["token_ids"] == direct.token_ids
    assert anchored["choices"][0]["token_ids"] == with_anchors.token_ids  # anchors still on request
    # the tokens of the two can agree on a prompt: the completions' own usage says which way each was served
    served = default["usage"]["affix_reuse"]
    assert served["selector"] == "none" and served["anchor_tokens"] == 0
    assert anchored["usage"]["affix_reuse"]["selector"] == "attention"
    assert anchored["usage"]["affix_reuse"]["anchor_tokens"] > 0
    assert chat["usage"]["affix_reuse"]["selector"] == "none" and chat["usage"]["affix_reuse"]["anchor_tokens"] == 0


def test_an_untrained_model_card_says_anchors(tmp_path):
    with TestClient(create_app(LLM(SHIPPED_MODEL), "tiny")) as client:
        card = client.get("/v1/models/tiny").json()
    assert card["affix_reuse"] == {"default_selector": "attention", "affix_trained": False,
                                   "mode": "ACache: anchors chosen by attention"}


def test_the_cli_and_the_demo_name_the_mode(trained_dir, capsys):
    import argparse

    from acache.cli import main
    from acache_lab.demo import main as demo

    assert main(["generate", "--model", str(trained_dir), "--affix", f"story : {STORY}", "--prompt",
                 "question : where is mary ? answer :", "--gen-length", "2", "--block-length", "2"]) == 0
    assert "affix none" in capsys.readouterr().out  # direct reuse, by default for this model
    assert demo(argparse.Namespace(model=str(trained_dir), dtype="auto", device="cpu")) == 0
    assert "trained to be reused (config.json records affix-aware training)" in capsys.readouterr().out
