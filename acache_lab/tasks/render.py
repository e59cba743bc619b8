"""Examples as token sequences in the three layouts, and the word-level tokenizer that covers them."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from acache.affix.prompt import GEN, Affix, AffixPrompt, layout_segments, resolve_segments
from acache.models.checkpoint import SPECIAL_TOKENS
from acache_lab.tasks.generators import WORDS, Example

#: The generation region per task: its longest answer plus one EOS, so the model learns to stop. Kept
#: tight on purpose: every extra masked column is one more all-alike position the answer slot must be
#: told apart from; with 8 columns the name lookup was found on 1 seed of 3, with 2 on 5 of 8 plus the
#: full run's (docs/model.md, run 8).
ANSWER_LENGTHS = {"qa1": 2, "twohop": 2, "bind": 2, "count": 2, "holder": 2, "grab": 2, "arith": 6, "codes": 2,
                  "codebook": 2}
#: demonstrations and the request's document, each an affix of its own: ``[demos][story][question][GEN]``
TWO_AFFIXES = "two-affix"


def answer_length(task: str) -> int:
    """How many columns the task's answers are generated in (answer words, then EOS padding)."""
    if task not in ANSWER_LENGTHS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(ANSWER_LENGTHS)}")
    return ANSWER_LENGTHS[task]


#: Chat in the tasks' own words: the system message is the story, a user message the question, and the
#: model answers after "answer :". A shipped task model can then be served over /v1/chat/completions.
TASK_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}story : {{ m['content'] | trim }} "
    "{% elif m['role'] == 'user' %}question : {{ m['content'] | trim }} "
    "{% else %}answer : {{ m['content'] | trim }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}answer :{% endif %}"
)


def build_word_tokenizer() -> HFTokenizer:
    """Word-level tokenizer over the task words plus LLaDA's special tokens: lower-cased, split on whitespace
    and around punctuation ("Mary?" is "mary ?"). It has no unknown token: other words are refused."""
    spec = SPECIAL_TOKENS["llada"]
    specials = list(dict.fromkeys([spec["bos"], spec["eos"], *spec["extra"], spec["mask"], "[UNK]"]))
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(specials)
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return tok


@dataclass(frozen=True)
class Rendered:
    prompt: AffixPrompt
    answer: tuple[int, ...]  # answer ids padded with EOS to the task's answer_length


def render_prompts(tokenizer, examples: list[Example], layout: str, drop_affix: bool = False) -> list[AffixPrompt]:
    """The examples' prompts in ``layout`` with a model's tokenizer (the story marked as the affix);
    ``drop_affix`` leaves the affix out (what demonstrations are worth: the same requests without them)."""
    eos = tokenizer.token_to_id(SPECIAL_TOKENS["llada"]["eos"])

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return [render(e, layout, encode, eos, drop_affix).prompt for e in examples]


def render(example: Example, layout: str, encode, eos_id: int, drop_affix: bool = False) -> Rendered:
    """The example in ``layout``: prefix ``[story][question] answer :[GEN]``, infix ``[question][story]
    answer :[GEN]``, suffix ``[question] answer :[GEN][story]``. A task with demonstrations puts them where
    the story goes (headed "worksheet :") and its own story before the question; in the two-affix layout
    that story is an affix too (the same tokens as prefix, two cached spans instead of one)."""
    question = " ".join(("question", ":", *example.question))
    if example.context:
        affix = Affix(" ".join(("worksheet", ":", *example.affix)), name="demonstrations")
        story = " ".join(("story", ":", *example.context))
        if layout == TWO_AFFIXES:
            segments = [affix, Affix(story, name="context"), question, "answer :", GEN]
        else:
            segments = layout_segments(layout, affix, f"{story} {question}", "answer :")
    elif layout == TWO_AFFIXES:
        raise ValueError(f"the {TWO_AFFIXES} layout needs a task with demonstrations; {example.task} has none")
    else:
        affix = Affix(" ".join(("story", ":", *example.affix)), name="context")
        segments = layout_segments(layout, affix, question, "answer :")
    if drop_affix:  # the task's own affix (its demonstrations, or its document); a second one stays
        segments = [s for s in segments if s is not affix]
    prompt = resolve_segments(segments, encode)
    answer = encode(" ".join(example.answer))
    length = answer_length(example.task)
    if len(answer) > length:
        raise ValueError(f"answer {example.answer} is longer than {example.task}'s {length} answer columns")
    return Rendered(prompt, tuple(answer + [eos_id] * (length - len(answer))))

