"""Examples as token sequences in the three layouts, and the word-level tokenizer that covers them."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from acache.affix.prompt import Affix, AffixPrompt, layout_segments, resolve_segments
from acache.models.checkpoint import SPECIAL_TOKENS
from acache.tasks.generators import WORDS, Example

LAYOUTS = ("prefix", "infix", "suffix")
ANSWER_LENGTH = 8  # the generation region: answers are padded with EOS to this many tokens


def build_word_tokenizer() -> HFTokenizer:
    """Word-level tokenizer over the task words plus LLaDA's special tokens (split on whitespace)."""
    spec = SPECIAL_TOKENS["llada"]
    specials = list(dict.fromkeys([spec["bos"], spec["eos"], *spec["extra"], spec["mask"], "[UNK]"]))
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return tok


@dataclass(frozen=True)
class Rendered:
    prompt: AffixPrompt
    answer: tuple[int, ...]  # answer ids padded with EOS to ANSWER_LENGTH


def render(example: Example, layout: str, encode, eos_id: int) -> Rendered:
    """The example in ``layout``: prefix ``[story][question] answer :[GEN]``, infix ``[question][story]
    answer :[GEN]``, suffix ``[question] answer :[GEN][story]``."""
    affix = Affix(" ".join(("story", ":", *example.affix)), name="context")
    question = " ".join(("question", ":", *example.question))
    segments = layout_segments(layout, affix, question, "answer :")
    prompt = resolve_segments(segments, encode)
    answer = encode(" ".join(example.answer))
    if len(answer) > ANSWER_LENGTH:
        raise ValueError(f"answer {example.answer} is longer than {ANSWER_LENGTH} tokens")
    return Rendered(prompt, tuple(answer + [eos_id] * (ANSWER_LENGTH - len(answer))))

