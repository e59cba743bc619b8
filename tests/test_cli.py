"""The ``acache`` command line, run in-process."""

from __future__ import annotations

import json
import shutil

import pytest

from acache.cli import build_parser, main
from acache.models.loader import load_model


def test_make_random_checkpoint_and_generate(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-random-checkpoint", "--family", "dream", "--out", str(out), "--layers", "3",
                 "--hidden-size", "32", "--heads", "4", "--kv-heads", "2", "--shards", "2"]) == 0
    model = load_model(out)
    assert model.config.num_layers == 3 and model.config.num_kv_heads == 2
    assert (out / "model.safetensors.index.json").exists()
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "hello", "--prompt", "bye", "--gen-length", "16",
                 "--block-length", "8", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in lines] == ["hello", "bye"]
    assert all(r["nfe"] >= 2 for r in lines)


@pytest.mark.parametrize("std", ["nan", "inf", "0", "-0.1"])
def test_a_random_checkpoint_of_unusable_weights_is_refused(tmp_path, capsys, std):
    """--std nan wrote a checkpoint of NaNs and exited 0."""
    assert main(["make-random-checkpoint", "--family", "llada", "--out", str(tmp_path / "c"), "--std", std]) == 2
    assert "std must be a positive finite number" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_the_state_cache_families_take_the_shape_they_are_asked_for(tmp_path, capsys):
    """--kv-heads and --max-seq-len were ignored for them (R2LM wrote 4 K/V heads and 4096 positions whatever was
    asked); the state-space family, which has no attention, refuses --kv-heads by name."""
    r2lm, ssm = tmp_path / "r2lm", tmp_path / "ssm"
    assert main(["make-random-checkpoint", "--family", "r2lm", "--out", str(r2lm), "--hidden-size", "32",
                 "--heads", "4", "--kv-heads", "2", "--max-seq-len", "512"]) == 0
    config = load_model(r2lm).config
    assert (config.num_kv_heads, config.max_position_embeddings) == (2, 512)
    assert main(["make-random-checkpoint", "--family", "blockdiff_ssm", "--out", str(ssm), "--hidden-size", "32",
                 "--max-seq-len", "1024"]) == 0
    assert load_model(ssm).config.max_position_embeddings == 1024
    assert main(["make-random-checkpoint", "--family", "blockdiff_ssm", "--out", str(tmp_path / "no"),
                 "--kv-heads", "2"]) == 2
    assert "kv_heads shapes attention, which the blockdiff_ssm family has not" in capsys.readouterr().err
    assert main(["make-random-checkpoint", "--family", "blockdiff_ssm", "--out", str(tmp_path / "default"),
                 "--hidden-size", "32"]) == 0
    assert load_model(tmp_path / "default").config.max_position_embeddings == 65536
    with pytest.raises(SystemExit):  # 0 became the default without a word
        main(["make-random-checkpoint", "--family", "llada", "--out", str(tmp_path / "zero"), "--max-seq-len", "0"])
    assert "argument --max-seq-len: not a positive integer: '0'" in capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path, capsys, llada_dir):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "error: model directory not found" in capsys.readouterr().err
    assert main(["generate", "--model", str(llada_dir), "--prompt", "x", "--gen-length", "30"]) == 2
    assert "gen_length (30) must be a multiple of block_length (32)" in capsys.readouterr().err
    assert main(["generate", "--model", str(llada_dir), "--prompt", "x", "--threshold", "2"]) == 2
    assert "threshold must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--model", str(llada_dir), "--prompt", "x", "--affix-cache", str(tmp_path / "c"),
                 "--tensor-parallel-size", "2"]) == 2
    assert "error: --affix-cache is not supported with --tensor-parallel-size > 1" in capsys.readouterr().err


def test_an_affix_cache_for_a_family_that_shares_none_is_refused_before_any_work(tmp_path, capsys):
    """A state-space model holds no affix K/V: --affix-cache crashed on an AttributeError after generating, its
    answers never printed; LLM.save_affix_cache and the server's --affix-cache-dir name the reason."""
    from acache import LLM
    from acache.paths import SHIPPED_MODEL
    from acache.server.app import create_app

    ssm = SHIPPED_MODEL.parent / "acache-tiny-ssm"
    assert main(["generate", "--model", str(ssm), "--prompt", "question : where is mary ? answer :",
                 "--affix-cache", str(tmp_path / "c"), "--gen-length", "4", "--block-length", "4"]) == 2
    captured = capsys.readouterr()
    assert "error: --affix-cache: the blockdiff_ssm family shares no affix K/V" in captured.err
    assert "Traceback" not in captured.err and not (tmp_path / "c").exists()
    (tmp_path / "c").mkdir()  # an existing directory: the same words, not LLM's affix_cache_dir
    assert main(["generate", "--model", str(ssm), "--prompt", "question : where is mary ? answer :",
                 "--affix-cache", str(tmp_path / "c"), "--gen-length", "4", "--block-length", "4"]) == 2
    assert "error: --affix-cache: the blockdiff_ssm family shares no affix K/V" in capsys.readouterr().err
    llm = LLM(ssm)
    with pytest.raises(ValueError, match="shares no affix K/V"):
        llm.save_affix_cache(tmp_path / "d")
    with pytest.raises(ValueError, match="--affix-cache-dir: the blockdiff_ssm family shares no affix K/V"):
        create_app(llm, "ssm", affix_cache_dir=tmp_path / "d")


def test_generate_with_an_affix_and_a_persistent_cache(tmp_path, capsys, llada_dir):
    cache = tmp_path / "affixes"
    args = ["generate", "--model", str(llada_dir), "--prompt", "Where is Mary?", "--prompt", "Where is John?",
            "--affix", "Mary moved to the kitchen. John went to the garden.", "--layout", "infix",
            "--answer-prompt", " Answer:", "--selector", "attention", "--anchor-ratio", "0.25",
            "--gen-length", "16", "--block-length", "8", "--affix-cache", str(cache), "--json"]
    assert main(args) == 0
    first = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["affix"]["misses"] for r in first] == [1, 0] and [r["affix"]["hits"] for r in first] == [0, 1]
    n_affix = len("Mary moved to the kitchen. John went to the garden.")  # byte-level tokenizer
    assert all(len(r["affix"]["anchors"]) == -(-n_affix // 4) for r in first)
    assert (cache / "manifest.json").exists()
    assert main(args) == 0  # a restart: the affix comes from disk
    second = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["affix"]["hits"] for r in second] == [1, 1]
    assert [r["token_ids"] for r in second] == [r["token_ids"] for r in first]


def test_generate_answers_beside_a_damaged_cache_and_says_when_its_save_fails(tmp_path, capsys, llada_dir,
                                                                              monkeypatch):
    """One bad entry made every later run refuse every prompt (the strict load); a save that failed on a full disk
    ended in a traceback after the answers."""
    cache = tmp_path / "affixes"
    args = ["generate", "--model", str(llada_dir), "--prompt", "Where is Mary?", "--affix",
            "Mary moved to the kitchen.", "--selector", "attention", "--gen-length", "8", "--block-length", "8",
            "--affix-cache", str(cache), "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = json.loads((cache / "manifest.json").read_text())
    tensors = cache / manifest["tensors"]
    blob = bytearray(tensors.read_bytes())
    blob[-5] ^= 0x10  # a bit flipped in the last tensor's bytes
    tensors.write_bytes(bytes(blob))
    assert main(args) == 0
    captured = capsys.readouterr()
    again = json.loads(captured.out.strip().splitlines()[-1])
    assert again["token_ids"] == first["token_ids"] and again["affix"]["misses"] == 1  # set aside, computed again
    assert "set aside" in captured.err and list((cache / "quarantine").iterdir())

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("acache.affix.persistence.write_atomic", full)
    assert main(args) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["token_ids"] == first["token_ids"]  # answered first
    assert f"acache generate: error: could not save the affix cache to {cache}: [Errno 28] No space left" in \
        captured.err and "Traceback" not in captured.err


def test_generate_reuses_an_affix_with_the_default_selector(capsys, llada_dir):
    """With --affix and no --selector the command reuses it with the server's default selector, chosen inside
    the refresh; --anchor-pass two chooses by a pass of its own, and a pass a selector lacks is refused by name."""
    from acache.policies import DEFAULT_SELECTOR

    base = ["generate", "--model", str(llada_dir), "--prompt", "Where is Mary?", "--affix",
            "Mary moved to the kitchen. John went to the garden.", "--gen-length", "8", "--block-length", "8",
            "--json"]
    runs = {}
    for extra in ([], ["--selector", DEFAULT_SELECTOR], ["--anchor-pass", "two"], ["--affix-policy", "none"],
                  ["--selector", "none"]):
        assert main(base + extra) == 0
        runs[tuple(extra)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plain, named, two, old_flag, direct = runs.values()
    assert len(plain["affix"]["anchors"]) == -(-51 // 5)  # ceil(0.2 * 51): reused, with anchors
    assert plain["token_ids"] == named["token_ids"] and plain["affix"]["anchors"] == named["affix"]["anchors"]
    assert old_flag["affix"]["anchors"] == direct["affix"]["anchors"] == []  # --selector's former name still works
    assert old_flag["token_ids"] == direct["token_ids"] and old_flag["affix"]["selector"] == "none"
    assert len(two["affix"]["anchors"]) == len(plain["affix"]["anchors"])
    assert main(base + ["--selector", "kv-deviation", "--anchor-pass", "one"]) == 2
    assert "'kv-deviation' has no one-pass form" in capsys.readouterr().err
    assert main(base + ["--anchor-depth", "0.5"]) == 0  # a 2-layer model scores its one layer at any depth
    shallow = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shallow["token_ids"] == plain["token_ids"] and shallow["affix"]["anchors"] == plain["affix"]["anchors"]
    assert shallow["affix"]["anchor_depth"] == 0.5 and plain["affix"]["anchor_depth"] == 1.0
    for bad, why in ((["--anchor-depth", "0"], "anchor_depth must be a number in (0, 1], got 0.0"),
                     (["--anchor-depth", "2"], "anchor_depth must be a number in (0, 1], got 2.0"),
                     (["--anchor-depth", "0.5", "--anchor-pass", "two"], "needs anchor_pass 'one'")):
        assert main(base + bad) == 2
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--anchor-depth", "half"])
    assert "--anchor-depth: invalid float value: 'half'" in capsys.readouterr().err


def test_bicache_profile_command(tmp_path, capsys, llada_dir):
    out = tmp_path / "profile.json"
    assert main(["bicache-profile", "--model", str(llada_dir), "--out", str(out), "--samples", "4",
                 "--bins", "2", "--gen-length", "8"]) == 0
    profile = json.loads(out.read_text())
    assert profile["num_layers"] == 2 and len(profile["safe_layers"]) == 2 and sum(profile["samples"]) == 4
    printed = capsys.readouterr()
    assert "layers reusable" in printed.out and "bicache-profile: 100%" in printed.err  # its progress, as it goes
    assert main(["generate", "--model", str(llada_dir), "--prompt", "q", "--affix", "shared", "--selector",
                 "bicache-profiled", "--gen-length", "8", "--block-length", "8"]) == 2
    assert "needs a BiCache profile" in capsys.readouterr().err


def test_model_defaults_to_the_shipped_one(capsys, monkeypatch, tmp_path):
    from acache import paths

    monkeypatch.setattr(paths, "SHIPPED_MODEL", tmp_path / "missing")
    assert main(["generate", "--prompt", "x"]) == 2
    assert "no shipped model at" in capsys.readouterr().err


def test_eval_study_commands_check_their_input(capsys, monkeypatch, tmp_path, llada_dir):
    from acache import paths

    monkeypatch.setattr(paths, "SHIPPED_MODEL", tmp_path / "missing")
    for study in ("accuracy", "staleness"):
        assert main(["eval", study]) == 2
        assert "no shipped model at" in capsys.readouterr().err
    assert main(["eval", "accuracy", "--model", str(llada_dir), "--tasks", "qa9"]) == 2
    assert "unknown task 'qa9'" in capsys.readouterr().err
    assert main(["eval", "accuracy", "--model", str(llada_dir), "--layouts", "middle"]) == 2
    assert "unknown layout 'middle'" in capsys.readouterr().err
    for study in ("accuracy", "tasks"):  # an answer's room shorter than a task's region, or not whole blocks
        assert main(["eval", study, "--model", str(tmp_path / "never-read"), "--tasks", "qa1,arith",
                     "--gen-length", "4"]) == 2
        assert "gen_length 4 is shorter than arith's answer region (6 columns)" in capsys.readouterr().err
        assert main(["eval", study, "--model", str(tmp_path / "never-read"), "--gen-length", "48"]) == 2
        assert "gen_length 48 is not a whole number of blocks of 32" in capsys.readouterr().err


def test_train_runs_several_configs_in_order_and_reads_them_all_first(tmp_path, capsys):
    shape = {"layers": 1, "hidden_size": 32, "heads": 2, "intermediate_size": 64}
    common = {"model": shape, "batch_size": 2, "warmup": 1, "bf16": False, "tasks": ["qa1"], "log_every": 1}
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps({**common, "out": str(tmp_path / "a"), "steps": 3}))
    second.write_text(json.dumps({**common, "out": str(tmp_path / "b"), "steps": 2, "init_from": str(tmp_path / "a")}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**common, "out": str(tmp_path / "c"), "steps": 2, "tasks": ["qa2"]}))

    assert main(["train", "--config", str(first), "--config", str(bad)]) == 2
    assert "unknown task 'qa2'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()  # the bad second config stopped the run before the first trained

    assert main(["train", "--config", str(first), "--config", str(second), "--out", str(tmp_path / "final")]) == 0
    out = capsys.readouterr().out
    assert "2 configs," in out and "min of training in all" in out
    logs = [json.loads((tmp_path / d / "training_log.json").read_text()) for d in ("a", "final")]
    assert [log["steps_done"] for log in logs] == [3, 2]
    assert logs[1]["config"]["init_from"] == str(tmp_path / "a") and not (tmp_path / "b").exists()


def test_train_resume_skips_finished_configs_and_refuses_a_missing_teacher_first(tmp_path, capsys):
    """--resume skips a config whose finished log is this config (an option added since read at its default), unless
    a config before it in the command trained what it starts from; a teacher that is no checkpoint and that no
    earlier config writes is refused before anything trains."""
    shape = {"layers": 1, "hidden_size": 32, "heads": 2, "intermediate_size": 64}
    common = {"model": shape, "batch_size": 2, "warmup": 1, "bf16": False, "tasks": ["qa1"], "log_every": 1}
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps({**common, "out": str(tmp_path / "a"), "steps": 2}))
    second.write_text(json.dumps({**common, "out": str(tmp_path / "b"), "steps": 2, "init_from": str(tmp_path / "a"),
                                  "affix_isolation": 0.5, "affix_teacher": str(tmp_path / "a")}))
    assert main(["train", "--config", str(second)]) == 2
    assert f"init_from {tmp_path / 'a'} is no checkpoint" in capsys.readouterr().err
    taught = tmp_path / "taught.json"
    taught.write_text(json.dumps({**common, "out": str(tmp_path / "t"), "steps": 2, "affix_isolation": 0.5,
                                  "affix_teacher": str(tmp_path / "a")}))
    assert main(["train", "--config", str(taught)]) == 2
    assert f"affix_teacher {tmp_path / 'a'} is no checkpoint" in capsys.readouterr().err
    assert main(["train", "--config", str(first), "--config", str(second)]) == 0  # the first writes the teacher
    log = tmp_path / "a" / "training_log.json"
    logged = json.loads(log.read_text())
    del logged["config"]["affix_bridge"]  # as a log written before the option existed
    log.write_text(json.dumps(logged))
    capsys.readouterr()
    assert main(["train", "--config", str(first), "--config", str(second), "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'a'}: finished before, skipped" in out and f"{tmp_path / 'b'}: finished before" in out
    # the guards of the machine's budget changed on both (as a slow machine's user raises them): nothing retrains
    first.write_text(json.dumps({**common, "out": str(tmp_path / "a"), "steps": 2, "time_limit_minutes": 120,
                                 "save_every": 1}))
    second.write_text(json.dumps({**common, "out": str(tmp_path / "b"), "steps": 2, "init_from": str(tmp_path / "a"),
                                  "affix_isolation": 0.5, "affix_teacher": str(tmp_path / "a"),
                                  "time_limit_minutes": 120}))
    assert main(["train", "--config", str(first), "--config", str(second), "--resume"]) == 0
    assert capsys.readouterr().out.count("finished before, skipped") == 2
    # the first retrained (its config changed): the second, which starts from it and reads it as teacher, trains again
    first.write_text(json.dumps({**common, "out": str(tmp_path / "a"), "steps": 3}))
    before = (tmp_path / "b" / "model.safetensors").read_bytes()
    assert main(["train", "--config", str(first), "--config", str(second), "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"{tmp_path / 'a'}: finished before" not in captured.out
    assert f"{tmp_path / 'a'}: finished before with another config" in captured.err  # said, not silent
    assert f"{tmp_path / 'b'}: finished before, but {tmp_path / 'a'} was trained again: training it again" in \
        captured.out
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != before
    # a kill between a later save's log and its weights: a log that says finished, and no weights beside it
    (tmp_path / "b" / "model.safetensors").unlink()
    assert main(["train", "--config", str(first), "--config", str(second), "--resume"]) == 0
    captured = capsys.readouterr()
    assert f"{tmp_path / 'b'}: finished before, but its weights are gone" in captured.err
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_train_resume_says_when_a_stopped_run_has_no_state_to_resume(tmp_path, capsys):
    """A kill between the log and the resume state left a run marked stopped with nothing to resume: --resume
    trained it from the start without a word."""
    shape = {"layers": 1, "hidden_size": 32, "heads": 2, "intermediate_size": 64}
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": shape, "batch_size": 2, "warmup": 1, "bf16": False, "tasks": ["qa1"],
                                  "log_every": 1, "out": str(tmp_path / "a"), "steps": 2}))
    assert main(["train", "--config", str(config)]) == 0
    log = tmp_path / "a" / "training_log.json"
    log.write_text(json.dumps({**json.loads(log.read_text()), "interrupted": True}))
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--resume"]) == 0
    assert "stopped before without a resume state (a kill cut its save): training it from the start" in \
        capsys.readouterr().err
    assert json.loads(log.read_text())["interrupted"] is False


def test_train_resume_retrains_a_soup_stage_when_any_member_was_trained_again(tmp_path, capsys):
    """A config whose ``init_from`` lists several checkpoints starts from their mean; --resume skips it while no member
    changed, and trains it again when a config before it in the command retrained one of them."""
    shape = {"layers": 1, "hidden_size": 32, "heads": 2, "intermediate_size": 64}
    common = {"model": shape, "batch_size": 2, "warmup": 1, "bf16": False, "tasks": ["qa1"], "log_every": 1}
    files = {name: tmp_path / f"{name}.json" for name in ("a", "b", "soup")}
    files["a"].write_text(json.dumps({**common, "out": str(tmp_path / "a"), "steps": 2}))
    files["b"].write_text(json.dumps({**common, "out": str(tmp_path / "b"), "steps": 3, "seed": 1}))
    files["soup"].write_text(json.dumps({**common, "out": str(tmp_path / "soup"), "steps": 2,
                                         "init_from": [str(tmp_path / "a"), str(tmp_path / "b")]}))
    command = ["train", *(arg for f in files.values() for arg in ("--config", str(f)))]
    assert main(command) == 0
    capsys.readouterr()
    assert main([*command, "--resume"]) == 0
    assert capsys.readouterr().out.count("finished before, skipped") == 3
    before = (tmp_path / "soup" / "model.safetensors").read_bytes()
    files["b"].write_text(json.dumps({**common, "out": str(tmp_path / "b"), "steps": 4, "seed": 1}))
    assert main([*command, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'a'}: finished before, skipped" in out
    assert f"{tmp_path / 'soup'}: finished before, but {tmp_path / 'b'} was trained again: training it again" in out
    assert (tmp_path / "soup" / "model.safetensors").read_bytes() != before
    # a misspelt member, or one that is the stage's own out, is refused before the first config trains
    misspelt = ([str(tmp_path / "a"), str(tmp_path / "bb")], f"init_from {tmp_path / 'bb'} is no checkpoint")
    for members, error in (misspelt, ([str(tmp_path / "a"), str(tmp_path / "soup")], "the run's own out")):
        files["soup"].write_text(json.dumps({**common, "out": str(tmp_path / "soup"), "steps": 2,
                                             "init_from": members}))
        shutil.rmtree(tmp_path / "a")
        assert main(command) == 2
        assert error in capsys.readouterr().err and not (tmp_path / "a").exists()
        assert main(["train", "--config", str(files["a"])]) == 0


def test_train_resume_of_a_stopped_soup_stage(tmp_path, capsys, monkeypatch):
    """A stopped soup stage resumes from its own weights even when a member is gone, and starts over when a config
    before it in the command retrained a member; a member inside an earlier config's out (a save_every step) counts
    as written by it."""
    import os
    import signal

    from acache_lab.train.trainer import Batcher

    shape = {"layers": 1, "hidden_size": 32, "heads": 2, "intermediate_size": 64}
    common = {"model": shape, "batch_size": 2, "warmup": 1, "bf16": False, "tasks": ["qa1"], "log_every": 1}
    files = {name: tmp_path / f"{name}.json" for name in ("a", "b", "soup")}
    files["a"].write_text(json.dumps({**common, "out": str(tmp_path / "a"), "steps": 2}))
    files["b"].write_text(json.dumps({**common, "out": str(tmp_path / "b"), "steps": 4, "seed": 1, "save_every": 2}))
    files["soup"].write_text(json.dumps({**common, "out": str(tmp_path / "soup"), "steps": 4,
                                         "init_from": [str(tmp_path / "a"), str(tmp_path / "b" / "step-2")]}))
    command = ["train", *(arg for f in files.values() for arg in ("--config", str(f)))]
    real, calls = Batcher.batch, {"n": 0}

    def batch(self, step):
        if self.config.out == str(tmp_path / "soup") and step == 2 and calls["n"] == 0:
            calls["n"] += 1
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, step)

    monkeypatch.setattr(Batcher, "batch", batch)
    assert main(command) == 130  # b/step-2 is no checkpoint yet, but b writes it: accepted, then the soup stopped
    capsys.readouterr()
    shutil.rmtree(tmp_path / "a")
    assert main(["train", "--config", str(files["soup"]), "--resume"]) == 0  # its own weights: a is not read
    assert "trained 4 steps" in capsys.readouterr().out
    calls["n"] = 0
    assert main(command) == 130
    capsys.readouterr()
    files["b"].write_text(json.dumps({**common, "out": str(tmp_path / "b"), "steps": 4, "seed": 2, "save_every": 2}))
    assert main([*command, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'soup'}: stopped before, but {tmp_path / 'b' / 'step-2'} was trained again" in out
    assert not (tmp_path / "soup" / "resume_state.pt").exists()


def test_free_text_and_chat_on_the_shipped_model(capsys):
    """The default model reads ordinary text ('Mary?' is 'mary ?'), answers a chat in its own template, and
    names the words it cannot read instead of a traceback."""
    assert main(["generate", "--prompt", "where is mary?", "--gen-length", "2", "--block-length", "2"]) == 0
    assert "> where is mary?" in capsys.readouterr().out
    story = "story : mary moved to the kitchen . john went to the garden . question : Where is Mary? answer :"
    assert main(["generate", "--prompt", story, "--gen-length", "2", "--block-length", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "kitchen"
    assert main(["generate", "--prompt", "where is zorro?"]) == 2
    err = capsys.readouterr().err
    assert "no token for 1 word(s) of the text: 'zorro'" in err and "Traceback" not in err
    assert main(["generate", "--prompt", "where is mary?", "--chat", "--gen-length", "2", "--block-length", "2"]) == 0


def test_vllm_style_options():
    import argparse

    import pytest

    from acache.cli import build_parser, parse_size

    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096 and parse_size("64 kib") == 64 << 10
    for bad in ("two", "3XB", "-1GiB"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_size(bad)
    args = build_parser().parse_args(["serve", "some/model", "--kv-cache-memory", "2GiB", "--max-model-len", "128"])
    assert (args.model_path, args.kv_cache_memory, args.max_model_len) == ("some/model", 2 << 30, 128)
    assert (args.dtype, args.device, args.max_request_bytes) == ("auto", "auto", 1 << 20)
    assert "(default: 8000)" in build_parser()._subparsers._group_actions[0].choices["serve"].format_help()


@pytest.mark.parametrize("flags, message", [
    (["--auto-reuse", "maybe"], "argument --auto-reuse: invalid choice: 'maybe'"),
    (["--reuse-checks", "0"], "argument --reuse-checks: not a positive integer: '0'"),
    (["--reuse-audit-every", "-1"], "argument --reuse-audit-every: not a non-negative integer: '-1'"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
])
def test_bad_serve_reuse_and_log_flags_are_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert message in capsys.readouterr().err


def test_serve_reuse_defaults_and_help():
    args = build_parser().parse_args(["serve"])
    assert (args.auto_reuse, args.reuse_checks, args.reuse_audit_every, args.log_level) == ("verified", 4, 16,
                                                                                            "warning")
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--auto-reuse {verified,on,off}" in text and "reuse mismatches" in text


def test_version_and_a_model_given_twice(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("acache ")
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "the model is given twice" in capsys.readouterr().err


def test_dtype_auto_and_max_model_len(llada_dir):
    import pytest
    import torch

    from acache import LLM, SamplingParams

    llm = LLM(llada_dir, dtype="auto", device="auto", max_model_len=40)
    assert llm.model.dtype == torch.float32 and llm.engine.max_model_len == 40
    with pytest.raises(ValueError, match="exceed the context of 40"):
        llm.generate([list(range(1, 30))], SamplingParams(gen_length=16, block_length=8))
    with pytest.raises(ValueError, match="max_model_len must be an integer in 1..512"):
        LLM(llada_dir, max_model_len=10_000)


def test_an_empty_answer_says_why(capsys):
    """The shipped model ends at once on a question with no story: the command says so instead of printing ''."""
    assert main(["generate", "--chat", "--prompt", "where is mary ?", "--gen-length", "2", "--block-length", "2"]) == 0
    out = capsys.readouterr().out
    assert "(no text: the model's first token was its end-of-text token '<|endoftext|>'" in out
    # the command the message suggests answers
    assert main(["generate", "--affix", "story : mary moved to the kitchen .", "--prompt",
                 "question : where is mary ? answer :", "--gen-length", "2", "--block-length", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "kitchen"


def test_outputs_say_why_they_ended():
    from acache import LLM, SamplingParams
    from acache.paths import SHIPPED_MODEL

    llm = LLM(SHIPPED_MODEL)
    stopped, full = llm.generate(["question : where is mary ? answer :",
                                  "story : mary moved to the kitchen . question : where is mary ? answer :"],
                                 SamplingParams(gen_length=4, block_length=4), use_tqdm=False)
    assert (stopped.text, stopped.finish_reason, stopped.stop_token_id) == ("", "stop", llm.config.eos_token_id)
    assert full.text == "kitchen" and full.finish_reason == "stop"
    filled = llm.generate(["story : mary has 5 pencils . john has 9 pencils . question : how many pencils do john "
                           "and mary have ? answer :"], SamplingParams(gen_length=2, block_length=2),
                          use_tqdm=False)[0]
    assert len(filled.token_ids) == 2 and filled.finish_reason == "length"


def test_generate_says_which_prompt_failed_and_exits_non_zero(capsys, llada_dir, monkeypatch):
    from dataclasses import replace

    from acache import LLM

    generate = LLM.generate

    def second_fails(self, prompts, params, **kwargs):
        outs = generate(self, prompts, params, **kwargs)
        return [outs[0], replace(outs[1], text="", token_ids=[], error="the runner failed: boom")]

    monkeypatch.setattr(LLM, "generate", second_fails)
    argv = ["generate", "--model", str(llada_dir), "--prompt", "hello", "--prompt", "bye", "--gen-length", "8",
            "--block-length", "8"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "> bye\nerror: the runner failed: boom" in out and "1 of 2 prompts failed" in err
    assert main([*argv, "--json"]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["finish_reason"], r["error"]) for r in records] == [("length", None),
                                                                   ("error", "the runner failed: boom")]


@pytest.mark.parametrize("flag, value, message", [
    ("--port", "99999", "not a port number (1-65535): '99999'"),
    ("--page-size", "0", "not a positive integer: '0'"),
    ("--max-num-seqs", "0", "not a positive integer: '0'"),
])
def test_serve_refuses_a_bad_flag_by_name(capsys, llada_dir, flag, value, message):
    with pytest.raises(SystemExit):
        main(["serve", str(llada_dir), flag, value])
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_page_size_that_is_not_positive_is_refused_at_construction(llada_dir):
    from acache import LLM

    for size in (0, -3):
        with pytest.raises(ValueError, match=f"page_size must be a positive integer, got {size}"):
            LLM(llada_dir, page_size=size)


def test_generate_chat_with_an_affix_reuses_it_as_the_system_prompt(llada_dir, capsys):
    """--chat --affix was refused with advice to call LLM.chat_prompt, which a CLI user cannot: the affix is now the
    chat's system prompt, reused as the server reuses one; a layout that cannot hold in a chat is named."""
    from acache import LLM, SamplingParams

    story = "Mary moved to the kitchen. John went to the garden."
    args = ["generate", "--model", str(llada_dir), "--prompt", "Where is Mary?", "--prompt", "Where is John?",
            "--affix", story, "--chat", "--gen-length", "8", "--block-length", "4", "--json"]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    llm = LLM(llada_dir)
    prompts = [llm.chat_prompt([{"role": "system", "content": story}, {"role": "user", "content": q}])
               for q in ("Where is Mary?", "Where is John?")]
    want = llm.generate(prompts, SamplingParams(gen_length=8, block_length=4, selector="attention"), use_tqdm=False)
    assert [r["token_ids"] for r in records] == [w.token_ids for w in want]
    assert [r["affix"]["misses"] for r in records] == [1, 0] and records[0]["affix"]["selector"] == "attention"
    assert main([*args, "--layout", "suffix"]) == 2
    assert "--layout 'suffix' and --answer-prompt do not apply" in capsys.readouterr().err


def test_serve_on_a_port_in_use_is_named_before_the_model_loads(llada_dir, capsys, monkeypatch):
    """The banner said 'serving ... on' and the model loaded before uvicorn found the port taken (exit 3, a
    traceback of its own): the address is now checked first."""
    import socket

    import acache

    monkeypatch.setattr(acache, "LLM", lambda *a, **k: pytest.fail("the model loaded before the port was checked"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(llada_dir), "--host", "127.0.0.1", "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert f"cannot serve on 127.0.0.1:{port}" in captured.err and "serving" not in captured.out


def test_generate_with_an_affix_on_a_state_space_model_reads_it_with_the_request(capsys):
    """Its cache is built per request, so no selector applies: the CLI's default selector refused every --affix on
    such a model; now the affix is read with the prompt, as the server reads it, and the answer is the one the
    affix's text written before the prompt gives."""
    from acache.paths import SHIPPED_MODEL

    ssm = str(SHIPPED_MODEL.parent / "acache-tiny-ssm")
    common = ["--model", ssm, "--gen-length", "2", "--block-length", "2", "--json"]
    assert main(["generate", *common, "--affix", "john went to the garden .", "--prompt", " where is john ?"]) == 0
    with_affix = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "--prompt", "john went to the garden . where is john ?"]) == 0
    assert with_affix["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert with_affix["text"].startswith("garden")
    named = ["--affix", "mary went .", "--prompt", " where is mary ?", "--selector", "attention"]
    assert main(["generate", *common, *named]) == 2
    assert "affix reuse (selector='attention') is not supported for the blockdiff_ssm family" in capsys.readouterr().err
