"""The engine benchmark's ideal bounds, its comparison arithmetic, and its task workload."""

from __future__ import annotations

import json
import math

import pytest

from acache.models.loader import load_model
from acache_lab.bench.engine import (
    Comparison,
    ModeResult,
    Workload,
    compare,
    make_task_requests,
    markdown,
    median_run,
    run_mode,
)


def test_paper_shape_ideal_bounds():
    w = Workload()  # 700-token affix, 60-token question, gen 256 in blocks of 32, 64 steps, ratio 0.2
    assert w.refresh_tokens(False) == 700 + 60 + 256
    assert w.refresh_tokens(True) == 140 + 60 + 256  # 20% of the affix as anchors
    in_block = (64 - 8) * 32  # the 56 steps that are not a block's first
    assert w.token_passes(False) == 8 * 1016 + in_block
    assert w.token_passes(True) == (60 + 256) + 8 * 456 + in_block  # the selection probe, then refreshes


def test_an_exact_affix_or_no_anchors_bounds_as_direct_reuse():
    """An exact affix (a block-causal model's prefix) takes no anchors short of the whole, and `none` takes none:
    every refresh is direct reuse's, with no selection; ratio 1 still recomputes the whole affix."""
    in_block = (64 - 8) * 32
    for w in (Workload(exact=True), Workload(selector="none"), Workload(selector="cacheblend", exact=True)):
        assert w.anchors == 0 and w.refresh_tokens(True) == 60 + 256
        assert w.token_passes(True) == w.token_passes(True, layers=30) == 8 * 316 + in_block
    assert Workload(exact=True, ratio=1.0).refresh_tokens(True) == 1016


def test_comparison_ratios_and_page_bounds():
    w = Workload(affix_len=64, question_len=8, gen_length=8, block_length=8, steps=8, ratio=0.25)
    dual = ModeResult("dual", 2, 1.0, 16, 16.0, 0.8, 0.1, 0.0, 10, 10 * 1024)
    acache = ModeResult("acache", 2, 0.5, 16, 32.0, 0.2, 0.1, 0.05, 7, 7 * 1024)
    c = compare(dual, acache, w, page_size=16)
    assert c.recompute_reduction == pytest.approx(0.75) and c.throughput_gain == pytest.approx(2.0)
    assert c.recompute_reduction_ideal == pytest.approx(1 - (16 + 8 + 8) / (64 + 8 + 8))
    # dual: 2 requests x ceil(80 / 16) pages; acache: the shared affix once + 2 x ceil(32 / 16)
    assert c.peak_kv_reduction_ideal == pytest.approx(1 - (4 + 2 * 2) / (2 * 5))
    assert c.peak_kv_reduction == pytest.approx(0.3)
    assert c.fractions()["recompute"] == pytest.approx(0.75 / c.recompute_reduction_ideal)


def test_median_run_is_the_middle_by_wall_time():
    runs = [ModeResult("dual", 1, wall, 2, 2 / wall, 0.0, 0.0, 0.0, 1, 1) for wall in (0.9, 0.1, 0.5, 3.0, 0.4)]
    assert median_run(runs).wall_time_s == 0.5
    assert median_run(runs[:2]).wall_time_s == 0.9  # the upper middle of an even count
    with pytest.raises(ValueError, match="no runs"):
        median_run([])


def test_an_ideal_of_zero_has_no_fraction_of_it():
    c = Comparison(1, 0.5, 0.6, 1.5, 1.8, 0.0, 0.0)  # one request: no pages to save
    f = c.fractions()
    assert f["throughput"] == pytest.approx(1.5 / 1.8) and math.isnan(f["memory"])
    assert markdown([], [c]).splitlines()[-1].endswith("| 83% / 83% / - |")


def test_task_workload_shares_one_story_and_decodes_the_task_region(task_model_dir):
    prompts, w = make_task_requests(str(task_model_dir), 5, sentences=4, seed=0)
    affixes = {tuple(p.affix_ids(p.affixes[0])) for p in prompts}
    assert len(prompts) == 5 and len(affixes) == 1  # one shared story
    assert len({tuple(p.token_ids) for p in prompts}) > 1  # asked different questions
    assert (w.affix_len, w.gen_length, w.block_length, w.steps) == (prompts[0].affixes[0].length, 2, 2, 2)
    assert w.question_len == len(prompts[0].token_ids) - w.affix_len
    model = load_model(task_model_dir)
    for reuse in (False, True):
        r = run_mode(model, prompts[:2], w, reuse, batch=2, page_size=16, kv_bytes=1 << 22)
        assert r.decoded_tokens == 2 * w.gen_length and r.throughput_tokens_per_s > 0
        assert r.peak_kv_pages > 0


def test_bench_command_reports_the_median_of_interleaved_repeats(task_model_dir, tmp_path, capsys):
    from acache.cli import main

    out = tmp_path / "bench.json"
    args = ["bench", "--workload", "tasks", "--model", str(task_model_dir), "--sentences", "3",
            "--batch-sizes", "1,2", "--json", str(out)]
    assert main([*args, "--repeats", "2"]) == 0
    written = json.loads(out.read_text())
    assert [(r["batch"], r["mode"]) for r in written["results"]] == [(1, "dual"), (1, "acache"), (2, "dual"),
                                                                      (2, "acache")]
    assert ("median of 2 run(s) per mode, each repeat starting with the next mode, after an untimed warm-up of "
            "every mode at every batch size") in written["setup"]
    capsys.readouterr()
    assert main([*args, "--repeats", "0"]) == 2
    assert "--repeats must be at least 1, not 0" in capsys.readouterr().err


def test_a_variant_runs_beside_plain_acache_and_the_mixed_batch_compares_with_plain(task_model_dir, tmp_path,
                                                                                     capsys):
    from acache.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--workload", "tasks", "--model", str(task_model_dir), "--sentences", "3", "--batch-sizes",
                 "2", "--probe-step", "--no-warmup", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert [r["mode"] for r in written["results"]] == ["dual", "acache", "acache+probe_step=True"]
    plain = written["results"][1]
    assert written["mixed"][0]["mode"] == "acache mixed"
    printed = capsys.readouterr().out
    mixed_table = printed[printed.index("| batch | run |"):]
    assert mixed_table.splitlines()[2].startswith("| 2 | acache | ")  # the homogeneous row is plain ACache
    assert f"{plain['throughput_tokens_per_s']:.2f}" in mixed_table.splitlines()[2]


def test_anchor_query_runs_as_a_third_mode_and_an_unknown_one_is_named(task_model_dir, tmp_path, capsys):
    from acache.cli import main

    out = tmp_path / "bench.json"
    args = ["bench", "--workload", "tasks", "--model", str(task_model_dir), "--sentences", "3", "--batch-sizes", "2",
            "--no-warmup", "--no-mixed", "--json", str(out)]
    assert main([*args, "--anchor-query", "shallow"]) == 0
    written = json.loads(out.read_text())
    assert [r["mode"] for r in written["results"]] == ["dual", "acache", "acache+anchor_query=shallow"]
    plain, shallow = written["results"][1:]
    assert 0 < shallow["model_flops"] < plain["model_flops"]  # the same decoding, a shorter selection probe
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*args, "--anchor-query", "deep"])
    assert "invalid choice: 'deep'" in capsys.readouterr().err


def test_anchor_depth_runs_as_a_third_mode_and_a_bad_one_is_named(tmp_path, capsys):
    """A 6-layer random model, so that depth 0.2 leaves four layers unscored: the third mode runs beside plain
    ACache and computes fewer token-layers in its selecting refresh; a depth out of (0, 1] is named."""
    from acache.cli import main
    from tests.conftest import tiny_checkpoint

    out = tmp_path / "bench.json"
    model = tiny_checkpoint(tmp_path / "deep", "llada", layers=6)
    args = ["bench", "--model", str(model), "--affix-len", "48", "--question-len", "8", "--gen-length",
            "16", "--block-length", "8", "--steps", "4", "--batch-sizes", "2", "--no-warmup", "--no-mixed",
            "--json", str(out)]
    assert main([*args, "--anchor-depth", "0.2"]) == 0
    written = json.loads(out.read_text())
    assert [r["mode"] for r in written["results"]] == ["dual", "acache", "acache+anchor_depth=0.2"]
    plain, shallow = written["results"][1:]
    assert 0 < shallow["model_flops"] < plain["model_flops"]  # the same refreshes after, a shorter selection
    capsys.readouterr()
    assert main([*args, "--anchor-depth", "2"]) == 2
    assert "anchor_depth must be a number in (0, 1], got 2.0" in capsys.readouterr().err


def test_compile_times_a_compiled_copy_beside_the_eager_model(task_model_dir, tmp_path, capsys):
    from acache.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--workload", "tasks", "--model", str(task_model_dir), "--sentences", "3", "--batch-sizes",
                 "1,3", "--compile", "--no-mixed", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    modes = ["dual", "acache", "dual compiled", "acache compiled"]
    assert [(r["batch"], r["mode"]) for r in written["results"]] == [(b, m) for b in (1, 3) for m in modes]
    flops = {(r["batch"], r["mode"]): r["model_flops"] for r in written["results"]}
    for b in (1, 3):  # the same decoding work, eager or compiled
        assert flops[(b, "dual")] == flops[(b, "dual compiled")] > 0
        assert flops[(b, "acache")] == flops[(b, "acache compiled")] > 0
    printed = capsys.readouterr().out
    assert "batch 3: compiled / eager tokens/s: dual " in printed


def test_one_pass_ideal_counts_the_selecting_refresh():
    """Chosen in one pass, no probe runs and the first refresh is the forward that filters: layers 0-1 of the whole
    canvas, then the own tokens and the carried candidates (from 2k down to k) through the later layers."""
    w = Workload()  # 700 + 60 + 256, k = 140, 8 blocks, attention (one pass by default)
    layers = 30
    carried = [round(140 + 140 * (28 - s) / 28) for s in range(29)]  # after layers 1..29
    first = (1016 * 2 + sum(316 + c for c in carried[:28])) / layers
    assert w.token_passes(True, layers) == pytest.approx(first + 7 * 456 + 56 * 32)
    assert Workload(anchor_pass="two").token_passes(True, layers) == w.token_passes(True)  # the probe's count


@pytest.mark.parametrize("remasking", ["low_confidence", "threshold"])
def test_fastdllm_loop_decodes_as_the_engine(llada_model, remasking):
    """The Fast-dLLM-style loop the bench times ACache against decodes what the engine's dual cache decodes, token
    for token (it is a baseline, not a different algorithm)."""
    from acache.sampling_params import SamplingParams
    from acache_lab.bench.fastdllm import fastdllm_generate
    from tests.conftest import random_prompts
    from tests.helpers import run_engine

    prompts = random_prompts([11, 11, 11], seed=4)
    params = SamplingParams(gen_length=16, block_length=8, steps=8 if remasking == "low_confidence" else None,
                            remasking=remasking, threshold=0.5)
    got, refresh_s, step_s = fastdllm_generate(llada_model, prompts, params)
    want = run_engine(llada_model, prompts, params)
    for g, o in zip(got, want, strict=True):  # the engine cuts its output at the first stop token
        assert g[:len(o.token_ids)] == o.token_ids
        assert len(o.token_ids) == len(g) or g[len(o.token_ids)] == o.stop_token_id
    assert refresh_s > 0 and step_s > 0


def test_fastdllm_loop_refuses_what_it_cannot_run(llada_model):
    from acache.sampling_params import SamplingParams
    from acache_lab.bench.fastdllm import fastdllm_generate

    with pytest.raises(ValueError, match="prompts of one length"):
        fastdllm_generate(llada_model, [[1, 2, 3], [1, 2]], SamplingParams(gen_length=8, block_length=8))
    with pytest.raises(ValueError, match="no affix reuse"):
        fastdllm_generate(llada_model, [[1, 2, 3]], SamplingParams(gen_length=8, block_length=8, selector="none"))


def test_selection_share_reads_the_selecting_refresh_against_a_later_one():
    """One selecting refresh batch of 3 s, seven later ones of 2 s each, dual refreshes of 5 s: selection costs
    (3 - 2) / 5 of a forward; a run that selected in no refresh has no such share."""
    from acache_lab.bench.engine import selection_share

    dual = ModeResult("dual", 16, 10.0, 16, 1.6, 40.0, 1.0, 0.0, 10, 10, refreshes=8)
    acache = ModeResult("acache", 16, 6.0, 16, 2.6, 3.0 + 7 * 2.0, 1.0, 0.0, 5, 5, refreshes=8,
                        selecting_refresh_s=3.0, selecting_refreshes=1)
    assert selection_share(dual, acache) == pytest.approx(0.2)
    assert selection_share(dual, ModeResult("acache", 16, 6.0, 16, 2.6, 14.0, 1.0, 1.0, 5, 5, refreshes=7)) is None


@pytest.mark.parametrize("text", ["0", "1,1", "4,-2", "1,x", ""])
def test_bad_batch_sizes_are_refused(text):
    from acache_lab.bench.engine import batch_sizes

    with pytest.raises(ValueError, match="--batch-sizes takes"):
        batch_sizes(text)


def test_the_task_workload_takes_the_ratio_asked_for(task_model_dir, capsys, tmp_path):
    from acache.cli import main

    assert main(["bench", "--model", str(task_model_dir), "--workload", "tasks", "--batch-sizes", "1", "--ratio",
                 "0.5", "--no-mixed", "--no-warmup", "--json", str(tmp_path / "b.json")]) == 0
    assert "ratio 0.5" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--workload", "tasks", "--gen-length", "64", "--steps", "16"],
     "--workload tasks takes its shape from the task .*: --gen-length, --steps would be ignored"),
    (["--workload", "tasks", "--affix-len", "700"], "--affix-len would be ignored"),
    (["--sentences", "4"], "--sentences is the story length of --workload tasks"),
    (["--shape", "llada-8b"], "--shape is the random model's shape; with --model it would be ignored"),
])
def test_options_the_workload_would_ignore_are_refused(task_model_dir, capsys, extra, message):
    """They were dropped silently: a table headed with one shape measured another."""
    import re

    from acache.cli import main

    assert main(["bench", "--model", str(task_model_dir), "--batch-sizes", "1", *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_step_key_copies_are_counted_beside_the_pool(task_model_dir):
    """On a CPU the in-block steps hold rotated copies of every request's past outside the pool, the same bytes in
    both modes; the pages-only figure left them out, so the memory ACache saves is reported with them too."""
    model = load_model(task_model_dir)
    w = Workload(affix_len=40, question_len=8, gen_length=8, block_length=4, steps=4)
    from acache_lab.bench.engine import make_requests

    prompts = make_requests(model, w, 4, seed=0)
    dual = run_mode(model, prompts, w, False, 4, 8, 1 << 24)
    acache = run_mode(model, prompts, w, True, 4, 8, 1 << 24)
    # four requests' sets (every column but the block's, K and V, every layer) and the batch's stack of them
    cfg = model.config
    one = (len(prompts[0].token_ids) + w.gen_length - w.block_length) * 2 * cfg.num_layers * cfg.num_kv_heads \
        * cfg.head_dim * 4
    assert dual.peak_step_key_bytes == acache.peak_step_key_bytes >= 4 * one
    assert (dual.refreshes, acache.selecting_refreshes) == (2, 1)  # the other counts stay where they were
    c = compare(dual, acache, w, 8)
    held = (acache.peak_kv_bytes + acache.peak_step_key_bytes) / (dual.peak_kv_bytes + dual.peak_step_key_bytes)
    assert math.isclose(c.peak_memory_reduction, 1 - held) and 0 < c.peak_memory_reduction < c.peak_kv_reduction
    table = markdown([dual, acache], [c])
    assert "step-key copies MiB" in table and f"{-100 * c.peak_memory_reduction:+.1f}%" in table


def test_every_mode_is_warmed_at_every_batch_size_and_each_repeat_starts_with_another(task_model_dir, tmp_path,
                                                                                       monkeypatch):
    """The warm-up ran the first batch size only and the repeats always ran the dual cache first, so the first run at
    a new batch size (a dual-cache run) paid for its buffers' first touch, in ACache's favour."""
    from acache.cli import main
    from acache_lab.bench import engine

    calls = []
    real = engine.run_mode

    def recorded(model, prompts, w, reuse, batch, *args, **kwargs):
        calls.append((batch, "acache" if reuse else "dual", len(prompts)))
        return real(model, prompts, w, reuse, batch, *args, **kwargs)

    monkeypatch.setattr(engine, "run_mode", recorded)
    assert main(["bench", "--workload", "tasks", "--model", str(task_model_dir), "--sentences", "3", "--requests",
                 "4", "--batch-sizes", "1,2", "--repeats", "3", "--no-mixed", "--json", str(tmp_path / "b.json")]) == 0
    warm, timed = calls[:4], calls[4:]
    assert warm == [(1, "dual", 1), (1, "acache", 1), (2, "dual", 2), (2, "acache", 2)]
    assert [m for b, m, _ in timed if b == 1] == ["dual", "acache", "acache", "dual", "dual", "acache"]
    assert all(n == 4 for _, _, n in timed)


def test_an_admitted_engine_runs_its_whole_batch_in_its_first_step():
    """The probes time or count the first step of ``admitted_engine`` as the batch's: under the default token
    budget (16,384) 17 canvases of 1,016 tokens left one request to a later step."""
    import torch

    from acache_lab.bench.decode import random_model
    from acache_lab.bench.engine import Workload, admitted_engine, make_requests, workload_params

    shape = {"layers": 2, "hidden_size": 64, "heads": 4, "kv_heads": 2, "intermediate_size": 128,
             "vocab_size": 1000}
    model = random_model("llada", shape, torch.float32, torch.device("cpu"), 0)
    w = Workload(selector="attention")
    prompts = make_requests(model, w, 17, 1)
    for reuse in (False, True):
        engine = admitted_engine(model, prompts, workload_params(w, reuse))
        seen = []
        execute = engine.runner.execute
        engine.runner.execute = lambda sched, execute=execute, seen=seen: seen.append(
            sum(len(f.requests) for f in sched.forwards)) or execute(sched)
        with torch.inference_mode():
            engine.step()
        assert seen == [17], reuse
