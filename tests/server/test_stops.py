"""Cutting a generated text at a stop string: which tokens go with the text, and at what cost."""

import random

from acache.server.stops import cut_at_stop, held_back, spelled

VOCAB = {0: "The answer", 1: " is", 2: " 5", 3: ".\n", 4: "Next", 5: "\n", 6: " line", 7: "é"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def test_a_token_the_stop_string_begins_inside_stays():
    """'.\\n' holds the stop '\\n' after its '.': the text keeps the '.', so the token that spells it stays (as vLLM
    keeps it), and the usage counts it."""
    cut = cut_at_stop([0, 1, 2, 3, 4], decode, ["\n"])
    assert (cut.text, cut.token_ids, cut.stopped) == ("The answer is 5.", [0, 1, 2, 3], True)


def word_decode(ids):
    """A word-level decoder: tokens joined by a space that belongs to none of them."""
    return " ".join(["5", "+", "9", "=", "14"][i] for i in ids)


def test_the_space_a_decoder_puts_between_words_takes_no_token():
    cut = cut_at_stop([0, 1, 2, 3, 4], word_decode, ["+ 9"])
    assert (cut.text, cut.token_ids) == ("5 ", [0])
    assert cut_at_stop([0, 1, 2, 3, 4], word_decode, ["9 ="]).token_ids == [0, 1]


def test_a_token_that_starts_at_the_stop_string_goes():
    cut = cut_at_stop([0, 1, 5, 6, 5], decode, ["\n"])
    assert (cut.text, cut.token_ids) == ("The answer is", [0, 1])
    assert cut_at_stop([5, 0], decode, ["\n"]).token_ids == []  # the stop string first: nothing is kept
    assert cut_at_stop([0, 1], decode, ["\n"]).stopped is False


def test_the_tokens_kept_are_the_fewest_that_spell_the_text():
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(VOCAB)) for _ in range(rng.randrange(1, 30))]
        stop = rng.choice(["\n", "is", "e N", "é", " line\n"])
        cut = cut_at_stop(ids, decode, [stop])
        text = decode(ids)
        if stop not in text:
            assert not cut.stopped and cut.token_ids == ids
            continue
        at = text.index(stop)
        spelled = text[:at].rstrip()
        fewest = next(k for k in range(len(ids) + 1) if decode(ids[:k]).startswith(spelled))
        assert cut.text == text[:at] and cut.token_ids == ids[:fewest]


def test_the_cut_decodes_a_logarithmic_number_of_prefixes():
    """Bisection, not every prefix: 4,096 tokens decode about 13 prefixes (decoding each was 8 million ids)."""
    read = []

    def counting(ids):
        read.append(len(ids))
        return decode(ids)

    ids = [0, 1] * 2047 + [3, 4]
    cut = cut_at_stop(ids, counting, ["\n"])
    assert cut.token_ids == ids[:-1] and len(read) <= 14 and sum(read) <= 14 * len(ids)


def test_a_character_cut_in_its_bytes_is_not_spelled():
    """A byte-level vocabulary splits 'é' in two: the prefix ending after its first byte decodes to a replacement
    character, which counted as a character of the text, so the cut kept one byte of it."""
    import tempfile

    from acache.models.checkpoint import make_random_checkpoint
    from acache.models.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as root:
        tok = Tokenizer.from_dir(make_random_checkpoint("llada", root))
    for text, stop, want in (("café\nmore", "\n", "café"), ("The answer is 中国\nX", "\n", "The answer is 中国")):
        ids = tok.encode(text, add_special_tokens=False)
        cut = cut_at_stop(ids, tok.decode, [stop])
        assert cut.text == want and tok.decode(cut.token_ids) == want, (cut, tok.decode(cut.token_ids))


def test_a_stream_sends_the_tokens_its_text_has_spelled():
    """Each event's token ids are the most whose text the event's text begins with (a decoder that concatenates,
    and one that puts a space between words that belongs to no token); counting from an earlier event's count
    finds the same."""
    rng = random.Random(1)
    for decoder, vocab in ((decode, len(VOCAB)), (word_decode, 5)):
        for _ in range(300):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
            text = decoder(ids)
            sent = text[:rng.randrange(len(text) + 1)]
            n = spelled(ids, decoder, sent)
            assert sent.startswith(decoder(ids[:n]))
            assert n == len(ids) or not sent.startswith(decoder(ids[:n + 1]))
            shorter = sent[:rng.randrange(len(sent) + 1)]
            assert spelled(ids, decoder, sent, spelled(ids, decoder, shorter)) == n
    assert spelled([0, 1, 2], decode, "The answer is 5") == 3 and spelled([0, 1, 2], decode, "The answer i") == 1
    assert spelled([7], lambda ids: "\ufffd" if ids else "", "") == 0  # half a character is not sent yet
    # a token that decodes to nothing (a special one) waits: a stop string right after it drops it from the answer
    silent = {0: "Hi", 1: "", 2: "\n"}

    def quiet(ids):
        return "".join(silent[i] for i in ids)

    assert spelled([0, 1], quiet, "Hi") == 1 and cut_at_stop([0, 1, 2], quiet, ["\n"]).token_ids == [0]
    assert spelled([0, 1, 0], quiet, "HiHi") == 3  # inside the text it is sent with the tokens around it



def test_a_stop_strings_start_before_an_incomplete_character_is_held_back_with_it():
    """A block that ends inside a character decodes to U+FFFD at the end: the stop string's start before it was
    sent, then the character completed the stop string, which the whole answer leaves out."""
    assert held_back("Answer\ufffd", ["Answer："]) == 7
    assert held_back("x\ufffd\ufffd", ["xé"]) == 3
    assert held_back("done\ufffd", ["\n"]) == 1  # the character alone, as before
    assert held_back("Answer", ["Answer："]) == 6

