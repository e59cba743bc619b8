"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: what a client needs to count and cut
tokens as the server does (lm-eval's ``tokenizer_backend=remote`` among them)."""

from __future__ import annotations

import asyncio

from acache.affix.chat import message_pieces
from acache.models.tokenizer import token_text
from acache.server.protocol import BadRequest, DetokenizeRequest, TokenizeRequest
from acache.server.serving import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer's endpoints; encoding runs on a thread so a long text never holds the event loop."""

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt or messages")
        llm = self.llm
        special = body.prompt is not None if body.add_special_tokens is None else body.add_special_tokens

        def encode() -> list[int]:
            try:
                if body.prompt is not None:
                    return llm.tokenizer.encode(body.prompt, add_special_tokens=special)
                messages = [m.as_dict() for m in body.messages]
                if special:  # the rendered text with the tokenizer's own special tokens around it, as asked
                    text = llm.inputs.render_chat(messages, body.add_generation_prompt)
                    return llm.tokenizer.encode(text, add_special_tokens=True)
                # message by message, as a chat request encodes them (a tokenizer may encode the whole otherwise)
                *pieces, generation = message_pieces(messages, llm.inputs.render_chat)
                pieces += [generation] if body.add_generation_prompt else []
                return [t for piece in pieces if piece for t in llm.inputs.encode_text(piece)]
            except ValueError as exc:
                raise BadRequest(str(exc)) from None

        ids = await asyncio.to_thread(encode)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body)
        vocab = self.llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return {"prompt": await asyncio.to_thread(self.llm.tokenizer.decode, body.tokens)}

    def info(self) -> dict:
        tok = self.llm.tokenizer
        return {"tokenizer_class": "acache.Tokenizer", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": token_text(tok.config.get("pad_token")), "chat_template": tok.chat_template,
                "model_max_length": self.llm.max_model_len, "vocab_size": self.llm.config.vocab_size}
