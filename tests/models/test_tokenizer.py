"""Where tokens start in the text they decode to (``text_offset``), without decoding every prefix."""

import random

import pytest

from acache.models.checkpoint import make_random_checkpoint
from acache.models.tokenizer import Tokenizer

TEXTS = ["héllo wörld — ünïcode 日本語 text", "The quick brown fox, it's 12.5% done!\n\n  spaces", "emoji 😀 and é"]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return Tokenizer.from_dir(make_random_checkpoint("llada", tmp_path_factory.mktemp("bytes")))


@pytest.fixture(scope="module")
def word_level():
    return Tokenizer.from_dir("models/acache-tiny")


class CountingTokenizer(Tokenizer):
    """Counts the ids every decode reads."""

    decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_spelled_starts_are_the_tokenizers_own_offsets(byte_level, text):
    """Where the tokenizer's own spans exist they are the truth: spelling the ids one by one finds the same
    starts, multi-byte characters and spaces that open a byte-level token included."""
    encoding = byte_level._tok.encode(text, add_special_tokens=False)
    assert byte_level.decode(encoding.ids) == text
    assert byte_level.spelled_starts(encoding.ids) == [a for a, _ in encoding.offsets]


@pytest.mark.parametrize("kind", ["byte_level", "word_level"])
def test_every_token_that_spells_a_whole_character_is_found_at_its_start(kind, request):
    tok = request.getfixturevalue(kind)
    rng = random.Random(0)
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(40))]
        text = tok.decode(ids)
        starts = tok.char_offsets(text, ids)
        assert len(starts) == len(ids) and starts == sorted(starts) and all(0 <= s <= len(text) for s in starts)
        for start, token in zip(starts, ids, strict=True):
            own = tok.decode([token])
            if own and "\ufffd" not in own:
                assert text[start:start + len(own)] == own, (ids, starts, token)


def test_bytes_of_one_character_start_where_it_does(byte_level):
    ids = byte_level._tok.encode("a é", add_special_tokens=False).ids
    assert len(ids) == 4  # 'a', ' ', the first byte of 'é', its second byte
    assert byte_level.spelled_starts(ids) == [0, 1, 2, 2]
    lone = ids[:1] + ids[3:] + ids[:1]  # a byte of no character between two 'a'
    assert byte_level.decode(lone) == "a\ufffda"
    assert byte_level.spelled_starts(lone) == [0, 1, 2]


def test_offsets_are_linear_in_the_tokens(word_level):
    """Each token is decoded beside a few before it: 4,000 ids read a bounded number of ids each (decoding every
    prefix read about n^2 / 2, eight million here)."""
    tok = CountingTokenizer(word_level._tok, word_level.config)
    rng = random.Random(1)
    ids = [rng.randrange(5, tok.vocab_size) for _ in range(4000)]
    text = tok.decode(ids)
    assert tok._tok.encode(text).ids != ids  # the tokenizer's own spans do not apply: the ids are spelled
    tok.decoded = 0
    starts = tok.char_offsets(text, ids)
    assert tok.decoded < 12 * len(ids)
    words = text.split(" ")
    assert starts[:3] == [0, len(words[0]) + 1, len(words[0]) + len(words[1]) + 2]


def test_a_chat_template_in_its_own_file_with_hugging_faces_extensions(tmp_path):
    """Newer checkpoints keep the template in chat_template.jinja (it was never read: 'no chat_template'), and
    templates use {% break %}, strftime_now and a tojson that leaves '<' and non-ASCII text as they are (each failed
    to render, or rendered otherwise than transformers renders it)."""
    import datetime
    import json

    root = make_random_checkpoint("llada", tmp_path / "ckpt")
    (root / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}|{% endfor %}{{ {'k': '<é>'} | tojson }} {{ strftime_now('%Y') }}")
    tok = Tokenizer.from_dir(root)
    before = datetime.date.today().year
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "stop", "content": "x"},
                                        {"role": "user", "content": "never"}])
    years = {before, datetime.date.today().year}  # a run across midnight on 31 December reads either
    assert rendered in {f"user: hi|{json.dumps({'k': '<é>'}, ensure_ascii=False)} {y}" for y in years}
    # transformers' tojson takes its keywords; a filter called otherwise is a ValueError naming the template
    (root / "chat_template.jinja").write_text("{{ messages | tojson(ensure_ascii=False, separators=(',', ':')) }}"
                                               "{{ messages | tojson(no_such=1) }}")
    with pytest.raises(ValueError, match="chat template could not be rendered"):
        Tokenizer.from_dir(root).apply_chat_template([{"role": "user", "content": "é"}])
    (root / "chat_template.jinja").write_text("{{ messages | tojson(ensure_ascii=False, separators=(',', ':')) }}")
    assert Tokenizer.from_dir(root).apply_chat_template([{"role": "user", "content": "é"}],
                                                        add_generation_prompt=False) == \
        '[{"role":"user","content":"é"}]'
    # a derived checkpoint keeps the template file
    from acache.models.checkpoint import derive_from, save_checkpoint
    from acache.models.loader import load_model

    save_checkpoint(load_model(root), tmp_path / "derived")
    derive_from(root, tmp_path / "derived")
    assert (tmp_path / "derived" / "chat_template.jinja").read_text() == (root / "chat_template.jinja").read_text()
    bare = make_random_checkpoint("llada", tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template .*chat_template.jinja"):
        Tokenizer.from_dir(bare).apply_chat_template([{"role": "user", "content": "hi"}])
