"""LoRA fine-tuning of a checkpoint with the affix-isolation objective (acache_lab.train.lora), on the tiny random
LLaDA and Dream checkpoints of conftest (byte-level tokenizers, so any ASCII text encodes)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from acache.models.loader import load_model, read_config
from acache.models.tokenizer import Tokenizer
from acache_lab.train.lora import (
    LoraConfig,
    finetune,
    load_finetune_data,
    probe_rows,
    require_peft,
    save_run,
    train_lora,
)
from acache_lab.train.trainer import collate_rows, masked_diffusion_loss

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed (pip install 'acache[lora]')")

NAMES = ("Ada", "Bo", "Cy", "Di", "Eve", "Fu", "Gil", "Hal")
LAYOUT_CYCLE = ("prefix", "infix", "suffix")


def write_data(path, n: int = 8):
    """Records whose answer is read from the affix: a code per name, each layout in turn."""
    with path.open("w") as f:
        for i in range(n):
            name = NAMES[i % len(NAMES)]
            f.write(json.dumps({"affix": f"The code of {name} is {i * 37 % 100:02d}.",
                                "prompt": f"Code of {name}?", "answer": f"{i * 37 % 100:02d}",
                                "layout": LAYOUT_CYCLE[i % 3], "answer_prompt": " A:"}) + "\n")
    return path


def config(model_dir, tmp_path, **kw) -> LoraConfig:
    opts = {"model": str(model_dir), "data": str(write_data(tmp_path / "data.jsonl")), "out": str(tmp_path / "run"),
            "rank": 8, "alpha": 16, "steps": 30, "lr": 1e-2, "warmup": 0, "batch_size": 8, "log_every": 5,
            "device": "cpu", "dtype": "float32", "bf16": False}
    opts.update(kw)
    return LoraConfig(**opts)


def logits_of(model, batch, attention=None):
    with torch.no_grad():
        mask = batch.valid if attention is None else attention
        return model.logits(model(batch.ids, batch.positions, mask).hidden)


@needs_peft
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_loss_falls_and_the_saved_adapter_and_merged_checkpoint_give_the_trained_logits(family, llada_dir,
                                                                                        dream_dir, tmp_path):
    from peft import PeftModel

    model_dir = {"llada": llada_dir, "dream": dream_dir}[family]
    cfg = config(model_dir, tmp_path, merge=True)
    run = train_lora(cfg, progress=False)
    logged = [r["loss"] for r in run.summary["log"]]
    assert len(logged) == 6 and all(loss == loss for loss in logged)  # noisy (t ~ U(0, 1], weighted 1/t)
    assert 0 < run.summary["trainable_parameters"] < run.summary["parameters"]

    base = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    rows, layouts = load_finetune_data(cfg.data, tok, tok.eos_token_id, base.config.max_position_embeddings)
    assert layouts == ["prefix", "infix", "suffix"]
    batch = collate_rows(rows, base.config.pad_token_id)
    isolated = batch.attention(torch.ones(len(rows), dtype=torch.bool))  # every affix computed alone
    trained = run.adapted.get_base_model()

    def loss_of(model, attention):  # every answer column masked, fixed noise: the same loss before and after
        with torch.no_grad():
            return masked_diffusion_loss(model, batch.ids, batch.answer, batch.positions, batch.valid,
                                         base.config.mask_token_id, torch.Generator().manual_seed(0),
                                         masking="all", attention=attention).item()

    for attention in (batch.valid, isolated):  # in context and under direct reuse
        before, after = loss_of(base, attention), loss_of(trained, attention)
        assert after < 0.5 * before, (before, after)
    in_memory = [logits_of(trained, batch), logits_of(trained, batch, isolated)]
    assert not torch.allclose(in_memory[0], logits_of(base, batch), atol=1e-3)  # the adapters changed something

    summary = save_run(run, cfg)
    loaded = PeftModel.from_pretrained(load_model(model_dir), summary["adapter"]).get_base_model()
    merged = load_model(summary["merged"])
    for i, attention in enumerate((None, isolated)):
        torch.testing.assert_close(logits_of(loaded, batch, attention), in_memory[i], atol=1e-6, rtol=0)
        # W + BA scaled, rounded once, against x W + (x B) A: fp32 rounding of logits up to ~7 (measured 1.4e-5)
        scale = in_memory[i].abs().max().item()
        torch.testing.assert_close(logits_of(merged, batch, attention), in_memory[i], atol=1e-5 * scale, rtol=0)

    record = read_config(summary["merged"])[1].affix_training  # the front ends then serve by direct reuse
    assert record["affix_isolation"] == 0.5 and record["steps"] == 30
    assert record["layouts"] == ["prefix", "infix", "suffix"]
    assert record["init_from"] == str(model_dir.resolve())
    assert record["lora"] == {"rank": 8, "alpha": 16, "targets": list(cfg.targets), "data": cfg.data}
    assert Tokenizer.from_dir(summary["merged"]).encode("Code of Ada?") == tok.encode("Code of Ada?")
    written = json.loads((tmp_path / "run" / "finetune_log.json").read_text())
    assert written["steps_done"] == 30 and written["merged"] == summary["merged"]
    assert read_config(model_dir)[1].affix_training is None  # the source is left as it was


@needs_peft
def test_the_command_line_writes_the_adapter_and_the_merged_checkpoint(llada_dir, tmp_path):
    from acache.cli import main

    data = write_data(tmp_path / "data.jsonl", n=3)
    out = tmp_path / "run"
    rc = main(["finetune-affix", "--model", str(llada_dir), "--data", str(data), "--out", str(out), "--steps", "2",
               "--batch-size", "2", "--rank", "2", "--isolation", "1.0", "--merge", "--device", "cpu",
               "--targets", "q_proj,v_proj", "--time-limit-minutes", "5"])
    assert rc == 0
    assert (out / "adapter" / "adapter_config.json").is_file()
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"] and adapter["r"] == 2
    assert read_config(out / "merged")[1].affix_training["affix_isolation"] == 1.0
    # run again into the same --out without --merge: the earlier merged model is not this run's, and goes
    argv = ["finetune-affix", "--model", str(llada_dir), "--data", str(data), "--out", str(out), "--steps", "1",
            "--batch-size", "2", "--rank", "2", "--device", "cpu", "--time-limit-minutes", "5"]
    assert main(argv) == 0
    assert not (out / "merged").exists() and json.loads((out / "finetune_log.json").read_text())["merged"] is None


@needs_peft
def test_the_held_out_probe_reads_reuse_and_context_and_leaves_the_training_alone(llada_dir, tmp_path):
    """The probe reads before training, every eval_every steps and at the end; its step-0 figures are the base
    model's one-shot answers computed here by hand, its reuse and context views differ, its answer loss on the
    training records falls, and a run with it trains the same adapters as a run without it."""
    held = write_data(tmp_path / "held.jsonl", n=5)
    cfg = config(llada_dir, tmp_path, eval_data=str(held), eval_every=12, dropout=0.1)
    run = train_lora(cfg, progress=False)
    probes = run.summary["probe"]
    assert [p["step"] for p in probes] == [0, 12, 24, 30]

    base = load_model(llada_dir)
    tok = Tokenizer.from_dir(llada_dir)
    rows, _ = load_finetune_data(held, tok, tok.eos_token_id, base.config.max_position_embeddings)
    batch = collate_rows(rows, base.config.pad_token_id)
    noisy = torch.where(batch.answer, base.config.mask_token_id, batch.ids)
    for view, attention in (("reuse", batch.attention(torch.ones(len(rows), dtype=torch.bool))),
                            ("context", batch.valid)):
        with torch.no_grad():
            logits = base.logits(base(noisy, batch.positions, attention).hidden)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.ids, reduction="none")
        by_row = (nll * batch.answer).sum(-1) / batch.answer.sum(-1)
        exact = int(((logits.argmax(-1) == batch.ids) | ~batch.answer).all(-1).sum())
        assert probes[0][view]["answer_nll"] == pytest.approx(by_row.mean().item(), abs=1e-5)
        assert round(probes[0][view]["exact"] * len(rows)) == exact
    assert probes[0]["reuse"]["answer_nll"] != pytest.approx(probes[0]["context"]["answer_nll"], abs=1e-4)
    # rows read two at a time (three batches) add up to the same figures
    two_at_a_time = probe_rows(base, rows, base.config.pad_token_id, torch.device("cpu"), 2,
                               base.config.mask_token_id, False)
    for view in ("reuse", "context"):
        assert two_at_a_time[view]["exact"] == probes[0][view]["exact"]
        assert two_at_a_time[view]["answer_nll"] == pytest.approx(probes[0][view]["answer_nll"], abs=1e-5)

    plain = train_lora(config(llada_dir, tmp_path, dropout=0.1), progress=False)  # dropout: eval mode matters
    for (name, a), (_, b) in zip(run.adapted.named_parameters(), plain.adapted.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert plain.summary["probe"] == []

    on_training = train_lora(config(llada_dir, tmp_path, eval_data=cfg.data, eval_every=30), progress=False)
    first, last = on_training.summary["probe"]
    for view in ("reuse", "context"):
        assert last[view]["answer_nll"] < 0.5 * first[view]["answer_nll"], (view, first, last)


@needs_peft
def test_the_command_line_takes_held_out_data(llada_dir, tmp_path, capsys, monkeypatch):
    from acache.cli import main

    data = write_data(tmp_path / "data.jsonl", n=3)
    common = ["finetune-affix", "--model", str(llada_dir), "--data", str(data), "--steps", "2", "--batch-size", "2",
              "--rank", "2", "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "run"), "--eval-data", str(data), "--eval-every", "1"]) == 0
    assert "held out, exact in one shot: reuse " in capsys.readouterr().out
    logged = json.loads((tmp_path / "run" / "finetune_log.json").read_text())
    assert [p["step"] for p in logged["probe"]] == [0, 1, 2]
    assert main([*common, "--out", str(tmp_path / "bad"), "--eval-data", str(tmp_path / "nowhere.jsonl")]) != 0
    err = capsys.readouterr().err
    assert "held-out data not found: " in err and "nowhere.jsonl" in err
    import acache_lab.train.lora as lora

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the missing file was named")

    monkeypatch.setattr(lora, "load_model", no_load)  # named before the weights load: minutes on an 8B model
    with pytest.raises(FileNotFoundError, match="held-out data not found: .*nowhere.jsonl"):
        train_lora(config(llada_dir, tmp_path, eval_data=str(tmp_path / "nowhere.jsonl")), progress=False)
    with pytest.raises(SystemExit):
        main([*common, "--out", str(tmp_path / "bad"), "--eval-every", "0"])


STEPS = 20


@needs_peft
def test_the_neighbour_term_trains_its_maps_reaches_the_adapters_and_stays_out_of_them(llada_dir, tmp_path):
    """With the term, the maps it trained name the affix tokens' neighbours well below fresh maps' cross-entropy on
    the same states; the adapters differ from a run without the term (same seed, data and masking noise: the
    pairs are drawn from a generator of their own) but hold the same tensors; the term's gradient reaches the
    adapters of the layers up to its own and no further; the record says how the term ran; the maps are in neither
    the adapter nor the merged checkpoint."""
    from safetensors.torch import load_file

    from acache_lab.train.isolation import span_owners
    from acache_lab.train.neighbours import NeighbourHeads, neighbour_loss
    from acache_lab.train.trainer import layer_states

    model_dir = llada_dir  # Dream's shifted logits do not reach the term: test_neighbours.py checks unembed on it
    plain = train_lora(config(model_dir, tmp_path, isolation=1.0, steps=STEPS), progress=False)
    cfg = config(model_dir, tmp_path, isolation=1.0, steps=STEPS, neighbours=1.0, neighbour_rank=8, neighbour_pairs=6)
    run = train_lora(cfg, progress=False)
    trained = run.adapted.get_base_model()
    assert run.record["affix_neighbours"] == 1.0 and run.record["affix_neighbour_span"] == 4
    assert run.record["affix_neighbour_layer"] == len(trained.layers) // 4
    assert "affix_neighbours" not in plain.record and plain.heads is None

    tok = Tokenizer.from_dir(model_dir)
    rows, _ = load_finetune_data(cfg.data, tok, tok.eos_token_id, trained.config.max_position_embeddings)
    batch = collate_rows(rows, trained.config.pad_token_id)
    every = torch.ones(len(rows), dtype=torch.bool)
    owner = span_owners(batch.valid, batch.isolated_spans(every))
    layer = run.record["affix_neighbour_layer"]
    with torch.no_grad():
        states = layer_states(trained, batch.ids, batch.positions, batch.attention(every))[layer]
        torch.manual_seed(123)
        fresh = neighbour_loss(trained, NeighbourHeads(trained.config.hidden_size, 4, 8), states, batch.ids, owner)
        learned = neighbour_loss(trained, run.heads, states, batch.ids, owner)
    assert learned < 0.7 * fresh, (float(learned), float(fresh))  # measured 0.56 after 20 steps
    assert not torch.allclose(logits_of(trained, batch), logits_of(plain.adapted.get_base_model(), batch), atol=1e-4)
    trained.zero_grad(set_to_none=True)  # the last training step's gradients
    states = layer_states(trained, batch.ids, batch.positions, batch.attention(every))[layer]
    neighbour_loss(trained, run.heads, states, batch.ids, owner).backward()
    reached = {name.split("layers.")[1].split(".")[0] for name, p in trained.named_parameters()
               if "lora_" in name and p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert reached == {str(i) for i in range(layer + 1)}, reached

    summary = save_run(run, config(model_dir, tmp_path, out=str(tmp_path / "with"), merge=True))
    without = save_run(plain, config(model_dir, tmp_path, out=str(tmp_path / "without")))
    saved = load_file(f"{summary['adapter']}/adapter_model.safetensors")
    assert saved.keys() == load_file(f"{without['adapter']}/adapter_model.safetensors").keys()
    assert read_config(summary["merged"])[1].affix_training["affix_neighbours"] == 1.0
    merged_names = set(load_model(summary["merged"]).state_dict())
    assert merged_names == set(load_model(model_dir).state_dict())


@needs_peft
def test_a_neighbour_layer_past_the_model_is_named(llada_dir, tmp_path):
    layers = len(load_model(llada_dir).layers)
    with pytest.raises(ValueError, match=f"neighbour_layer is the index of one of the model's {layers} layers, "
                                         f"not {layers}"):
        train_lora(config(llada_dir, tmp_path, neighbours=1.0, neighbour_layer=layers), progress=False)


@needs_peft
def test_the_command_line_takes_the_neighbour_term(llada_dir, tmp_path, capsys):
    from acache.cli import main

    data = write_data(tmp_path / "data.jsonl", n=3)
    common = ["finetune-affix", "--model", str(llada_dir), "--data", str(data), "--steps", "2", "--batch-size", "2",
              "--rank", "2", "--isolation", "1.0", "--device", "cpu", "--neighbours", "0.5"]
    assert main([*common, "--out", str(tmp_path / "run"), "--merge", "--neighbour-rank", "0", "--neighbour-span",
                 "2", "--neighbour-pairs", "3", "--neighbour-layer", "1"]) == 0
    record = read_config(tmp_path / "run" / "merged")[1].affix_training
    assert (record["affix_neighbours"], record["affix_neighbour_layer"], record["affix_neighbour_span"]) == (0.5, 1, 2)
    logged = json.loads((tmp_path / "run" / "finetune_log.json").read_text())["config"]
    assert (logged["neighbour_rank"], logged["neighbour_pairs"]) == (None, 3)
    assert main([*common, "--out", str(tmp_path / "bad"), "--neighbour-rank", "-1"]) != 0
    assert "neighbour_rank must be a positive whole number or None, not -1" in capsys.readouterr().err


@needs_peft
def test_the_teacher_term_starts_at_zero_and_keeps_the_in_context_predictions_nearer_the_checkpoints(llada_dir,
                                                                                                      tmp_path):
    """The adapters start as the identity, so the first step's loss is the plain run's (the teacher draws no noise);
    after training, the adapted model's in-context predictions at the answers are nearer the checkpoint's with the
    term than without it, and the record names the checkpoint as the teacher."""
    from acache_lab.train.trainer import teacher_divergence, training_logits

    common = {"isolation": 0.5, "steps": 20, "log_every": 1}
    plain = train_lora(config(llada_dir, tmp_path, **common), progress=False)
    run = train_lora(config(llada_dir, tmp_path, **common, teacher=5.0), progress=False)
    first = [r.summary["log"][0]["loss"] for r in (plain, run)]
    assert first[0] == pytest.approx(first[1], rel=1e-6)
    assert run.summary["log"][-1]["loss"] != pytest.approx(plain.summary["log"][-1]["loss"], rel=1e-3)
    assert run.record["affix_teacher"] == run.record["init_from"] == str(llada_dir.resolve())
    assert run.record["affix_teacher_weight"] == 5.0 and "affix_teacher" not in plain.record

    base = load_model(llada_dir)
    tok = Tokenizer.from_dir(llada_dir)
    rows, _ = load_finetune_data(write_data(tmp_path / "held.jsonl", n=6), tok, tok.eos_token_id,
                                 base.config.max_position_embeddings)
    batch = collate_rows(rows, base.config.pad_token_id)
    noisy = torch.where(batch.answer, torch.full_like(batch.ids, base.config.mask_token_id), batch.ids)

    def distance(adapted):
        with torch.no_grad():
            mine = training_logits(adapted.get_base_model(), noisy, batch.positions, batch.valid)
            theirs = training_logits(base, noisy, batch.positions, batch.valid)
        return float(teacher_divergence(mine, theirs, batch.answer))

    held, free = distance(run.adapted), distance(plain.adapted)
    assert held < 0.5 * free, (held, free)


@needs_peft
def test_the_command_line_takes_the_teacher_term(llada_dir, tmp_path, capsys):
    from acache.cli import main

    data = write_data(tmp_path / "data.jsonl", n=3)
    common = ["finetune-affix", "--model", str(llada_dir), "--data", str(data), "--steps", "2", "--batch-size", "2",
              "--rank", "2", "--device", "cpu"]
    assert main([*common, "--out", str(tmp_path / "run"), "--merge", "--teacher", "0.5"]) == 0
    record = read_config(tmp_path / "run" / "merged")[1].affix_training
    assert (record["affix_teacher"], record["affix_teacher_weight"]) == (str(llada_dir.resolve()), 0.5)
    assert json.loads((tmp_path / "run" / "finetune_log.json").read_text())["config"]["teacher"] == 0.5
    assert main([*common, "--out", str(tmp_path / "bad"), "--teacher", "0.5", "--isolation", "1.0"]) != 0
    assert "with isolation 1 there are none" in capsys.readouterr().err


@needs_peft
def test_answer_room_gives_drawn_rows_eos_columns_after_their_answer(llada_dir, tmp_path, monkeypatch, capsys):
    """The LoRA rows had no room: each answer ended in its one EOS, where a served max_tokens gives more. With
    answer_room, a share of the draws get 1..answer_room more EOS columns in their answer region (a suffix affix
    moved past them), the rest as they were; the command line takes it."""
    import acache_lab.train.lora as lora
    from acache.cli import main

    drawn = []
    collate = lora.collate_rows
    monkeypatch.setattr(lora, "collate_rows", lambda rows, pad: (drawn.extend(rows), collate(rows, pad))[1])
    cfg = config(llada_dir, tmp_path, steps=6, answer_room=5, answer_room_share=0.5)
    train_lora(cfg, progress=False)
    tokenizer = Tokenizer.from_dir(llada_dir)
    eos = read_config(llada_dir)[1].eos_token_id  # the room's EOS, after each answer's own stop token
    stop = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos
    rows = {tuple(r.ids): r for r in load_finetune_data(cfg.data, tokenizer, stop, 512)[0]}
    roomy = [r for r in drawn if r.room]
    assert 0 < len(roomy) < len(drawn) and all(tuple(r.ids) in rows for r in drawn if not r.room)
    for r in roomy:
        end = r.answer_at + r.answer_len
        plain = rows[tuple(r.ids[:end - r.room] + r.ids[end:])]
        assert 1 <= r.room <= 5 and r.ids[end - r.room:end] == [eos] * r.room
        assert r.answer_len == plain.answer_len + r.room
        assert r.spans == tuple((a + r.room * (a >= end - r.room), b + r.room * (a >= end - r.room))
                                for a, b in plain.spans)
    assert any(a >= r.answer_at for r in roomy for a, _ in r.spans)  # a suffix affix moved past the room
    # the teacher term reads the rows attending in context that were given no room
    taught = []
    teacher = lora.Teacher
    monkeypatch.setattr(lora, "Teacher", lambda weight, predict, rows: (taught.append(rows), teacher(weight, predict,
                                                                                                      rows))[1])
    drawn.clear()
    train_lora(config(llada_dir, tmp_path, steps=4, answer_room=5, teacher=1.0, isolation=0.3), progress=False)
    rooms = torch.tensor([r.room for r in drawn]).view(len(taught), -1)
    assert all(not bool((rows & (room > 0)).any()) for rows, room in zip(taught, rooms, strict=True))
    assert bool((rooms > 0).any()) and any(bool(rows.any()) for rows in taught)
    common = ["finetune-affix", "--model", str(llada_dir), "--data", cfg.data, "--steps", "2", "--batch-size", "2",
              "--rank", "2", "--device", "cpu", "--out", str(tmp_path / "cli")]
    assert main([*common, "--answer-room", "3", "--answer-room-share", "1"]) == 0
    logged = json.loads((tmp_path / "cli" / "finetune_log.json").read_text())["config"]
    assert (logged["answer_room"], logged["answer_room_share"]) == (3, 1)


@needs_peft
def test_the_time_limit_stops_the_run(llada_dir, tmp_path, monkeypatch):
    import acache_lab.train.lora as lora

    clock = iter(range(0, 10_000, 50))  # 50 s a reading: the limit of one minute passes after the first step
    monkeypatch.setattr(lora.time, "perf_counter", lambda: float(next(clock)))
    run = train_lora(config(llada_dir, tmp_path, time_limit_minutes=1.0), progress=False)
    assert run.summary["steps_done"] == 1


def bad_data(tmp_path, lines: list[str]):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"affix": "The code is 12.", "prompt": "Code?", "answer": "12", "layout": "prefix"})


@pytest.mark.parametrize("lines, message", [
    ([GOOD, "{not json"], r"bad.jsonl:2: not valid JSON"),
    ([GOOD, "", json.dumps({"affix": "a", "prompt": "b", "answer": "c", "layout": "middle"})],
     r"bad.jsonl:3: unknown layout 'middle'; choose one of prefix, infix, suffix"),
    ([json.dumps({"affix": "a", "prompt": "b"})], r"bad.jsonl:1: the record lacks 'answer'"),
    ([json.dumps(["a", "b"])], r"bad.jsonl:1: a record is a JSON object, not list"),
    ([json.dumps({"affix": "a", "prompt": "b", "answer": 3})], r"bad.jsonl:1: 'answer' must be a string, not int"),
    ([json.dumps({"affix": "", "prompt": "b", "answer": "c"})], r"bad.jsonl:1: affix\s+is empty"),
    ([json.dumps({"affix": "a", "prompt": "b", "answer": ""})], r"bad.jsonl:1: the answer is empty"),
    (["", "   "], r"bad.jsonl holds no records \(fine-tuning data\)"),
])
def test_bad_data_lines_are_reported_with_their_line_number(llada_dir, tmp_path, lines, message):
    tok = Tokenizer.from_dir(llada_dir)
    with pytest.raises(ValueError, match=message):
        load_finetune_data(bad_data(tmp_path, lines), tok, tok.eos_token_id, 512)


def test_a_row_longer_than_the_context_is_refused(llada_dir, tmp_path):
    tok = Tokenizer.from_dir(llada_dir)
    with pytest.raises(ValueError, match=r"bad.jsonl:1: \d+ tokens with the answer, more than the model's context "
                                         r"of 8"):
        load_finetune_data(bad_data(tmp_path, [GOOD]), tok, tok.eos_token_id, 8)


def test_a_missing_data_file_is_named(llada_dir, tmp_path):
    tok = Tokenizer.from_dir(llada_dir)
    with pytest.raises(FileNotFoundError, match="fine-tuning data not found: .*nowhere.jsonl"):
        load_finetune_data(tmp_path / "nowhere.jsonl", tok, tok.eos_token_id, 512)


@needs_peft
def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        train_lora(config(tmp_path / "no-model", tmp_path), progress=False)


def test_without_peft_the_message_names_the_extra(llada_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'acache\[lora\]'"):
        require_peft()
    with pytest.raises(ImportError, match=r"pip install 'acache\[lora\]'"):
        finetune(config(llada_dir, tmp_path), progress=False)


@needs_peft
def test_an_unknown_target_module_is_named(llada_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown LoRA target module 'qkv_proj'; the model's linear modules are "
                                         "down_proj, gate_proj, k_proj, lm_head, o_proj"):
        train_lora(config(llada_dir, tmp_path, targets=("q_proj", "qkv_proj")), progress=False)


@needs_peft
def test_a_block_diffusion_checkpoint_is_refused(blockdiff_dir, tmp_path):
    with pytest.raises(ValueError, match="bidirectional attention families .* not fast_dllm_v2"):
        train_lora(config(blockdiff_dir, tmp_path), progress=False)


@pytest.mark.parametrize("options, message", [
    ({"rank": 0}, "rank and alpha must be positive"),
    ({"alpha": -1.0}, "rank and alpha must be positive"),
    ({"isolation": 1.5}, r"isolation is a share of rows in \[0, 1\]"),
    ({"steps": 0}, "steps, batch_size and log_every must be positive"),
    ({"lr": 0.0}, "lr and grad_clip must be positive"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"time_limit_minutes": 0.0}, "time_limit_minutes must be positive"),
    ({"targets": ()}, "at least one target module"),
    ({"neighbours": -1.0}, "neighbours is a loss weight >= 0"),
    ({"neighbours": float("nan")}, "neighbours is a loss weight >= 0"),
    ({"neighbours": 1.0, "isolation": 0.0}, "neighbours trains the isolated rows' affix states: it needs isolation"),
    ({"neighbour_layer": -1}, "neighbour_layer is a layer index >= 0 or None"),
    ({"neighbour_span": 0}, "neighbour_span must be a positive whole number"),
    ({"neighbour_pairs": 1.5}, "neighbour_pairs must be a positive whole number"),
    ({"neighbour_rank": 0}, "neighbour_rank must be a positive whole number or None"),
    ({"teacher": -0.5}, "teacher is a loss weight >= 0"),
    ({"teacher": float("inf")}, "teacher is a loss weight >= 0"),
    ({"teacher": True}, "teacher is a loss weight >= 0"),
    ({"teacher": 1.0, "isolation": 1.0}, "teacher holds the rows attending in context .* with isolation 1 there"),
    ({"eval_every": 0}, "eval_every is a positive number of steps, not 0"),
    ({"eval_every": 2.5}, "eval_every is a positive number of steps, not 2.5"),
    ({"answer_room": -1}, "answer_room is a number of extra answer columns >= 0"),
    ({"answer_room": 1.5}, "answer_room is a number of extra answer columns >= 0"),
    ({"answer_room": True}, "answer_room is a number of extra answer columns >= 0"),
    ({"answer_room_share": 0.0}, r"answer_room_share is the share of draws given room, in \(0, 1\]"),
    ({"answer_room_share": 1.5}, r"answer_room_share is the share of draws given room"),
    ({"answer_room": 4, "answer_room_share": 1.0, "teacher": 1.0}, "with answer_room_share 1 there are none"),
    ({"lr": float("inf")}, "lr must be a finite number, not inf"),  # trained to a NaN adapter and exited 0
    ({"alpha": float("nan")}, "alpha must be a finite number, not nan"),
    ({"lr": float("nan")}, "lr must be a finite number"),  # refused by AdamW only, after the checkpoint loaded
])
def test_bad_options(options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        LoraConfig(model="m", data="d", out=str(tmp_path), **options)


@needs_peft
def test_a_run_with_no_isolated_row_is_not_recorded_as_trained_for_reuse(llada_dir, tmp_path):
    finetune(config(llada_dir, tmp_path, steps=2, isolation=0.0, merge=True), progress=False)
    assert read_config(tmp_path / "run" / "merged")[1].affix_training is None


@needs_peft
def test_an_output_that_cannot_be_written_is_named_before_the_weights_load(llada_dir, tmp_path, monkeypatch):
    import acache_lab.train.lora as lora

    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(lora, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ValueError, match="cannot write the run's output to .*a-file"):
        train_lora(config(llada_dir, tmp_path, out=str(tmp_path / "a-file" / "run")), progress=False)


def test_the_command_line_names_a_missing_peft_in_one_line(llada_dir, tmp_path, monkeypatch, capsys):
    from acache.cli import main

    monkeypatch.setitem(sys.modules, "peft", None)
    data = write_data(tmp_path / "data.jsonl", n=3)
    assert main(["finetune-affix", "--model", str(llada_dir), "--data", str(data), "--out", str(tmp_path / "r")]) == 2
    assert "pip install 'acache[lora]'" in capsys.readouterr().err


@needs_peft
@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_a_run_stopped_by_a_signal_saves_what_it_trained(llada_dir, tmp_path, monkeypatch, stop):
    """Ctrl-C or a SIGTERM (timeout, a scheduler) left an empty --out: hours of an 8B run lost. Now the run stops
    at the next step and saves its adapters, and its last steps' loss is logged though their window is short."""
    import os
    import signal

    import acache_lab.train.lora as lora

    real, calls = lora.masked_diffusion_loss, []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM if stop == "SIGTERM" else signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora, "masked_diffusion_loss", signalled)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    summary = finetune(config(llada_dir, tmp_path, steps=20, log_every=5), progress=False)
    assert (summary["steps_done"], summary["stopped_by"]) == (3, stop)
    assert [entry["step"] for entry in summary["log"]] == [3]  # the short last window, not nothing
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    # the command says so, and its exit status is not a whole run's (a script chaining on it would merge on)
    from acache.cli import main

    calls.clear()
    argv = ["finetune-affix", "--model", str(llada_dir), "--data", str(write_data(tmp_path / "d.jsonl")), "--out",
            str(tmp_path / "cli"), "--steps", "20", "--batch-size", "2", "--rank", "2", "--device", "cpu"]
    assert main(argv) == {"SIGTERM": 143, "Ctrl-C": 130}[stop]
