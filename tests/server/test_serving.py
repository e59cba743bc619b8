"""A request's stream on the serving layer, with a fake engine releasing an answer block by block: the deltas
joined are the whole answer, and a failure mid-stream is an error event that says what it can."""

import asyncio
import json
import logging
import random
from types import SimpleNamespace

from acache.models.tokenizer import Tokenizer
from acache.server.serving import OpenAIServing, finish_reason
from acache.server.shutdown import ShuttingDown


def byte_tokenizer() -> Tokenizer:
    """One token a byte, decoded as byte-level BPE decodes: a character whose bytes are not all there yet reads
    U+FFFD, as LLaDA's and Dream's tokenizers read it mid-stream."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unshown = [b for b in range(256) if b not in shown]
    symbol = {b: chr(b) for b in shown} | {b: chr(256 + i) for i, b in enumerate(unshown)}
    hf = HFTokenizer(models.BPE(vocab={symbol[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    return Tokenizer(hf)


class BlockEngine:
    """Releases a fixed answer ``block`` tokens at a time, as diffusion decoding unmasks a block; raises ``fail``
    after the first block when given."""

    def __init__(self, ids: list[int], block: int, fail: Exception | None = None) -> None:
        self.ids, self.block, self.fail = ids, block, fail

    async def generate(self, prompt, params, stream=False):
        for end in range(self.block, len(self.ids) + self.block, self.block):
            yield SimpleNamespace(token_ids=self.ids[:end], finished=end >= len(self.ids), stopped=False,
                                  stop_token_id=None, affix_tokens=0, anchors=[], cached_tokens=0)
            if self.fail is not None:
                raise self.fail


def serving_of(tokenizer, engine) -> OpenAIServing:
    return OpenAIServing(SimpleNamespace(llm=SimpleNamespace(tokenizer=tokenizer), model_name="m", engine=engine,
                                         checks_running=set()))


def stream(serving: OpenAIServing, body, gen_length: int) -> list[dict]:
    """The stream's events, [DONE] left out."""
    params = SimpleNamespace(gen_length=gen_length)

    async def events():
        return [e async for e in serving.stream_events(SimpleNamespace(token_ids=[0]), params, body, "r", 0, False)]

    return [json.loads(e[6:]) for e in asyncio.run(events()) if e != "data: [DONE]\n\n"]


def streamed_and_whole(tokenizer, text: str, block: int, stops: list[str]) -> tuple[tuple, tuple]:
    ids = list(text.encode())
    serving = serving_of(tokenizer, BlockEngine(ids, block))
    body = SimpleNamespace(stop=stops, token_limit=None, stream_options=None)
    choices = [event["choices"][0] for event in stream(serving, body, len(ids))]
    streamed = ("".join(c["text"] for c in choices), [t for c in choices for t in c["token_ids"]],
                choices[-1]["finish_reason"])
    whole = SimpleNamespace(token_ids=ids, finished=True, stopped=False, stop_token_id=None)
    cut = serving.final_text(whole, body)
    return streamed, (cut.text, cut.token_ids, finish_reason(whole, SimpleNamespace(gen_length=len(ids)), cut, None))


def test_a_stream_sends_what_the_whole_answer_says_whatever_the_blocks_split():
    """Streamed deltas joined equal the whole answer (text, token ids, finish) for stop strings that hold characters
    of two to four bytes, whichever byte each block ends on."""
    tokenizer = byte_tokenizer()
    rng = random.Random(0)
    letters = [*"ab c\n.", "é", "：", "好", "😀"]
    for _ in range(400):
        text = "".join(rng.choice(letters) for _ in range(rng.randint(3, 12)))
        at = rng.randrange(len(text))
        stops = [text[at:at + rng.randint(1, 3)]] + ([rng.choice(letters) + "x"] if rng.random() < 0.3 else [])
        block = rng.randint(1, 5)
        streamed, whole = streamed_and_whole(tokenizer, text, block, stops)
        assert streamed == whole, (text, block, stops)


def test_a_shutdown_mid_stream_carries_the_code_a_503_would():
    """The status went out with the first byte; the error event still says shutting_down, so a client may retry."""
    ids = list(b"one two three")
    serving = serving_of(byte_tokenizer(), BlockEngine(ids, 4, fail=ShuttingDown("the server shut down")))
    events = stream(serving, SimpleNamespace(stop=None, token_limit=None, stream_options=None), len(ids))
    assert events[-1] == {"error": {"message": "the server shut down", "type": "server_error", "param": None,
                                    "code": "shutting_down"}}


def test_an_unexpected_error_mid_stream_is_logged_with_its_traceback(caplog):
    """The client reads "internal error while streaming"; the server's log has what happened, as a plain request's
    500 logs it."""
    ids = list(b"one two three")
    serving = serving_of(byte_tokenizer(), BlockEngine(ids, 4, fail=KeyError("a bug")))
    with caplog.at_level(logging.ERROR, logger="acache.server"):
        events = stream(serving, SimpleNamespace(stop=None, token_limit=None, stream_options=None), len(ids))
    assert events[-1]["error"]["message"] == "internal error while streaming"
    assert events[-1]["error"]["code"] is None
    assert [r.getMessage() for r in caplog.records] == ["internal error while streaming r"]
    assert "KeyError: 'a bug'" in caplog.text
