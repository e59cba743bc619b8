"""A short training run from scratch lowers the loss; the shipped checkpoint answers held-out questions."""

from __future__ import annotations

import json

import pytest

from acache.paths import SHIPPED_MODEL
from acache.train.trainer import ModelShape, TrainConfig, train


def test_short_training_run_lowers_the_loss(tmp_path):
    config = TrainConfig(out=str(tmp_path / "m"), steps=120, batch_size=16, lr=3e-3, warmup=10, log_every=20,
                         model=ModelShape(layers=2, hidden_size=64, heads=4, intermediate_size=128),
                         tasks=("qa1",), min_sentences=2, max_sentences=2, bf16=False)
    summary = train(config, progress=False)
    losses = [r["loss"] for r in summary["log"]]
    assert losses[-1] < 0.6 * losses[0], losses
    written = json.loads((tmp_path / "m" / "training_log.json").read_text())
    assert written["steps_done"] == 120 and (tmp_path / "m" / "loss_curve.png").exists()
    from acache.models.loader import load_model

    assert load_model(tmp_path / "m").config.num_layers == 2


def test_bad_training_configs(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 10, "learning_rate": 1}))
    with pytest.raises(ValueError, match="unknown training options"):
        TrainConfig.from_file(path)
    with pytest.raises(ValueError, match="unknown task 'qa9'"):
        TrainConfig(tasks=("qa9",))
    with pytest.raises(ValueError, match="embed_init_std must be positive"):
        TrainConfig(embed_init_std=0.0)
    with pytest.raises(FileNotFoundError, match="training config not found"):
        TrainConfig.from_file(tmp_path / "none.json")


@pytest.mark.skipif(not (SHIPPED_MODEL / "config.json").exists(), reason="no shipped model in this checkout yet")
def test_shipped_model_answers_held_out_questions():
    from acache import LLM
    from acache.eval.tasks import evaluate

    llm = LLM(SHIPPED_MODEL)
    scores = evaluate(llm, examples=20, sentences=6, seed=7, tasks=("qa1",), layouts=("prefix",))
    assert scores[0].accuracy >= 0.9
