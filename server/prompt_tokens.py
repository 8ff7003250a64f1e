"""A request's prompt length in tokens, counted as vLLM will count it.

The `reject` policy reserves a capture's bytes before vLLM sees the request. Counting
with the served tokenizer and chat template (vLLM applies the same ones) makes that
reservation the capture's real size for the prompt part; a request this cannot count
(a template that fails, non-text content) falls back to the byte bound in fields.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from capsteer.engine_ext.vllm.serve import TokenizerSource

log = logging.getLogger("vllm.capsteer.server")
CHAT_KEYS = ("add_generation_prompt", "continue_final_message")


class PromptCounter:
    """Counts prompt tokens of chat and completion bodies (loaded once, thread-safe)."""

    def __init__(self, source: TokenizerSource) -> None:
        # transformers is loaded only by servers that count (the reject policy).
        from transformers import AutoTokenizer

        self.source = source
        self.tokenizer = AutoTokenizer.from_pretrained(
            source.path, revision=source.revision, trust_remote_code=source.trust_remote_code)

    def count(self, body: Mapping[str, Any]) -> int | None:
        """Prompt tokens of this body, or None when it cannot be counted here."""
        try:
            if "messages" in body:
                return self._chat(body)
            return _prompt_tokens(body.get("prompt"), self._text)
        except Exception as exc:  # any template or input it cannot handle: the byte bound
            log.debug("capsteer: prompt not counted (%r); using the byte bound", exc)
            return None

    def _text(self, text: str) -> int:
        return len(self.tokenizer(text).input_ids)

    def _chat(self, body: Mapping[str, Any]) -> int | None:
        messages = body["messages"]
        if not isinstance(messages, list):
            return None
        plain = [_plain_message(m) for m in messages]
        if any(m is None for m in plain):
            return None
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            return None
        options = {k: body[k] for k in CHAT_KEYS if k in body}
        options.setdefault("add_generation_prompt", not options.get("continue_final_message"))
        ids = self.tokenizer.apply_chat_template(
            plain, tools=body.get("tools"), chat_template=self.source.chat_template,
            tokenize=True, **options, **extra)
        if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return len(ids)


def _plain_message(message: object) -> dict[str, Any] | None:
    """A message whose content is text (parts joined as vLLM joins them); None for other
    content (images, audio), which is not counted here."""
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                return None
            texts.append(part["text"])
        return {**message, "content": "\n".join(texts)}
    return message


def _prompt_tokens(prompt: object, count_text: Any) -> int | None:
    """Completions: a string, token ids, or a list of either (their sum bounds the capture)."""
    if isinstance(prompt, str):
        return count_text(prompt)
    if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        parts = [_prompt_tokens(p, count_text) for p in prompt]
        return None if any(p is None for p in parts) else sum(parts)
    return None
