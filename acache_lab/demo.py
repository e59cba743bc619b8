"""``acache demo`` (``make run``): the shipped model answers questions about shared affixes, each policy's
answer beside the expected one, with what each request cost.

Three tasks, one layout each: a qa1 story as a prefix, an arithmetic worksheet as an infix, a two-hop
story as a suffix (an infix on a block-causal model, which cannot read text after its answer). Every question
is asked under direct reuse (no anchors), ACache with 20% and 50% of the affix as anchors, and full
recomputation; the affix is computed once and shared by all of them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from acache import GEN, LLM, Affix, SamplingParams
from acache.models.config import affix_training
from acache.policies import DEFAULT_SELECTOR, LAYOUTS


@dataclass(frozen=True)
class Demo:
    title: str
    layout: str
    affix: str
    gen_length: int
    questions: tuple[tuple[str, str], ...]  # (question, expected answer)


DEMOS = (
    Demo("qa1: where is someone now?", "prefix",
         "story : mary moved to the kitchen . john went to the garden . sandra travelled to the office . "
         "mary journeyed to the bathroom .", 2,
         (("where is mary ?", "bathroom"), ("where is john ?", "garden"), ("where is sandra ?", "office"))),
    Demo("arithmetic: a worked sum, smaller count first", "infix",
         "story : mary has 5 pencils . oliver has 3 pencils . lucas has 5 pencils . john has 9 pencils . "
         "emma has 3 pencils . sandra has 5 pencils .", 6,
         (("how many pencils do john and lucas have ?", "5 + 9 = 14"),
          ("how many pencils do mary and oliver have ?", "3 + 5 = 8"),
          ("how many pencils do mary and lucas have ?", "5 + 5 = 10"))),
    Demo("two-hop: who took the object, and where did they go?", "suffix",
         "story : mary went to the garden . john moved to the office . apple went to mary . milk went to john . "
         "mary travelled to the cellar .", 2,
         (("where is the apple ?", "cellar"), ("where is the milk ?", "office"))),
)
TIMED_RUNS = 3  # after one untimed run; a policy's time is its fastest run's
POLICIES = (("direct reuse", "none", 0.0), ("ACache 20%", DEFAULT_SELECTOR, 0.2), ("ACache 50%", DEFAULT_SELECTOR, 0.5),
            ("full recompute", "all", 1.0))


def segments(demo: Demo, question: str) -> list:
    affix, q, answer = Affix(demo.affix, name="story"), f"question : {question}", "answer :"
    return {"prefix": [affix, q, answer, GEN], "infix": [q, affix, answer, GEN], "suffix": [q, answer, GEN, affix]}[
        demo.layout]


def demos_for(llm: LLM) -> tuple[Demo, ...]:
    """The demos this model can read: a block-causal model cannot read text after its answer, so its two-hop
    story goes in the middle (every policy, full recompute too, answered nothing there as a suffix)."""
    if not getattr(llm.model, "block_causal", False):
        return DEMOS
    return tuple(replace(d, layout="infix") if d.layout == "suffix" else d for d in DEMOS)


def run(llm: LLM) -> list[str]:
    lines = []
    total = {name: 0 for name, _, _ in POLICIES}
    demos = demos_for(llm)
    for demo in demos:
        assert demo.layout in LAYOUTS
        width = max(len(q) for q, _ in demo.questions)
        affix_tokens = len(llm.inputs.encode_text(demo.affix))
        lines += ["", f"== {demo.title} — the story as the {demo.layout} affix ({affix_tokens} tokens), computed "
                      "once and shared by every request"]
        header = f"{'question':<{width}}  {'expected':<12}" + "".join(f"{name:<16}" for name, _, _ in POLICIES)
        lines += [header, "-" * len(header)]
        answers, costs = {}, {}
        for name, policy, ratio in POLICIES:
            params = SamplingParams(gen_length=demo.gen_length, block_length=demo.gen_length,
                                    selector=policy, anchor_ratio=ratio)
            prompts = [segments(demo, q) for q, _ in demo.questions]
            runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(TIMED_RUNS + 1)][1:]  # warmed up
            outs = runs[0]
            answers[name] = [o.text for o in outs]
            # a request's forward time is its batch's forwards' (the questions run as one batch): shared by them
            costs[name] = (sum(o.stats.affix.recomputed_per_refresh for o in outs) / len(outs),
                           min(1000 * max(o.stats.forward_time_s for o in run) / len(run) for run in runs))
        for i, (question, expected) in enumerate(demo.questions):
            row = f"{question:<{width}}  {expected:<12}"
            for name, _, _ in POLICIES:
                got = answers[name][i]
                row += f"{(got or '(nothing)') + (' ok' if got == expected else ' x'):<16}"
            lines.append(row)
        right = {name: sum(a == e for a, (_, e) in zip(answers[name], demo.questions, strict=True))
                 for name, _, _ in POLICIES}
        for name, count in right.items():
            total[name] += count
        lines.append(f"{'right':<{width + 14}}" + "".join(f"{right[n]}/{len(demo.questions):<14}"
                                                           for n, _, _ in POLICIES))
        lines.append(f"{'tokens a refresh':<{width + 14}}" + "".join(f"{costs[n][0]:<16.0f}" for n, _, _ in POLICIES))
        lines.append(f"{'forward ms/request':<{width + 14}}" + "".join(f"{costs[n][1]:<16.1f}"
                                                                       for n, _, _ in POLICIES))
    asked = sum(len(d.questions) for d in demos)
    lines += ["", "all questions: " + ", ".join(f"{name} {total[name]}/{asked}" for name, _, _ in POLICIES)]
    return lines


def main(args: argparse.Namespace) -> int:
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    if llm.engine.state_cache:
        raise ValueError(f"acache demo shows affix reuse, which a {llm.model.family} model does not support (it "
                         "shares no affix K/V): run it on a llada, dream or fast_dllm_v2 model")
    how = ("by direct reuse" if affix_training(llm.config) is not None else f"with ACache ({DEFAULT_SELECTOR})")
    mode = (("trained to be reused (config.json records affix-aware training)" if affix_training(llm.config)
             is not None else "not trained to be reused")
            + f": the server reuses a registered affix {how} at once, and a chat's spans seen before {how} only once "
            "checks of different requests showed that reuse leaves their answers unchanged (at the default four "
            "checks, never on the held-out chats of docs/guide/server.md, which ask two or three questions a story)")
    print(f"{args.model}: {mode}.")
    print(f"Each question under direct reuse, ACache ({DEFAULT_SELECTOR}, anchors chosen inside the "
          "first refresh) at two anchor ratios and full recompute (ok: the expected answer). Full recompute reads "
          "the whole prompt in context, the ceiling the other columns are held to (each shipped model's held-out "
          "exact match under it is in docs/model.md); the last line counts what each policy gets right here.\n"
          "tokens a refresh: the columns each block-boundary refresh computes (the request's own tokens, plus the "
          "affix's anchors under ACache; full recompute computes the affix too). forward ms/request: a demo's "
          f"questions run as one batch, whose forward time is shared by its requests; the fastest of {TIMED_RUNS} "
          f"runs after a warm-up. On this {llm.config.num_layers}-layer, {llm.config.hidden_size}-wide "
          "model a forward costs about the same whatever its width, so fewer tokens need not mean less time, and "
          "ACache's first refresh, which runs the layers in several calls with the selection between them, can "
          "cost more than full recompute's single call; BENCHMARKS.md measures larger shapes.")
    print("\n".join(run(llm)))
    return 0
