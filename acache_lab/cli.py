"""The research side's commands (train, finetune-affix, eval, bench, bicache-profile), added to ``acache``'s
command line through the ``acache.commands`` entry point."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from acache.cli import _add_model_args, _checked, _port, _positive_int, parse_size
from acache.policies import ANCHOR_PASSES, ANCHOR_QUERIES, DEFAULT_SELECTOR, SELECTORS

_unit_interval = _checked(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")


def _add_study_args(p: argparse.ArgumentParser, examples: int) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--examples", type=_positive_int, default=examples, help=f"held-out requests per task and layout "
                   f"(default {examples})")
    p.add_argument("--sentences", type=_positive_int, default=6, help="context length in sentences")
    p.add_argument("--seed", type=int, default=0, help="held-out seed stream")


def _add_gen_length(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gen-length", type=int, default=None,
                   help="columns each answer is generated in (default: the task's answer region), one block up to 32 "
                   "and whole blocks of 32 past it; more room, as a server's max_tokens gives, also asks the model to "
                   "end its answer (EOS after it)")


def _cmd_bicache_profile(args: argparse.Namespace) -> int:
    from acache.affix.store import AffixStore
    from acache.models.loader import load_model
    from acache.models.tokenizer import Tokenizer
    from acache_lab.eval.staleness import profile_bicache
    from acache_lab.tasks.calibration import calibration_prompts

    args = _with_default_model(args)
    _refuse_no_shared_affixes(args.model, "bicache-profile")
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    tokenizer = Tokenizer.from_dir(args.model)
    prompts = calibration_prompts(tokenizer, model.config, args.calibration, args.samples, args.seed)
    profile = profile_bicache(AffixStore(model), prompts, args.gen_length, args.tau, args.bins)
    profile.save(args.out)
    print(f"profiled {len(prompts)} requests; safe shallow layers by affix share (tau {args.tau}):")
    for edge, safe, n in zip(profile.max_share, profile.safe_layers, profile.samples, strict=True):
        print(f"  share <= {edge:.2f}: {safe}/{profile.num_layers} layers reusable ({n} samples)")
    print(f"wrote {args.out}")
    return 0


#: the options of ``bench serve`` against a running server, and their defaults
SERVE_URL_DEFAULTS = {"url": "http://127.0.0.1:8000", "requests": 32, "api_key": None, "max_tokens": 32,
                      "system_prompt": None, "prompts": "auto"}
#: the options of ``bench serve --replicas`` (replicas it starts itself), and their defaults
SERVE_CLUSTER_DEFAULTS = {"model": None, "documents": 6, "questions": 12, "sentences": 6, "max_affix_tokens": None,
                          "threads": 1, "port": 8000}


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    """A running server's load (``--url``) or replicas started here (``--replicas``): an option of the other mode
    is refused, not ignored (``--port`` without ``--replicas`` would time whatever answers on ``--url``)."""
    cluster = args.replicas is not None
    mine, other = (SERVE_CLUSTER_DEFAULTS, SERVE_URL_DEFAULTS) if cluster else (SERVE_URL_DEFAULTS,
                                                                                 SERVE_CLUSTER_DEFAULTS)
    given = [name for name in other if getattr(args, name) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} applies {'to a running server, without' if cluster else 'with'} --replicas")
    for name, default in mine.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if cluster:
        from acache_lab.bench.cluster import bench_cluster

        return bench_cluster(args)
    from acache_lab.bench.serve import main

    return main(args)


def _cmd_train(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from acache_lab.train.trainer import RESUME_FILE, TrainConfig, finished_as, refuse_own_out, train, writable_out

    # every config is read before the first trains, so a typo in the last one costs seconds, not an hour
    configs = [TrainConfig.from_file(path) for path in args.config]
    if args.out:
        configs[-1].out = args.out
    def under(path: str, outs: set[Path]) -> bool:  # an out, or a folder in one (a save_every step)
        return any(Path(path).resolve().is_relative_to(w) for w in outs)

    if args.resume and args.restart:
        raise ValueError("--resume and --restart contradict each other: continue a stopped run, or start it over")
    for i, config in enumerate(configs):  # what a stage reads must exist when it starts: here or written before it
        written = {Path(c.out).resolve() for c in configs[:i]}
        resumes = args.resume and (Path(config.out) / RESUME_FILE).is_file()  # reads its own weights, not init_from
        reads = [] if resumes else [("init_from", p) for p in config.init_paths()]
        for option, path in [*reads, ("affix_teacher", config.affix_teacher)]:
            if path and not (Path(path) / "config.json").is_file() and not under(path, written):
                raise FileNotFoundError(f"{args.config[i]}: {option} {path} is no checkpoint (no config.json) and no "
                                        "earlier config writes it")
        refuse_own_out(config)
        writable_out(config.out)  # the last config's out too, before the first trains
        if not args.resume and not args.restart and (Path(config.out) / RESUME_FILE).is_file():
            raise ValueError(f"{config.out} holds a stopped run ({RESUME_FILE}): continue it with --resume, or pass "
                             "--restart to train it again from the start (what it trained is lost)")
    from acache_lab.tracked import refuse_tracked

    refuse_tracked([c.out for c in configs], args.overwrite)
    total_s = 0.0
    trained: set[Path] = set()  # what this command has written: a config that starts from one of them trains again
    for config in configs:
        out = Path(config.out)
        resume = args.resume and (out / RESUME_FILE).is_file()
        fresh = [p for p in (*config.init_paths(), config.affix_teacher) if p and under(p, trained)]
        if args.resume and not resume and (out / "training_log.json").is_file():
            try:
                done = json.loads((out / "training_log.json").read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):  # cut by a kill: nothing to trust, trained again
                done = {"config": None}
            same = isinstance(done.get("config"), dict) and finished_as(done["config"], config)
            # a kill between the log and the weights of a later save leaves a log with no weights beside it
            whole = any((out / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
            if same and whole and not done.get("interrupted") and not fresh:
                print(f"{config.out}: finished before, skipped")
                total_s += done["train_time_s"]
                continue
            if fresh:
                print(f"{config.out}: finished before, but {fresh[0]} was trained again: training it again")
            elif not same:
                print(f"{config.out}: finished before with another config (or its log cannot be read): training it "
                      "again", file=sys.stderr)
            elif not whole:
                print(f"{config.out}: finished before, but its weights are gone (a kill cut a later save): training "
                      "it again", file=sys.stderr)
            elif done.get("interrupted"):  # stopped, but killed before its resume state was whole
                print(f"{config.out}: stopped before without a resume state (a kill cut its save): training it from "
                      "the start", file=sys.stderr)
        elif resume and fresh:  # a stopped run grew from what this command has just retrained: it starts over
            print(f"{config.out}: stopped before, but {fresh[0]} was trained again: training it from the start")
            resume = False
        trained.add(out.resolve())
        summary = train(config, resume=resume)
        if summary.get("interrupted"):
            if summary.get("stopped_by") in ("Ctrl-C", "SIGTERM"):
                print(f"stopped by {summary['stopped_by']} after {summary['steps_done']} steps; wrote {config.out}; "
                      "continue with the same command and --resume")
                return 130 if summary["stopped_by"] == "Ctrl-C" else 143
            print(f"stopped by {summary['stopped_by']} after {summary['steps_done']} steps; wrote {config.out}; "
                  "raise time_limit_minutes in its config and continue with --resume", file=sys.stderr)
            return 1  # a chain's later configs never start from a run cut short
        total_s += summary["train_time_s"]
        last = summary["log"][-1]["loss"] if summary["log"] else float("nan")
        curve = f" (loss curve: {summary['loss_curve']})" if summary.get("loss_curve") else ""
        print(f"trained {summary['steps_done']} steps in {summary['train_time_s'] / 60:.1f} min, final loss "
              f"{last:.4f}; wrote {config.out}{curve}")
    if len(configs) > 1:
        print(f"{len(configs)} configs, {total_s / 60:.1f} min of training in all")
    return 0


def _cmd_finetune_affix(args: argparse.Namespace) -> int:
    from acache_lab.train.lora import LoraConfig, finetune

    targets = {} if args.targets is None else {"targets": tuple(t for t in args.targets.split(",") if t)}
    config = LoraConfig(model=args.model, data=args.data, out=args.out, rank=args.rank, alpha=args.alpha,
                        dropout=args.dropout, **targets, steps=args.steps, lr=args.lr, warmup=args.warmup,
                        batch_size=args.batch_size, isolation=args.isolation, neighbours=args.neighbours,
                        neighbour_layer=args.neighbour_layer, neighbour_span=args.neighbour_span,
                        neighbour_rank=None if args.neighbour_rank == 0 else args.neighbour_rank,
                        neighbour_pairs=args.neighbour_pairs, teacher=args.teacher, answer_room=args.answer_room,
                        answer_room_share=args.answer_room_share, eval_data=args.eval_data,
                        eval_every=args.eval_every, merge=args.merge,
                        device=args.device, dtype=args.dtype, bf16=args.bf16,
                        time_limit_minutes=args.time_limit_minutes, seed=args.seed)
    try:
        summary = finetune(config)
    except ImportError as exc:  # peft missing: the message names the extra, no traceback needed
        raise ValueError(str(exc)) from None
    last = summary["log"][-1]["loss"] if summary["log"] else float("nan")
    print(f"fine-tuned {summary['steps_done']} steps ({summary['tokens']:,} tokens) in "
          f"{summary['train_time_s'] / 60:.1f} min, {summary['trainable_parameters']:,} trainable parameters, "
          f"final loss {last:.4f}; adapter: {summary['adapter']}"
          + (f"; merged checkpoint: {summary['merged']}" if summary["merged"] else ""))
    if summary["probe"]:
        start, end = summary["probe"][0], summary["probe"][-1]
        print("held out, exact in one shot: " + "; ".join(
            f"{view} {start[view]['exact']:.1%} -> {end[view]['exact']:.1%}" for view in ("reuse", "context")))
    stopped = summary.get("stopped_by")
    if stopped:  # what was saved is a partial run: a script chaining on the exit status must not take it as whole
        print(f"stopped by {stopped} after {summary['steps_done']} of {config.steps} steps: the adapters saved are "
              "those steps'", file=sys.stderr)
        return {"Ctrl-C": 130, "SIGTERM": 143}.get(stopped, 1)
    return 0


def _cmd_eval_tasks(args: argparse.Namespace) -> int:
    from acache_lab.eval.tasks import main

    return main(_with_default_model(args))


def _with_default_model(args: argparse.Namespace) -> argparse.Namespace:
    if args.model is None:
        from acache.paths import default_model

        args.model = str(default_model())
    return args


def _refuse_no_shared_affixes(model: str, what: str) -> None:
    """A study of affix K/V needs a family that has them: refused before the model loads, not in a traceback."""
    from acache.models.loader import read_config

    family, _ = read_config(model)
    if getattr(family, "state_cache", False):
        raise ValueError(f"{what} measures an affix's K/V computed alone, which a {family.family} model does not "
                         "have (its cache is built per request): use a llada, dream or fast_dllm_v2 model")


def _cmd_eval_staleness(args: argparse.Namespace) -> int:
    from acache_lab.eval.staleness import main

    args = _with_default_model(args)
    _refuse_no_shared_affixes(args.model, "eval staleness")
    return main(args)


def _cmd_eval_accuracy(args: argparse.Namespace) -> int:
    from acache_lab.eval.accuracy import main

    return main(_with_default_model(args))


def _cmd_eval_lm(args: argparse.Namespace) -> int:
    from acache_lab.eval.lm import main

    return main(args)


def _cmd_eval_auto_reuse(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from acache_lab.eval.auto_reuse import measure, report

    args = _with_default_model(args)
    logging.getLogger("acache.server").setLevel(logging.ERROR)  # each mismatch is counted in the table instead
    results = measure(args.model, args.tasks.split(","), args.stories, args.rounds, args.concurrency, args.checks,
                      args.audit_every, args.seed)
    print(report(results, Path(args.json) if args.json else None))
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from acache_lab.bench.engine import main

    return main(args)


def _add_engine_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: random SmolLM2-135M-shaped LLaDA)")
    p.add_argument("--shape", default=None, choices=["smollm2-135m", "llada-8b"],
                   help="the random model's shape when no --model is given (default: smollm2-135m)")
    p.add_argument("--workload", default="shape", choices=["shape", "tasks"],
                   help="shape: random tokens in the paper's GSM8K-like shape; tasks: held-out qa1 stories (needs "
                        "--model)")
    p.add_argument("--sentences", type=_positive_int, default=None, help="story length for --workload tasks (8)")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--requests", type=int, default=None,
                   help="requests a run (default: the batch size), through an engine of that many slots")
    p.add_argument("--affix-len", type=int, default=None, help="--workload shape: the shared affix (700)")
    p.add_argument("--question-len", type=int, default=None, help="--workload shape: a request's own tokens (60)")
    p.add_argument("--gen-length", type=int, default=None, help="--workload shape: tokens generated (256)")
    p.add_argument("--block-length", type=int, default=None, help="--workload shape: a block (32)")
    p.add_argument("--steps", type=int, default=None,
                   help="--workload shape: fixed steps (64: gen/4), so both modes do equal work")
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--selector", default=DEFAULT_SELECTOR, choices=SELECTORS,
                   help=f"ACache's anchor selector (default: {DEFAULT_SELECTOR}, the server's)")
    p.add_argument("--anchor-pass", default=None, choices=ANCHOR_PASSES,
                   help="where the anchors are chosen: one (inside the first refresh) or two (a selection of its "
                        "own); default: one where the selector has that form")
    p.add_argument("--anchor-depth", type=float, default=None,
                   help="also time ACache whose one-pass selection scores through this share of the layers, as a "
                        "mode beside plain ACache")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_size, default="4GiB", help="size of the KV page pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per mode and batch size, interleaved; the median by wall time is reported")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed warm-up pair before timing")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--plot", default=None, help="also draw the three ratios against their ideals to this PNG")
    p.add_argument("--focus-layers", type=int, default=None,
                   help="also run ACache with FOCUS: this many layers on the whole block, then the focused tokens")
    p.add_argument("--focus-ratio", type=float, default=None, help="share of a block's masks FOCUS keeps (0.25)")
    p.add_argument("--far-mask-window", type=int, default=None,
                   help="also run ACache with far-mask pruning: blocks attended past the current one")
    p.add_argument("--probe-step", action="store_true",
                   help="also run ACache with probe_step: the selection probe decodes the first step")
    p.add_argument("--anchor-query", default=None, choices=ANCHOR_QUERIES,
                   help="also run ACache with its queries from here (shallow: the probe's first layers only)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers (compiled in the untimed warm-up, which then runs every "
                        "mode at batch 1 and 2: dynamic shapes serve the larger batches)")
    p.add_argument("--fastdllm-loop", action="store_true",
                   help="also time a Fast-dLLM-style loop (upstream generate_with_dual_cache's shape: the batch in "
                        "lockstep, whole prompts recomputed at every block start)")
    p.add_argument("--no-mixed", dest="mixed", action="store_false",
                   help="skip the heterogeneous batch (mixed gen_length and anchor ratios) at the largest batch size")
    _add_model_args(p)


def _cmd_bench_decode(args: argparse.Namespace) -> int:
    from acache_lab.bench.decode import main

    return main(args)


def _cmd_bench_context(args: argparse.Namespace) -> int:
    from acache_lab.bench.context import main

    return main(args)


def _cmd_bench_scoring(args: argparse.Namespace) -> int:
    from acache_lab.bench.scoring import main

    return main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from acache_lab.demo import main

    return main(_with_default_model(args))


OUTPUT_ARGS = ("out", "json", "plot")


def _guarded(func, out: str | None = "dir"):
    """Runs a command after checking that its outputs overwrite no file git tracks (unless --overwrite) and can be
    written where they go: ``--out`` a folder (``out="dir"``) or a file (``"file"``), ``--json`` and ``--plot``
    files. A long run that finds out at its end loses what it computed."""
    def run(args: argparse.Namespace) -> int:
        from acache_lab.tracked import refuse_tracked

        refuse_tracked([getattr(args, name, None) for name in OUTPUT_ARGS], args.overwrite)
        kinds = {"out": out, "json": "file", "plot": "file"}
        for name, kind in kinds.items():
            where = getattr(args, name, None)
            if where is not None and kind is not None:
                writable(Path(where), kind, f"--{name}")
        return func(args)
    return run


def writable(path: Path, kind: str, flag: str) -> None:
    """Refuses a ``flag`` path that is the wrong kind of thing or lies under a file; makes its folder."""
    if kind == "dir" and path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; it names a folder")
    if kind == "file" and path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; it names a file")
    folder = path if kind == "dir" else path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"{flag} {path}: a file lies on its way") from None


def _add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="allow the outputs to replace files tracked by git (the published figures and model)")


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the research commands to the ``acache`` sub-command parser ``sub``."""
    p = sub.add_parser("demo", help="the shipped model answers questions on shared affixes, each policy beside "
                                    "the expected answer (make run)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    _add_model_args(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("train", help="train the project's small diffusion LM on the task suite")
    p.add_argument("--config", required=True, action="append",
                   help="JSON training config (see configs/); repeat it to run several in order, each "
                        "starting from the one before through its init_from")
    p.add_argument("--out", default=None, help="override the (last config's) output directory")
    p.add_argument("--resume", action="store_true",
                   help="continue a run stopped by Ctrl-C or its time limit: configs already finished are skipped, "
                        "the stopped one continues from its output directory")
    p.add_argument("--restart", action="store_true",
                   help="train a stopped run again from the start instead of resuming it (what it trained is lost)")
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_train, out=None))  # the trainer checks its own

    p = sub.add_parser("finetune-affix", help="LoRA fine-tuning of a checkpoint (LLaDA, Dream) with the affix "
                                              "isolation objective (needs the lora extra: pip install "
                                              "'acache[lora]'; docs/model.md)")
    p.add_argument("--model", required=True, help="checkpoint directory in the upstream layout")
    p.add_argument("--data", required=True, help='JSONL, one {"affix", "prompt", "answer", "layout"} record a line '
                   '(optional "answer_prompt")')
    p.add_argument("--out", required=True, help="output directory: adapter/, finetune_log.json, merged/")
    p.add_argument("--rank", type=_positive_int, default=16, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--targets", default=None, help="comma-separated module names to adapt (default: the attention "
                   "and MLP projections, q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    p.add_argument("--steps", type=_positive_int, default=500)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10, help="steps of linear warm-up")
    p.add_argument("--batch-size", type=_positive_int, default=4)
    p.add_argument("--isolation", type=float, default=0.5,
                   help="share of rows trained as direct reuse serves them")
    p.add_argument("--neighbours", type=float, default=0.0,
                   help="weight of the neighbour term on the isolated rows: each affix token predicts the tokens "
                        "around it (docs/accuracy.md, 'Neighbours named inside the affix'); 0: off")
    p.add_argument("--neighbour-layer", type=int, default=None,
                   help="the layer whose output the term trains (default: a quarter of the way down)")
    p.add_argument("--neighbour-span", type=_positive_int, default=4, help="tokens either side each predicts")
    p.add_argument("--neighbour-rank", type=int, default=64, help="rank of the term's maps (0: full hidden x hidden)")
    p.add_argument("--neighbour-pairs", type=_positive_int, default=32,
                   help="pairs each offset predicts a step, sampled: bounds the output embedding's cost")
    p.add_argument("--teacher", type=float, default=0.0,
                   help="weight of the teacher term on the rows attending in context: KL(checkpoint || adapted "
                        "model) at their masked answer tokens, the checkpoint's predictions taken with the adapters "
                        "off; 0: off")
    p.add_argument("--answer-room", type=int, default=0,
                   help="up to this many more EOS columns after a drawn row's answer, so that the model learns to end "
                        "an answer in a max_tokens longer than it (docs/accuracy.md, 'Answers given room'); 0: off")
    p.add_argument("--answer-room-share", type=float, default=0.5, help="share of draws given --answer-room")
    p.add_argument("--eval-data", default=None,
                   help="held-out JSONL in --data's format, each answer read in one shot with its affix computed "
                        "alone and in context, before training, every --eval-every steps and at the end")
    p.add_argument("--eval-every", type=_positive_int, default=100,
                   help="steps between --eval-data's probes (without --eval-data: no probe)")
    p.add_argument("--merge", action="store_true",
                   help="also write OUT/merged: the checkpoint with the adapters folded in, served by direct reuse")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: on a GPU)")
    p.add_argument("--time-limit-minutes", type=float, default=None, help="stop (and save) after this long")
    p.add_argument("--seed", type=int, default=0)
    _add_model_args(p)
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_finetune_affix))

    evaluate = sub.add_parser("eval", help="studies").add_subparsers(dest="eval", required=True)
    p = evaluate.add_parser("tasks", help="held-out exact match per task and layout (full recomputation)")
    _add_study_args(p, examples=100)
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: qa1,arith,twohop; codes is the "
                   "demonstration task of models/acache-tiny-plus)")
    p.add_argument("--batch-size", type=_positive_int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--block-length", type=_positive_int, default=None,
                   help="blocks that divide each task's answer region, or --gen-length (default: the region as one "
                   "block)")
    p.add_argument("--threshold", type=float, default=None,
                   help="the threshold rule's confidence (default 0.9; 1.0 commits one token a step)")
    p.add_argument("--focus-layers", type=int, default=None, help="FOCUS: layers run on the whole block")
    p.add_argument("--focus-ratio", type=float, default=None, help="FOCUS: share of a block's masks kept")
    p.add_argument("--far-mask-window", type=int, default=None, help="far-mask pruning: blocks attended ahead")
    _add_gen_length(p)
    p.add_argument("--layouts", default=None, help="comma-separated layouts (default: prefix,infix,suffix; a "
                   "block-causal model cannot read an affix placed after the answer)")
    _add_model_args(p)
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_eval_tasks))

    p = evaluate.add_parser("staleness", help="per-layer cosine of affix K/V computed alone vs in context")
    _add_study_args(p, examples=50)
    p.add_argument("--out", default="results/staleness", help="directory for staleness.json and staleness.png")
    _add_model_args(p)
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_eval_staleness))

    p = evaluate.add_parser("accuracy", help="exact match per task x layout x selector x anchor ratio")
    _add_study_args(p, examples=300)
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: qa1,arith,twohop; codes has "
                   "demonstrations as its affix)")
    p.add_argument("--layouts", default=None, help="comma-separated layouts of prefix,infix,suffix (default: all "
                   "three), and two-affix for codes (demonstrations and the request's story, each cached)")
    p.add_argument("--batch-size", type=_positive_int, default=32)
    p.add_argument("--out", default="results/accuracy", help="directory for accuracy.json/.md/.png")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--bicache-profile", default=None,
                   help="a depth table from `acache bicache-profile`: adds the bicache-profiled selector")
    p.add_argument("--selectors", default=None, help="comma-separated study selectors (default: every one; "
                   "attention-probe-step is ACache with probe_step)")
    p.add_argument("--ratios", default=None, help="comma-separated anchor ratios (default: 0,0.1,0.2,0.3,0.5,1)")
    _add_gen_length(p)
    _add_model_args(p)
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_eval_accuracy))

    p = evaluate.add_parser("lm", help="lm-evaluation-harness against acache serve on the model's own tasks "
                            "(needs pip install 'acache[lmeval]')")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--limit", type=int, default=50, help="held-out documents a task")
    p.add_argument("--seed", type=int, default=0, help="held-out seed stream")
    p.add_argument("--tasks", type=lambda s: s.split(","), default=None,
                   help="comma-separated subset of acache_qa1, acache_arith, acache_qa1_mc, acache_arith_mc")
    p.add_argument("--samples", type=int, default=32, help="the server's --loglikelihood-samples")
    p.add_argument("--port", type=int, default=8765, help="port of the server this command starts")
    p.add_argument("--base-url", default=None, help="use the server running here instead of starting one (it must "
                   "serve the model as 'acache')")
    p.add_argument("--out", default="build/lm_eval", help="task files, lm-eval's results and lm_eval.md")
    p.add_argument("--variance", action="store_true", help="instead: the log-likelihood estimate's spread over 8 "
                   "seeds at 1, 4, 16 and 64 samples, on --limit arithmetic documents (no server, no lm-eval)")
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_eval_lm))

    p = evaluate.add_parser("auto-reuse", help="how often the server's automatic reuse changes a chat answer, "
                            "--auto-reuse on vs verified against off")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--tasks", default="qa1,twohop,arith,count", help="comma-separated held-out tasks")
    p.add_argument("--stories", type=_positive_int, default=4,
                   help="held-out contexts a task, each asked all its questions")
    p.add_argument("--rounds", type=_positive_int, default=3, help="times the whole burst is sent")
    p.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight at once")
    p.add_argument("--checks", type=int, default=4, help="the server's --reuse-checks")
    p.add_argument("--audit-every", type=int, default=16, help="the server's --reuse-audit-every")
    p.add_argument("--seed", type=int, default=0, help="held-out seed stream")
    p.add_argument("--json", default=None, help="also write the figures here")
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_eval_auto_reuse))

    p = sub.add_parser("bicache-profile", help="build BiCache's layer-depth table from a calibration set")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--calibration", default=None,
                   help="JSONL of {affix, prompt, layout, answer_prompt}, or 'tasks' for requests from the task "
                        "suite (the project's own models); default: random-token requests")
    p.add_argument("--samples", type=_positive_int, default=64, help="requests for 'tasks' or random calibration")
    p.add_argument("--gen-length", type=_positive_int, default=32)
    p.add_argument("--tau", type=_unit_interval, default=0.97, help="cosine a layer's affix K/V must keep, in (0, 1]")
    p.add_argument("--bins", type=_positive_int, default=10)
    p.add_argument("--seed", type=int, default=0)
    _add_model_args(p)
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_bicache_profile, out="file"))

    bench_parser = sub.add_parser("bench", help="benchmarks (default: the engine benchmark)")
    _add_engine_bench_args(bench_parser)
    _add_overwrite(bench_parser)
    bench_parser.set_defaults(func=_guarded(_cmd_bench_engine))
    bench = bench_parser.add_subparsers(dest="bench", required=False)
    p = bench.add_parser("engine", help="dual cache alone vs ACache on the paged engine (the paper's Tables 2-4)")
    _add_engine_bench_args(p)
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_bench_engine))
    p = bench.add_parser("serve", help="load a running server: throughput, latency, time to first block")
    p.add_argument("--concurrency", type=_positive_int, default=8)
    p.add_argument("--seed", type=int, default=0, help="seed of the task-suite story (of the documents, with "
                   "--replicas)")
    p.add_argument("--json", default=None, help="also write the report and every request's timing here")
    group = p.add_argument_group("a running server (without --replicas)")
    group.add_argument("--url", default=None, help=f"server base URL (default {SERVE_URL_DEFAULTS['url']})")
    group.add_argument("--requests", type=_positive_int, default=None, help="default 32")
    group.add_argument("--api-key", default=None)
    group.add_argument("--max-tokens", type=_positive_int, default=None, help="default 32")
    group.add_argument("--system-prompt", default=None, help="shared system prompt (default: the workload's)")
    group.add_argument("--prompts", default=None, choices=["auto", "english", "tasks"],
                       help="auto (default): English unless the server's tokenizer refuses it, then the task suite's "
                            "words")
    group = p.add_argument_group("cluster: start N replicas here, once per router, on the documents workload")
    group.add_argument("--replicas", type=_positive_int, default=None, help="start this many replicas (instead of "
                       "--url)")
    group.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    group.add_argument("--documents", type=_positive_int, default=None, help="default 6")
    group.add_argument("--questions", type=_positive_int, default=None, help="requests per document (default 12)")
    group.add_argument("--sentences", type=_positive_int, default=None, help="sentences a document (six tokens "
                       "each; default 6)")
    group.add_argument("--max-affix-tokens", type=_positive_int, default=None,
                       help="each replica's affix share (default: its share of the documents, documents/replicas)")
    group.add_argument("--threads", type=_positive_int, default=None, help="torch threads per replica (default 1)")
    group.add_argument("--port", type=_port, default=None, help="default 8000")
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_bench_serve))

    p = bench.add_parser("decode", help="tokens/s with no cache, prefix cache and dual cache")
    p.add_argument("--model", default=None, help="checkpoint directory (default: random ~100M LLaDA shape)")
    p.add_argument("--family", default=None, choices=["llada", "dream", "fast_dllm_v2"],
                   help="the random model's family (default llada; a --model's config says its own)")
    p.add_argument("--prompt-length", type=_positive_int, default=128, help="random prompt tokens a request")
    p.add_argument("--gen-length", type=_positive_int, default=256, help="tokens generated a request")
    p.add_argument("--block-length", type=_positive_int, default=32, help="block size of the generation region")
    p.add_argument("--steps", type=_positive_int, default=64, help="low-confidence steps in all (fixed, so every "
                   "cache does the same number of forwards)")
    p.add_argument("--batch-size", type=_positive_int, default=1, help="requests decoded together")
    p.add_argument("--caches", default="none,prefix,dual", help="comma-separated caches to time, side by side")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per cache; the median is reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--json", default=None, help="also write the results to this file")
    _add_model_args(p)
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_bench_decode))

    p = bench.add_parser("scoring", help="lm-eval-shaped echo+logprobs requests/s on acache serve, this tree "
                         "beside a baseline commit (--baseline-ref)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--limit", type=_positive_int, default=2, help="held-out documents of each multiple-choice task")
    p.add_argument("--seed", type=int, default=0, help="held-out seed stream")
    p.add_argument("--samples", type=_positive_int, default=32, help="the servers' --loglikelihood-samples")
    p.add_argument("--baseline-ref", default=None,
                   help="also serve this commit's acache (git archive into a temporary directory) and compare")
    p.add_argument("--per-request", type=_positive_int, default=1,
                   help="prompts a request (lm-eval's batch_size; 1 is its default)")
    p.add_argument("--concurrency", type=_positive_int, default=1,
                   help="requests in flight (lm-eval's num_concurrent; 1 is its default)")
    p.add_argument("--pause", type=float, default=1.0,
                   help="seconds, untimed, before each round: the other server's threads go quiet first")
    p.add_argument("--port", type=_port, default=8790, help="port of the first server (the second: +1)")
    p.add_argument("--json", default=None, help="also write every latency and reading here")
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_bench_scoring))

    p = bench.add_parser("context", help="block diffusion: step latency and cache size against context length, "
                         "attention vs state-space")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536",
                   help="comma-separated context lengths in tokens")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="attention heads (the state-space mixer uses heads of 64)")
    p.add_argument("--state-size", type=int, default=64, help="the state-space mixer's state a channel")
    p.add_argument("--block-length", type=int, default=32, help="tokens a block (the step denoises one)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps a point; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the points to this file")
    p.add_argument("--plot", default=None, help="also draw latency and cache size against context to this PNG")
    p.add_argument("--serve", type=int, default=0, metavar="N",
                   help="also serve N requests of each --serve-lengths context through the engine, both variants "
                        "under one --cache-budget-mib")
    p.add_argument("--serve-lengths", default="1024,4096,16384", help="context lengths of the served requests")
    p.add_argument("--cache-budget-mib", type=float, default=256.0, help="the engine's cache budget with --serve")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    _add_overwrite(p)
    p.set_defaults(func=_guarded(_cmd_bench_context))
    _options_after_the_benchmark(bench_parser, bench)


def _options_after_the_benchmark(parser: argparse.ArgumentParser, benches: argparse._SubParsersAction) -> None:
    """``acache bench [options]`` runs the engine benchmark; ``acache bench NAME [options]`` another. Options
    given before a NAME would be read by ``bench`` and then replaced by NAME's defaults, silently: refused."""
    parse = parser.parse_known_args

    def checked(args=None, namespace=None):
        given = list(args) if args is not None else sys.argv[1:]
        named = next((i for i, a in enumerate(given) if a in benches.choices), None)
        if named is not None and any(a.startswith("-") for a in given[:named]):
            parser.error(f"put the options after the benchmark's name: acache bench {given[named]} "
                         + " ".join(given[:named] + given[named + 1:]))
        return parse(args, namespace)

    parser.parse_known_args = checked
