"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``serving_tokenization``): they tokenize by
the very code a completion's or a chat's prompt goes through, so ``count`` is that request's
``usage.prompt_tokens``.
"""

from __future__ import annotations

from prefixcache.entrypoints.openai.api_errors import APIError, input_error
from prefixcache.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    PrefixCacheBlocks,
    TokenizeRequest,
    TokenizeResponse,
)
from prefixcache.entrypoints.openai.serving_chat import chat_conversation
from prefixcache.entrypoints.openai.serving_engine import OpenAIServing, check_request


class OpenAIServingTokenization:
    """Runs ``/tokenize`` and ``/detokenize`` requests through an :class:`OpenAIServing`.

    Args:
        serving: the engine, the served model's name and its adapters.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """``POST /tokenize`` (vLLM's): the token ids a completion (``prompt``) or chat
        (``messages``) request with the same input feeds the engine, by the same code
        (``usage.prompt_tokens`` is their count), and how they fall into KV blocks.

        Raises:
            APIError: 400 naming the field (``prompt`` / ``messages`` for bad input, or when neither
                or both are given), 404 for an unknown model.
        """
        check_request(req, "tokenize")
        self.serving.lora_for(req.model)  # adapters don't change tokenization, but the name must exist
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (a completion's input) or messages (a chat's)", "prompt")
        try:
            if req.messages is not None:
                generation_prompt = req.add_generation_prompt is not False
                ids = await self.engine.apply_chat_template(chat_conversation(req.messages), generation_prompt,
                                                            bool(req.add_special_tokens))
            else:
                ids = await self.engine.tokenize(req.prompt, req.add_special_tokens is not False)
        except ValueError as e:
            raise input_error(e, "prompt" if req.messages is None else "messages") from e
        block_size = self.engine.engine.config.block_size
        return TokenizeResponse(
            count=len(ids), max_model_len=self.engine.engine.max_model_len, tokens=ids,
            token_strs=await self.engine.token_strs(ids) if req.return_token_strs else None,
            prefix_cache=PrefixCacheBlocks(block_size=block_size, num_full_blocks=len(ids) // block_size),
        )

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """``POST /detokenize`` (vLLM's): token ids → text, special tokens kept.

        Raises:
            APIError: 400 (``tokens``) for an id outside the vocabulary, 404 for an unknown model.
        """
        check_request(req, "tokenize")
        self.serving.lora_for(req.model)
        try:
            return DetokenizeResponse(prompt=await self.engine.detokenize(req.tokens, "tokens"))
        except ValueError as e:
            raise input_error(e, "tokens") from e
