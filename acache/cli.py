"""The ``acache`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points, version
from pathlib import Path

from acache.models.config import ConfigError
from acache.models.loader import CheckpointError
from acache.models.registry import ALL_CLASSES
from acache.policies import (
    ANCHOR_PASSES,
    ANCHOR_QUERIES,
    CACHE_POLICIES,
    COMMIT_RULES,
    DEFAULT_SELECTOR,
    LAYOUTS,
    SELECTOR_CHOICES,
)
from acache.sampling_params import SamplingParams
from acache.scoring import DEFAULT_SAMPLES
from acache.server.logprobs import DEFAULT_SCORING_TOKENS
from acache.server.reuse_gate import AUTO_REUSE_MODES

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ConfigError, CheckpointError,
               TypeError)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = p.add_argument_group("decoding")
    g.add_argument("--gen-length", type=int, default=d.gen_length, help="tokens to generate")
    g.add_argument("--block-length", type=int, default=d.block_length, help="block size")
    g.add_argument("--steps", type=int, default=d.steps, help="low-confidence steps in all")
    g.add_argument("--remasking", default=d.remasking, choices=COMMIT_RULES)
    g.add_argument("--threshold", type=float, default=d.threshold, help="confidence threshold")
    g.add_argument("--factor", type=float, default=d.factor, help="factor of the factor rule")
    g.add_argument("--temperature", type=float, default=d.temperature, help="0 = argmax")
    g.add_argument("--cache", default=d.cache, choices=CACHE_POLICIES)
    g.add_argument("--refresh-interval", type=int, default=d.refresh_interval,
                   help="also refresh every N steps in a block")
    g.add_argument("--seed", type=int, default=d.seed, help="sampling seed")
    a = p.add_argument_group("affix reuse")
    a.add_argument("--affix", default=None, help="shared span (text) placed around each prompt by --layout")
    a.add_argument("--affix-file", default=None, help="read the shared span from this file")
    a.add_argument("--layout", default="prefix", choices=LAYOUTS,
                   help="prefix [affix][prompt][GEN], infix [prompt][affix][answer][GEN], suffix [prompt][GEN][affix]")
    a.add_argument("--answer-prompt", default="", help="text between the affix and the generation region")
    a.add_argument("--selector", "--affix-policy", dest="selector", default=None, choices=SELECTOR_CHOICES,
                   help=f"reuse the affix's shared K/V with this selector (default with --affix, as the server's: "
                        f"{DEFAULT_SELECTOR}, or none for a model trained to be reused): attention is ACache, none "
                        "direct reuse, all full recompute; the rest are baselines")
    a.add_argument("--anchor-ratio", type=float, default=d.anchor_ratio,
                   help="share of affix tokens recomputed")
    a.add_argument("--anchor-query", default=d.anchor_query, choices=ANCHOR_QUERIES,
                   help="where ACache's queries come from: the probe, a no-cache forward (full), or the probe's "
                        "first layers only (shallow: three tenths of them, at least one)")
    a.add_argument("--anchor-pass", default=None, choices=ANCHOR_PASSES,
                   help="where anchors are chosen: one (inside the first refresh) or two (a selection of its own "
                        "first; first-k, random, none and all need none and choose at admission); default: one "
                        "where the selector has that form")
    a.add_argument("--anchor-depth", type=float, default=None,
                   help="share of the layers a one-pass selection scores through, in (0, 1]: lower is cheaper on a "
                        "deep model, the layers after it run with the anchors alone; default: 1, every layer")
    a.add_argument("--probe-step", action="store_true",
                   help="let the anchor-selection probe decode the first step (one forward fewer a request)")
    a.add_argument("--affix-cache", default=None, help="directory to load the affix cache from and save it to")
    a.add_argument("--bicache-profile", default=None, help="depth table for --selector bicache-profiled")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default (from where it is defined), except where there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


class DefaultsParser(argparse.ArgumentParser):
    """Sub-command parsers whose help shows every default."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's own), float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")


def _add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="split the model over this many processes (CPU: gloo; CUDA: nccl, one GPU each)")


def _checked(cast: type, ok, what: str):
    """An argparse ``type`` that parses with ``cast`` and names ``what`` it wanted when ``ok`` refuses it."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
        return value
    return parse


_positive_int = _checked(int, lambda v: v > 0, "a positive integer")
_non_negative_int = _checked(int, lambda v: v >= 0, "a non-negative integer")
_port = _checked(int, lambda v: 1 <= v <= 65535, "a port number (1-65535)")
_non_negative_float = _checked(float, lambda v: 0 <= v < float("inf"), "a non-negative number of seconds")
_non_negative_number = _checked(float, lambda v: 0 <= v < float("inf"), "a non-negative number")


def parse_size(text: str) -> int:
    """Bytes from ``2GiB``, ``512MiB``, ``1.5GB`` or a plain number."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (give bytes, or a number with a unit such as "
                                         "512MiB or 2GiB)") from None
    if unit not in units or value < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (units: {', '.join(u for u in units if u)})")
    return int(value * units[unit])


def _cmd_generate(args: argparse.Namespace) -> int:
    from acache import LLM, Affix, SamplingParams
    from acache.affix.persistence import AffixStoreError
    from acache.affix.prompt import layout_segments

    policy = args.selector
    if policy is None and (args.affix or args.affix_file):  # the server's default for this model
        from acache.models.config import affix_training
        from acache.models.loader import read_config

        cls, config = read_config(args.model)
        if getattr(cls, "state_cache", False):  # its cache is built per request: the affix is read with it
            policy = None
        else:
            policy = "none" if affix_training(config) is not None else DEFAULT_SELECTOR
    params = SamplingParams(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                            remasking=args.remasking, threshold=args.threshold, factor=args.factor,
                            temperature=args.temperature, cache=args.cache,
                            refresh_interval=args.refresh_interval, seed=args.seed,
                            selector=policy, anchor_ratio=args.anchor_ratio,
                            anchor_query=args.anchor_query, probe_step=args.probe_step, anchor_pass=args.anchor_pass,
                            anchor_depth=args.anchor_depth)
    affix_text = args.affix
    if args.affix_file:
        path = Path(args.affix_file)
        if not path.is_file():
            raise FileNotFoundError(f"affix file not found: {path}")
        affix_text = path.read_text()
    if args.chat and affix_text is not None and (args.layout != "prefix" or args.answer_prompt):
        raise ValueError("--chat with an affix makes it the chat's system prompt, before the prompt: --layout "
                         f"{args.layout!r} and --answer-prompt do not apply (drop them, or --chat)")
    cache_dir = Path(args.affix_cache) if args.affix_cache else None
    if cache_dir is not None and cache_dir.exists() and not cache_dir.is_dir():
        raise NotADirectoryError(f"--affix-cache {cache_dir} exists and is not a directory")
    if cache_dir is not None and args.tensor_parallel_size > 1:
        raise ValueError("--affix-cache is not supported with --tensor-parallel-size > 1 (each rank holds a "
                         "slice of every affix)")
    if cache_dir is not None:  # refused before any work, not after it
        from acache.models.loader import read_config

        family, _ = read_config(args.model)
        if getattr(family, "state_cache", False):
            raise ValueError(f"--affix-cache: the {family.family} family shares no affix K/V, so there is no affix "
                             "cache to save")
    # loaded as a server loads it: what cannot be trusted is set aside and logged, and the prompts are answered
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
              affix_cache_dir=cache_dir if cache_dir is not None and cache_dir.is_dir() else None,
              affix_cache_quarantine=True, bicache_profile=args.bicache_profile,
              tensor_parallel_size=args.tensor_parallel_size)
    loaded = _loaded_affixes(llm.affix_cache_report, cache_dir)
    if loaded:  # on stderr: stdout holds the answers (JSON lines with --json)
        print(f"acache generate: {loaded}", file=sys.stderr)
    prompts = args.prompt
    chat = args.chat
    if affix_text is not None and chat:  # the affix is the chat's system prompt, reused as the server reuses it
        prompts = [llm.chat_prompt([{"role": "system", "content": affix_text}, {"role": "user", "content": p}])
                   for p in args.prompt]
        chat = False
    elif affix_text is not None:
        affix = Affix(affix_text, name="affix")
        prompts = [layout_segments(args.layout, affix, p, args.answer_prompt) for p in args.prompt]
    try:
        outputs = llm.generate(prompts, params, chat=chat)
    finally:
        llm.close()
    for question, out in zip(args.prompt, outputs, strict=True):
        s = out.stats
        affix = s.affix
        if args.json:
            record = {"prompt": question, "text": out.text, "token_ids": out.token_ids,
                      "finish_reason": out.finish_reason, "error": out.error, "nfe": s.nfe,
                      "forward_time_s": s.forward_time_s, "wall_time_s": s.wall_time_s}
            if affix is not None:
                record["affix"] = {"selector": affix.selector, "anchor_ratio": affix.anchor_ratio,
                                   "anchor_depth": params.resolved_anchor_depth,
                                   "anchors": affix.anchors, "recomputed_per_refresh": affix.recomputed_per_refresh,
                                   "cached_tokens": affix.cached_tokens,
                                   "hits": affix.affix_hits, "misses": affix.affix_misses,
                                   "selection_time_s": affix.selection_time_s}
            print(json.dumps(record))
            continue
        print(f"> {question}")
        if out.error is not None:
            print(f"error: {out.error}\n")
            continue
        print(out.text or _why_empty(out, llm.tokenizer))
        tokens = f"{s.num_generated_tokens} token{'s' if s.num_generated_tokens != 1 else ''}"
        line = (f"[{tokens}, NFE {s.nfe} ({s.refreshes} refreshes), "
                f"forward {s.forward_time_s:.2f}s, wall {s.wall_time_s:.2f}s, cache {params.cache}")
        if affix is not None:
            line += (f"; affix {affix.selector} {'hit' if affix.affix_hits else 'miss'}, "
                     f"{len(affix.anchors)}/{affix.affix_tokens} anchors, "
                     f"{affix.recomputed_per_refresh} tokens a refresh")
        print(line + "]\n")
    saved = True
    if cache_dir is not None:  # after the answers: a save that fails loses none of them
        try:
            llm.save_affix_cache(cache_dir)
        except (OSError, AffixStoreError) as exc:  # a full disk, a directory it may not write
            print(f"acache generate: error: could not save the affix cache to {cache_dir}: {exc}", file=sys.stderr)
            saved = False
    failed = sum(out.error is not None for out in outputs)
    if failed:
        print(f"acache generate: error: {failed} of {len(outputs)} prompts failed", file=sys.stderr)
    return 1 if failed or not saved else 0


def _why_empty(out, tokenizer) -> str:
    """What an empty answer means, in place of printing nothing."""
    if out.token_ids:
        return (f"(no text: the {len(out.token_ids)} generated tokens are special tokens, which decode to nothing: "
                f"{out.token_ids})")
    if out.stop_token_id is not None:
        stop = tokenizer.decode([out.stop_token_id], skip_special_tokens=False)
        return (f"(no text: the model's first token was its end-of-text token {stop!r}, so the answer is empty; a "
                "model ends at once when the prompt is not one it answers: the shipped model answers questions about "
                "a story, e.g. --affix 'story : mary moved to the kitchen .' "
                "--prompt 'question : where is mary ? answer :' answers kitchen)")
    return "(no text)"


def _cmd_make_random_checkpoint(args: argparse.Namespace) -> int:
    from acache.models.checkpoint import make_random_checkpoint

    out = make_random_checkpoint(
        args.family, args.out, layers=args.layers, hidden_size=args.hidden_size, heads=args.heads,
        kv_heads=args.kv_heads, intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
        max_seq_len=args.max_seq_len, seed=args.seed, shards=args.shards, dtype=args.dtype, std=args.std,
        block_size=args.block_size)
    print(f"wrote a random {args.family} checkpoint to {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    from acache import LLM
    from acache.server.app import create_app

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("acache").setLevel("DEBUG" if args.log_level == "trace" else args.log_level.upper())
    cache_dir = Path(args.affix_cache_dir) if args.affix_cache_dir else None
    if cache_dir is not None and cache_dir.exists() and not cache_dir.is_dir():
        raise NotADirectoryError(f"--affix-cache-dir {cache_dir} exists and is not a directory")
    if args.replicas is not None or args.ray_address is not None:
        if args.tensor_parallel_size > 1:
            raise ValueError("--tensor-parallel-size with --replicas is not supported yet: a cluster's replicas "
                             "are one process each")
        return _serve_cluster(args, cache_dir)
    if cache_dir is not None and args.tensor_parallel_size > 1:
        raise ValueError("--affix-cache-dir is not supported with --tensor-parallel-size > 1 (each rank holds a "
                         "slice of every affix)")
    # before the weights load, which may take minutes (one process: a cluster's port is Ray Serve's, and may be
    # held by its proxy from an earlier run, or on another machine)
    _port_free(args.host, args.port)
    warm = cache_dir is not None and cache_dir.is_dir()
    llm = LLM(args.model, affix_cache_dir=cache_dir if warm else None, affix_cache_quarantine=True,
              tensor_parallel_size=args.tensor_parallel_size, **_serve_llm_kwargs(args))
    loaded = _loaded_affixes(llm.affix_cache_report, cache_dir)
    if loaded:
        print(loaded, flush=True)
    name = args.served_model_name or Path(args.model).resolve().name
    api_key = args.api_key or os.environ.get("ACACHE_API_KEY") or None
    app = create_app(llm, name, affix_cache_dir=cache_dir, **_serve_app_kwargs(args, api_key))
    print(f"serving {name} on http://{args.host}:{args.port} (OpenAI-compatible: /v1/completions, "
          f"/v1/chat/completions)", flush=True)
    try:
        serve_until_signalled(app, args)
    finally:
        app.state.close()  # done already unless a forced quit (a second Ctrl-C) made uvicorn skip the app's end
    return 0


def _loaded_affixes(report, cache_dir: Path | None) -> str | None:
    """The line that says what an affix cache directory gave (None: it held nothing)."""
    if report is None or not (report.loaded or report.quarantined):
        return None
    moved = sum(q.moved_to is not None for q in report.quarantined)
    left = len(report.quarantined) - moved
    aside = (f"; {moved} set aside into {cache_dir / 'quarantine'}" if moved else "") + \
            (f"; {left} skipped where {'they are' if left > 1 else 'it is'}" if left else "")
    why = " (the warnings above say why; each is recomputed when a request next uses it)" if aside else ""
    return f"loaded {report.loaded} shared affixes from {cache_dir}{aside}{why}"


def _port_free(host: str, port: int) -> None:
    """Raises a ValueError naming the address when the server could not listen there (in use, or not this host's),
    found before any work instead of after the model loaded and the banner said it was serving."""
    import socket

    try:  # every address the host names, as asyncio's create_server binds them ("" is every interface)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot serve on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise ValueError(f"cannot serve on {host}:{port}: {exc.strerror} (another server there? pick "
                                 "--port)") from None


def serve_until_signalled(app, args: argparse.Namespace) -> None:
    """uvicorn, with the app told when a signal starts the shutdown: its in-flight work then has
    ``--shutdown-grace`` seconds before it is cancelled with a 503 (uvicorn's own timeout, a little later, is
    the backstop)."""
    import signal
    import threading

    import uvicorn

    from acache.server.http import json_error_protocol

    class Server(uvicorn.Server):
        interrupts = 0

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.interrupts += 1
                if self.interrupts == 1:  # a second Ctrl-C ends the grace period now (503s, then the usual end); on
                    # a thread of its own, as cancelling takes the engine's lock, which this thread may hold
                    threading.Thread(target=app.state.drain.expire, daemon=True, args=(
                        "the server was told twice to stop while this request was in flight",)).start()
                    return
            app.state.drain.begin(args.shutdown_grace)
            super().handle_exit(sig, frame)  # a third Ctrl-C: uvicorn quits without waiting (app.state.close saves)

    try:
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                              http=json_error_protocol(), timeout_graceful_shutdown=int(args.shutdown_grace) + 5)).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it has shut down on: handled, so no traceback
        print("stopped", flush=True)
        raise SystemExit(130) from None  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


def _serve_llm_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings of ``acache serve``, the same for one process and for every cluster replica."""
    return {"dtype": args.dtype, "device": args.device, "max_batch_size": args.max_num_seqs,
            "page_size": args.page_size, "kv_cache_memory": args.kv_cache_memory,
            "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
            "max_affix_tokens": args.max_affix_tokens, "compile": args.compile}


def _serve_app_kwargs(args: argparse.Namespace, api_key: str | None) -> dict:
    return {"api_key": api_key, "max_request_bytes": args.max_request_bytes,
            "min_document_tokens": args.min_document_tokens, "affix_registry_bytes": args.affix_registry_bytes,
            "loglikelihood_samples": args.loglikelihood_samples, "max_scoring_tokens": args.max_scoring_tokens,
            "auto_reuse": args.auto_reuse,
            "reuse_checks": args.reuse_checks, "reuse_audit_every": args.reuse_audit_every}


def _wants_cuda(device: str) -> bool:
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def _serve_cluster(args: argparse.Namespace, cache_dir) -> int:
    """``acache serve --replicas N``: N engine replicas on Ray Serve behind the span-aware router."""
    import os
    import signal
    import threading

    try:
        import ray

        from acache.cluster.frontend import FrontendSettings
        from acache.cluster.launch import NAMESPACE, ClusterSettings, ClusterStartError, deploy, prepare, stop
        from acache.cluster.replica import ReplicaSettings
    except ImportError as exc:
        raise ValueError(f"--replicas runs on Ray Serve, which is not installed ({exc.name}): "
                         "pip install -e '.[cluster]'") from None
    address = args.ray_address or os.environ.get("RAY_ADDRESS") or None  # Ray's own variable joins as the flag does
    cluster = ClusterSettings(replicas=args.replicas or 1, router=args.router, ray_address=address,
                              host=args.host, port=args.port, app_name=args.app_name, balance_absolute=args.balance_abs,
                              balance_relative=args.balance_rel, cpus_per_replica=args.cpus_per_replica,
                              gpus_per_replica=args.gpus_per_replica if args.gpus_per_replica is not None else
                              1.0 if _wants_cuda(args.device) else 0.0,
                              shutdown_grace=args.shutdown_grace)
    name = args.served_model_name or Path(args.model).resolve().name
    api_key = args.api_key or os.environ.get("ACACHE_API_KEY") or None
    llm = _serve_llm_kwargs(args)
    app = _serve_app_kwargs(args, api_key)
    model = str(Path(args.model).resolve())
    threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // cluster.replicas)
    replica = ReplicaSettings(model, name, cluster.directory, NAMESPACE, llm, app,
                              str(cache_dir.resolve()) if cache_dir else None, threads)
    frontend = FrontendSettings(model, cluster.directory, NAMESPACE, args.max_model_len, args.min_document_tokens,
                                args.affix_registry_bytes, args.max_request_bytes, api_key,
                                replicas=cluster.replicas, app_name=cluster.app_name)
    try:
        prepare(cluster)  # a refusal here stops nothing: the application of that name, if any, is another's
    except ClusterStartError as exc:
        print(f"acache serve: error: {exc}", file=sys.stderr)
        return 1

    def terminate(*_) -> None:  # after ray.init, which sets a handler of its own
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    failed = None
    try:
        deploy(cluster, replica, frontend)
        print(f"serving {name} on http://{args.host}:{args.port} with {cluster.replicas} replicas on Ray Serve "
              f"({cluster.router} router); /cluster/stats has each replica's affixes and hit rate", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    except ClusterStartError as exc:
        failed = exc
    finally:
        stopped = _stop_cluster(cluster, stop)  # a second signal meanwhile ends its wait
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ray's own processes stop now: not cut short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            ray.shutdown()  # the processes this command started; a cluster it joined stays up
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, interrupt)
    if failed is not None:
        print(f"acache serve: error: {failed}", file=sys.stderr)
        return 1
    return 0 if stopped else 1


def _stop_cluster(cluster, stop) -> bool:
    """Stops the application within its bound; a signal while waiting stops the wait. False when the application
    outlived its bound."""
    import time

    print(f"stopping the cluster (at most {cluster.stop_bound_s:.0f} s: each replica has {cluster.replica_stop_s:g} s "
          "for its requests in flight and its save)", flush=True)
    started = time.monotonic()
    try:
        stopped = stop(cluster)
    except KeyboardInterrupt:
        stopped = False
    if stopped:
        print(f"the cluster stopped in {time.monotonic() - started:.1f} s", flush=True)
    else:
        where = ("the deletion goes on in the Ray cluster at --ray-address" if cluster.ray_address else
                 "its Ray processes are stopped under it (affixes a replica had not saved are lost)")
        print(f"the cluster did not stop within {time.monotonic() - started:.1f} s: {where}", flush=True)
    return stopped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acache", description="Diffusion LLM inference with the affix cache")
    parser.add_argument("--version", action="version", version=f"acache {version('acache')}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=DefaultsParser)

    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--model", default=None, help="checkpoint directory, Hugging Face layout (default: the shipped "
                   "model)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template (an --affix is "
                   "then its system prompt)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--json", action="store_true", help="one JSON object per output")
    _add_model_args(p)
    _add_sampling_args(p)
    _add_tp_arg(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("make-random-checkpoint", help="write a random-weight checkpoint in the upstream layout")
    p.add_argument("--family", required=True, choices=[c.family for c in ALL_CLASSES])
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: as many as query heads")
    p.add_argument("--intermediate-size", type=int, default=None, help="default: 4 x hidden size")
    p.add_argument("--vocab-size", type=int, default=None, help="default: tokenizer size rounded up to 64")
    p.add_argument("--max-seq-len", type=_positive_int, default=None, help="default: 4096 (65536 for blockdiff_ssm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights")
    p.add_argument("--block-size", type=int, default=None,
                   help="block-causal families (fast_dllm_v2): the attention mask's block length (default 32)")
    p.add_argument("--shards", type=int, default=1, help="split the weights over this many files")
    p.add_argument("--dtype", default="float32")
    p.set_defaults(func=_cmd_make_random_checkpoint)

    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, as in 'vllm serve MODEL'; without it, the shipped model")
    p.add_argument("--model", default=None, help="the same, as an option")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and the tokenizer endpoints (or set "
                        "ACACHE_API_KEY, which keeps the key out of the process list)")
    p.add_argument("--affix-registry-bytes", type=parse_size, default="64MiB",
                   help="bytes kept of affixes registered with POST /v1/affixes, least recently used out")
    p.add_argument("--loglikelihood-samples", type=_positive_int, default=DEFAULT_SAMPLES,
                   help="Monte Carlo draws per split behind echo+logprobs (a request's mc_samples overrides it); "
                        "the estimate's standard error shrinks as 1/sqrt(draws), see docs/lm_eval.md")
    p.add_argument("--max-scoring-tokens", type=_positive_int, default=DEFAULT_SCORING_TOKENS,
                   help="token positions one request's echo+logprobs may forward (about draws x prompt length^2 / 2); "
                        "a request past it gets a 400 naming its size")
    p.add_argument("--affix-cache-dir", default=None,
                   help="load the shared and the registered affixes from DIR at start, save them there at "
                        "shutdown and on POST /v1/affixes/save, so a restart serves warm; what fails a check is "
                        "moved into DIR/quarantine and the rest loads")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: directory name)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16, help="requests decoded at once")
    p.add_argument("--page-size", type=_positive_int, default=16, help="tokens per KV page")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV pool size, bytes or with a unit (2GiB); default 1GiB on CPU, on CUDA the "
                        "--gpu-memory-utilization share of free memory")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="on CUDA without --kv-cache-memory: the share of free GPU memory the KV pool takes")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus generation accepted (default: the model's context)")
    p.add_argument("--max-affix-tokens", type=_positive_int, default=None,
                   help="tokens the shared affixes may hold in the KV pool, least recently used out (default: "
                        "whatever the pool has free)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers: the first requests of each kind wait while it compiles "
                        "(tens of seconds), later ones run faster (BENCHMARKS.md); attention families only")
    p.add_argument("--max-request-bytes", type=parse_size, default="1MiB", help="largest request body accepted")
    p.add_argument("--min-document-tokens", type=int, default=128,
                   help="user messages at least this long are affix candidates")
    p.add_argument("--auto-reuse", default="verified", choices=AUTO_REUSE_MODES,
                   help="reuse of chat spans seen before: verified (a span is reused under a policy only after "
                        "--reuse-checks requests gave the same answer with and without reuse; until then, and "
                        "for ever after a mismatch, it is recomputed), on (reused at once: answers may change), "
                        "off; a request's affix_reuse overrides it")
    p.add_argument("--reuse-checks", type=_positive_int, default=4,
                   help="matching answers a span needs before automatic reuse answers with it")
    p.add_argument("--reuse-audit-every", type=_non_negative_int, default=16,
                   help="every Nth request a trusted span answers is checked again (0: never)")
    p.add_argument("--shutdown-grace", type=_non_negative_float, default=30.0,
                   help="seconds in-flight requests (scoring included) may run after SIGTERM or Ctrl-C; then they "
                        "are cancelled with a 503 and the server exits (with --replicas: a stopping replica has this "
                        "plus 20 s for its requests and its affix save together, then Ray Serve stops it)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug",
                                                              "trace"],
                   help="uvicorn's and acache's log level (warning: shutdown, saves and reuse mismatches)")
    cluster = p.add_argument_group("cluster (Ray Serve, pip install -e '.[cluster]')")
    cluster.add_argument("--replicas", type=_positive_int, default=None,
                         help="run this many engine replicas on Ray Serve behind one endpoint")
    cluster.add_argument("--ray-address", default=None,
                         help="join this Ray cluster (e.g. 'auto' or ray://HEAD:10001; default: RAY_ADDRESS if set) "
                              "instead of starting a local one")
    cluster.add_argument("--app-name", default="acache",
                         help="the Ray Serve application's name, which its affix directory's actor is named after")
    cluster.add_argument("--router", default="span", choices=["span", "default"],
                         help="span: to the replica holding the request's affixes (any position); default: Ray "
                              "Serve's power of two choices")
    cluster.add_argument("--balance-abs", type=int, default=64,
                         help="affinity yields to load when the favoured replica's queue is this many requests "
                              "longer than the shortest ...")
    cluster.add_argument("--balance-rel", type=float, default=1.5, help="... and this many times as long")
    cluster.add_argument("--threads-per-replica", type=_positive_int, default=None,
                         help="torch threads of each replica (default: this machine's cores / replicas)")
    cluster.add_argument("--cpus-per-replica", type=_non_negative_number, default=0.0,
                         help="CPUs Ray reserves for each replica (0: replicas share the machine freely)")
    cluster.add_argument("--gpus-per-replica", type=_non_negative_number, default=None,
                         help="GPUs Ray gives each replica, fractions included (default: 1 when --device is CUDA "
                              "here, else 0; a cluster whose GPUs are on other machines than this one names it)")
    _add_model_args(p)
    _add_tp_arg(p)
    p.set_defaults(func=_cmd_serve)

    for plugin in entry_points(group="acache.commands"):  # the research side's commands (acache_lab)
        plugin.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "model_path", None) is not None:
        if args.model is not None and args.model != args.model_path:
            print(f"acache {args.command}: error: the model is given twice ({args.model_path}, --model "
                  f"{args.model})", file=sys.stderr)
            return 2
        args.model = args.model_path
    try:
        if getattr(args, "model", "unset") is None and args.command in ("generate", "serve"):
            from acache.paths import default_model

            args.model = str(default_model())
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"acache {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
