"""The accuracy sweep and the staleness profile, end to end on a tiny model with the task tokenizer."""

from __future__ import annotations

import json

import pytest

from acache import LLM
from acache_lab.eval.accuracy import sweep, write_report
from acache_lab.eval.staleness import plot_profile, profile


@pytest.fixture(scope="module")
def task_llm(task_model_dir):
    return LLM(task_model_dir)


def test_sweep_cells_and_report(task_llm, tmp_path, monkeypatch):
    decoded = {}  # (selector, ratio, prompts) -> the tokens the sweep's requests decoded
    generate = task_llm.generate

    def recording(prompts, params, **kw):
        outs = generate(prompts, params, **kw)
        decoded[params.selector, params.anchor_ratio, tuple(p.token_ids for p in prompts)] = [o.token_ids for o in outs]
        return outs

    monkeypatch.setattr(task_llm, "generate", recording)
    cells = sweep(task_llm, examples=4, tasks=("qa1",), layouts=("prefix", "suffix"),
                  selectors=("attention", "random", "influence"), ratios=(0.0, 0.5), progress=False)
    for layout in ("prefix", "suffix"):
        mine = {(c.selector, c.ratio): c for c in cells if c.layout == layout}
        assert set(mine) == {("full", 0.0), ("none", 0.0), ("all", 1.0), ("attention", 0.0), ("attention", 0.5),
                             ("random", 0.0), ("random", 0.5), ("influence", 0.0), ("influence", 0.5)}
        assert all(c.total == 4 for c in mine.values())
        # every anchor is full recomputation (ratio 0's cells are direct reuse's, written once, not decoded again)
        assert mine[("all", 1.0)].correct == mine[("full", 0.0)].correct
    # the counts agree trivially where the tiny model answers nothing right: the sweep's requests, token for token
    requests = {key[2] for key in decoded}
    assert len(requests) == 2  # the prefix and the suffix layout's
    for prompts in requests:
        assert decoded["all", 1.0, prompts] == decoded[None, 0.0, prompts]
    written = write_report(cells, tmp_path / "acc")
    names = {p.name for p in written}
    assert {"accuracy.json", "accuracy.md", "accuracy.png"} <= names
    assert len(json.loads((tmp_path / "acc" / "accuracy.json").read_text())) == len(cells)
    md = (tmp_path / "acc" / "accuracy.md").read_text()
    assert "## qa1, suffix" in md and "| selector | 0 | 0.5 |" in md
    # a target table for each of our selectors that ran, none for one that did not
    assert "## Our selector `influence`" in md and "`attention-deviation`" not in md
    with pytest.raises(ValueError, match="anchor ratios must be in"):
        sweep(task_llm, examples=1, ratios=(1.5,), progress=False)


def test_demonstration_sweep_runs_without_them_and_with_two_affixes(task_llm, tmp_path):
    """The paper's setting: the demonstrations are the affix; ``without`` decodes the same requests with them
    left out; in the two-affix layout the request's story is cached too, and all anchors still equal full
    recomputation."""
    from acache_lab.eval.accuracy import main
    from acache_lab.eval.metrics import sweep_table
    from acache_lab.tasks.generators import held_out
    from acache_lab.tasks.render import TWO_AFFIXES, render_prompts

    cells = sweep(task_llm, examples=6, sentences=2, tasks=("codes",), layouts=("infix", TWO_AFFIXES),
                  selectors=("attention",), ratios=(0.2,), progress=False)
    for layout in ("infix", TWO_AFFIXES):
        mine = {c.selector: c for c in cells if c.layout == layout}
        assert set(mine) == {"without", "full", "none", "all", "attention"}
        assert mine["all"].correct == mine["full"].correct
        assert "| demonstrations removed |" in sweep_table(cells, "codes", layout)
    exs = held_out("codes", 2, 2)
    bare, whole = (render_prompts(task_llm.tokenizer, exs, TWO_AFFIXES, drop) for drop in (True, False))
    assert [len(p.affixes) for p in bare] == [1, 1] and [len(p.affixes) for p in whole] == [2, 2]
    assert all(b.affixes[0].length == w.affixes[1].length for b, w in zip(bare, whole, strict=True))  # the story stays
    args = dict(model="not-loaded", tasks="qa1", layouts=TWO_AFFIXES, examples=1, out=str(tmp_path))
    with pytest.raises(ValueError, match="two-affix layout needs tasks with demonstrations"):
        main(type("Args", (), args)())


def test_staleness_profile_first_layer_is_context_free(task_llm, tmp_path):
    records = profile(task_llm, examples=3, tasks=("qa1",), layouts=("prefix", "infix"), progress=False)
    assert [r["layout"] for r in records] == ["prefix", "infix"]
    for r in records:
        assert len(r["key_cosine"]) == len(r["value_cosine"]) == 2
        # layer 0 K/V come from the token embeddings alone (keys are cached before RoPE), so they cannot
        # depend on the context; deeper layers can
        assert r["key_cosine"][0] == pytest.approx(1.0, abs=1e-5)
        assert r["value_cosine"][0] == pytest.approx(1.0, abs=1e-5)
        assert all(-1.0 <= x <= 1.0 + 1e-6 for x in r["key_cosine"] + r["value_cosine"])
    infix = records[1]
    assert min(infix["key_cosine"][1], infix["value_cosine"][1]) < 1.0 - 1e-6
    assert plot_profile(records, tmp_path / "s.png") and (tmp_path / "s.png").stat().st_size > 0


def test_task_params_decode_the_answer_region_in_one_block_or_the_room_asked():
    from acache_lab.eval.tasks import task_params

    qa1, arith = task_params("qa1"), task_params("arith", selector="none", seed=3)
    assert (qa1.gen_length, qa1.block_length, qa1.threshold, qa1.cache) == (2, 2, 0.9, "dual")
    assert (arith.gen_length, arith.block_length, arith.selector) == (6, 6, "none")
    # the study's defaults are defaults: the reference path without a cache, or another threshold
    assert (task_params("qa1", cache="none").cache, task_params("qa1", threshold=0.5).threshold) == ("none", 0.5)
    # more room than the region, as a server's max_tokens gives: one block up to 32 columns, blocks of 32 past it
    assert [(p.gen_length, p.block_length) for p in (task_params("qa1", 8), task_params("arith", 64))] == \
        [(8, 8), (64, 32)]
    assert task_params("qa1", 8, block_length=4, selector="none").block_length == 4
    with pytest.raises(ValueError, match="gen_length 4 is shorter than arith's answer region \\(6 columns\\)"):
        task_params("arith", 4)
    with pytest.raises(ValueError, match="gen_length 40 is not a whole number of blocks of 32"):
        task_params("qa1", 40)
    with pytest.raises(ValueError, match="gen_length 8 is not a whole number of blocks of 3"):
        task_params("qa1", 8, block_length=3)
    # blocks that divide the answer region, for far-mask pruning; one that does not is the region as one block
    assert [task_params("arith", block_length=b).block_length for b in (2, 3, 4)] == [2, 3, 6]
    assert task_params("qa1", block_length=1, far_mask_window=0).far_mask_window == 0


def test_task_calibration_feeds_a_bicache_profile_into_the_sweep(task_llm, task_model_dir, tmp_path):
    from acache.affix.store import AffixStore
    from acache_lab.eval.staleness import profile_bicache
    from acache_lab.tasks.calibration import calibration_prompts
    from acache_lab.tasks.render import build_word_tokenizer

    prompts = calibration_prompts(task_llm.tokenizer, task_llm.model.config, "tasks", samples=9)
    assert prompts == calibration_prompts(task_llm.tokenizer, task_llm.model.config, "tasks", samples=9)
    unk = build_word_tokenizer().token_to_id("[UNK]")
    assert len(prompts) == 9 and all(p.affixes and unk not in p.token_ids for p in prompts)
    # each of the three tasks as a prefix, then as an infix, then as a suffix (the generation region before it)
    assert [p.gen_at == len(p.token_ids) for p in prompts] == [True] * 6 + [False] * 3
    path = tmp_path / "profile.json"
    profile_bicache(AffixStore(task_llm.model), prompts, gen_length=2).save(path)
    llm = LLM(task_model_dir, bicache_profile=path)
    cells = sweep(llm, examples=3, tasks=("qa1",), layouts=("prefix",), selectors=("bicache-profiled",),
                  ratios=(0.0, 0.2), progress=False)
    assert {(c.selector, c.ratio) for c in cells} >= {("bicache-profiled", 0.0), ("bicache-profiled", 0.2)}


def test_study_variants_and_the_selector_and_ratio_options(task_llm):
    """attention-probe-step is ACache with probe_step: its cells equal a direct run of those parameters."""
    from acache_lab.eval.accuracy import parse_ratios, parse_selectors
    from acache_lab.eval.tasks import exact_matches, task_params, task_prompts
    from acache_lab.tasks.generators import held_out

    cells = sweep(task_llm, examples=5, tasks=("qa1",), layouts=("infix",), selectors=("attention-probe-step",),
                  ratios=(0.5,), progress=False)
    got = {c.selector: c.correct for c in cells if c.ratio == 0.5}
    exs = held_out("qa1", 5, 6, 0)
    want = exact_matches(task_llm, task_prompts(task_llm, exs, "infix"), exs,
                         task_params("qa1", selector="attention", anchor_ratio=0.5, seed=0, probe_step=True))
    assert got == {"attention-probe-step": want}
    assert parse_selectors("attention, random", False) == ("attention", "random")
    assert parse_selectors("attention-probe-step", False) == ("attention-probe-step",)
    assert "attention-probe-step" not in parse_selectors(None, False)  # not in the default study
    assert parse_selectors(None, True)[-1] == "bicache-profiled"
    with pytest.raises(ValueError, match="bicache-profiled needs --bicache-profile"):
        parse_selectors("bicache-profiled", False)
    with pytest.raises(ValueError, match="unknown study selector 'attn'"):
        parse_selectors("attention,attn", False)
    assert parse_ratios("0.2,1") == (0.2, 1.0)
    for bad, why in (("0.2,x", "comma-separated numbers"), ("1.5", "must be in")):
        with pytest.raises(ValueError, match=why):
            parse_ratios(bad)


def test_eval_tasks_takes_a_subset_of_layouts(task_model_dir, capsys):
    from acache.cli import main

    assert main(["eval", "tasks", "--model", str(task_model_dir), "--examples", "2", "--tasks", "qa1",
                 "--layouts", "prefix,infix"]) == 0
    table = capsys.readouterr().out
    assert "| task | prefix | infix |" in table and "suffix" not in table
    assert main(["eval", "tasks", "--model", str(task_model_dir), "--examples", "1", "--layouts", "diagonal"]) == 2
    assert "unknown layout 'diagonal'" in capsys.readouterr().err


def test_eval_tasks_says_which_tasks_a_block_length_does_not_divide(task_model_dir, capsys):
    """``--block-length 3`` divides arith's 6-column region, not qa1's 2: qa1 decodes one block of 2, and the header
    says so (it printed the block asked for only)."""
    from acache.cli import main

    assert main(["eval", "tasks", "--model", str(task_model_dir), "--examples", "1", "--tasks", "qa1,arith",
                 "--layouts", "prefix", "--block-length", "3"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "block_length 3 (qa1 in one block of 2: its answer region is not a whole number of blocks of 3)" in header


def test_eval_tasks_runs_a_state_cache_family_on_the_engine(tmp_path, capsys):
    """acache eval tasks serves a state-cache family through the engine like any other, and says why a block-causal
    model's suffix layout is not scored."""
    from acache import LLM
    from acache.cli import main
    from acache_lab.eval.tasks import evaluate
    from acache_lab.train.trainer import ModelShape, TrainConfig, train

    train(TrainConfig(out=str(tmp_path / "r2"), steps=2, batch_size=2, warmup=1, bf16=False, tasks=("qa1",),
                      family="r2lm", layouts=("prefix",),
                      model=ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64, block_size=4)),
          progress=False)
    llm = LLM(tmp_path / "r2")
    assert llm.engine.state_cache
    scores = evaluate(llm, examples=2, tasks=("qa1",), layouts=("prefix", "infix"))
    assert [(s.layout, s.total) for s in scores] == [("prefix", 2), ("infix", 2)]
    assert main(["eval", "tasks", "--model", str(tmp_path / "r2"), "--examples", "1", "--tasks", "qa1",
                 "--layouts", "suffix"]) == 2
    assert "cannot read text after its answer" in capsys.readouterr().err


def test_the_sweep_and_the_task_scores_decode_in_the_room_asked(task_llm, monkeypatch, tmp_path):
    """``gen_length`` reaches every decode of the sweep and of the task scores, and the sweep's compute counts
    the wider canvas."""
    from acache_lab.eval.tasks import evaluate

    seen = []
    real = task_llm.generate
    monkeypatch.setattr(task_llm, "generate", lambda prompts, params, **kw: seen.append(params.gen_length) or
                        real(prompts, params, **kw))
    kw = dict(examples=2, tasks=("qa1",), layouts=("prefix",), selectors=("attention",), ratios=(0.5,),
              progress=False)
    tight, roomy = sweep(task_llm, **kw), sweep(task_llm, **kw, gen_length=32)
    assert set(seen[:len(seen) // 2]) == {2} and set(seen[len(seen) // 2:]) == {32}
    assert [(c.selector, c.ratio) for c in tight] == [(c.selector, c.ratio) for c in roomy]
    direct = [(a.compute, b.compute) for a, b in zip(tight, roomy, strict=True) if a.selector == "none"]
    assert len(direct) == 1 and 0 < direct[0][0] < direct[0][1] < 1  # the affix a smaller share of a wider canvas
    assert all(c.as_dict()["gen_length"] == 32 for c in roomy) and not any("gen_length" in c.as_dict() for c in tight)
    write_report(roomy, tmp_path / "roomy")
    assert "Answers decoded in 32 columns (`--gen-length`)" in (tmp_path / "roomy" / "accuracy.md").read_text()
    seen.clear()
    scores = evaluate(task_llm, examples=2, tasks=("qa1",), layouts=("infix",), gen_length=8)
    assert [(s.total, s.gen_length) for s in scores] == [(2, 8)] and seen == [8]


def test_a_repeated_answer_or_one_holding_a_special_token_is_not_an_exact_match():
    """'kitchen <|startoftext|>' read as 'kitchen' when answers were compared by their text without special
    tokens."""
    from types import SimpleNamespace

    from acache.models.tokenizer import Tokenizer
    from acache.paths import default_model
    from acache_lab.eval.tasks import exact_matches, task_params

    tok = Tokenizer.from_dir(default_model())
    answers = [tok.encode(t, add_special_tokens=False) for t in ("kitchen", "kitchen kitchen", "garden")]
    answers.append(answers[0] + [tok.token_to_id("<|startoftext|>")])

    class Model:
        tokenizer = tok

        def generate(self, prompts, params, use_tqdm):
            return [SimpleNamespace(token_ids=ids, text=tok.decode(ids)) for ids in answers]

    examples = [SimpleNamespace(answer=("kitchen",))] * 4
    assert exact_matches(Model(), [None] * 4, examples, task_params("qa1", 8)) == 1


@pytest.mark.parametrize("argv, message", [
    (["eval", "tasks", "--sentences", "0"], "argument --sentences: not a positive integer: '0'"),
    (["eval", "accuracy", "--examples", "0"], "argument --examples: not a positive integer: '0'"),
    (["eval", "auto-reuse", "--stories", "0"], "argument --stories: not a positive integer: '0'"),
    (["eval", "auto-reuse", "--rounds", "-1"], "argument --rounds: not a positive integer: '-1'"),
    (["bench", "--json", "x.json", "decode"], "put the options after the benchmark's name: acache bench decode "
                                              "--json x.json"),
], ids=["sentences", "examples", "stories", "rounds", "options-before-the-benchmark"])
def test_a_study_flag_that_cannot_run_is_refused_by_name(argv, message, capsys):
    from acache.cli import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_a_generator_with_nothing_to_draw_is_named_rather_than_looped_on():
    from acache_lab.tasks.generators import held_out

    with pytest.raises(ValueError, match="the qa1 generator makes no example of 0 sentences"):
        held_out("qa1", 3, 0)


def test_outputs_that_cannot_be_written_are_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from acache.cli import main

    monkeypatch.setattr("acache_lab.eval.accuracy.LLM", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    for argv, message in (
            (["eval", "accuracy", "--out", str(tmp_path / "a-file")], "--out .*a-file is a file; it names a folder"),
            (["eval", "accuracy", "--json", str(tmp_path / "a-folder")], "--json .*a-folder is a folder"),
            (["eval", "accuracy", "--json", str(tmp_path / "a-file" / "x.json")], "a file lies on its way"),
            (["bicache-profile", "--out", str(tmp_path / "a-folder")], "--out .*a-folder is a folder; it names a file"),
            (["eval", "accuracy", "--selectors", "attention,attn", "--out", str(tmp_path / "r")],
             "unknown study selector 'attn'")):
        assert main(argv) == 2
        assert __import__("re").search(message, capsys.readouterr().err), argv


def test_a_block_causal_model_is_not_swept_in_the_suffix_layout(tmp_path, capsys):
    from acache.cli import main
    from acache_lab.train.trainer import ModelShape, TrainConfig, train

    train(TrainConfig(out=str(tmp_path / "bd"), steps=1, batch_size=2, warmup=1, bf16=False, tasks=("qa1",),
                      family="fast_dllm_v2", layouts=("prefix",),
                      model=ModelShape(layers=1, hidden_size=32, heads=2, intermediate_size=64, block_size=4)),
          progress=False)
    assert main(["eval", "accuracy", "--model", str(tmp_path / "bd"), "--examples", "1", "--tasks", "qa1",
                 "--layouts", "infix,suffix", "--out", str(tmp_path / "r")]) == 2
    assert "block-causal" in capsys.readouterr().err
    assert main(["eval", "staleness", "--model", str(tmp_path / "bd"), "--examples", "1", "--out",
                 str(tmp_path / "s")]) == 0  # profiles the layouts it reads
    records = json.loads((tmp_path / "s" / "staleness.json").read_text())
    assert {r["layout"] for r in records} == {"prefix", "infix"}


def test_repeated_selectors_and_ratios_are_swept_once():
    from acache_lab.eval.accuracy import parse_ratios, parse_selectors

    assert parse_selectors("attention,random,attention", False) == ("attention", "random")
    assert parse_ratios("0.2,0.5,0.2") == (0.2, 0.5)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm", "fault"])
def test_a_sweep_stopped_near_its_end_keeps_the_cells_it_measured(task_model_dir, tmp_path, monkeypatch, capsys,
                                                                  stop):
    """Ctrl-C kept them; a SIGTERM (timeout, a scheduler) or a later cell's fault lost every one."""
    import os
    import signal

    import acache_lab.eval.accuracy as accuracy
    from acache.cli import main

    real, calls = accuracy.exact_matches, []

    def stopped_at_the_fourth(*args):
        calls.append(1)
        if len(calls) == 4:
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            if stop == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            raise MemoryError("out of memory in a later cell")
        return real(*args)

    monkeypatch.setattr(accuracy, "exact_matches", stopped_at_the_fourth)
    out = tmp_path / "study"
    argv = ["eval", "accuracy", "--model", str(task_model_dir), "--examples", "1", "--tasks", "qa1", "--layouts",
            "prefix", "--selectors", "attention,random", "--ratios", "0.2", "--out", str(out)]
    handler = signal.getsignal(signal.SIGTERM)
    if stop == "fault":  # raised as it came, once the cells are kept
        with pytest.raises(MemoryError, match="out of memory in a later cell"):
            main(argv)
    else:
        assert main(argv) == (130 if stop == "ctrl-c" else 143)
    assert signal.getsignal(signal.SIGTERM) == handler  # put back
    kept = json.loads((out / "partial" / "accuracy.json").read_text())
    assert [c["selector"] for c in kept] == ["full", "none", "all"] and not (out / "accuracy.json").exists()
    assert "the 3 cells measured so far" in capsys.readouterr().err
    monkeypatch.setattr(accuracy, "exact_matches", real)
    assert main(argv) == 0 and (out / "accuracy.json").is_file() and not (out / "partial").exists()


def test_eval_tasks_refuses_a_block_length_that_is_not_positive(capsys):
    """0 fell through to the whole region while the header printed 'block_length 0'."""
    from acache.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "tasks", "--examples", "1", "--block-length", "0"])
    assert "argument --block-length: not a positive integer: '0'" in capsys.readouterr().err


def test_eval_tasks_says_the_context_lengths_a_generator_drew_instead_of_those_asked(capsys):
    """Arithmetic caps its worksheets at 8 facts: the header said '20 sentences' over 8-sentence worksheets."""
    from acache.cli import main

    assert main(["eval", "tasks", "--examples", "1", "--sentences", "20", "--tasks", "arith,qa1"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "contexts of 20 sentences (as drawn: arith 8)," in head
    assert main(["eval", "tasks", "--examples", "1", "--sentences", "6", "--tasks", "qa1"]) == 0
    assert "as drawn" not in capsys.readouterr().out.splitlines()[0]
