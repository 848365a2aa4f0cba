"""KVzip's context reconstruction as token ids: what the model is asked to repeat, chunk by chunk. No vLLM
import: the scheduler side (``scheduler.py`` beside it) appends each chunk after a request's context
as a hidden request of its own, and the tests build the same inputs for a transformers model.

As in kvpress's ``KVzipPress``: the context after the chat template's prefix is cut into chunks of 2,048
tokens; chunk 0 is asked for with "Repeat the previous context exactly.", a later chunk with "Repeat the part
of the previous context exactly, starting with" and the previous chunk's last 8 tokens; then the template's
suffix (the end of a user turn and the start of the assistant's) and the chunk itself. The tokens a
streaming-input session appends later are repeated as later parts of the same context.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK_TOKENS = 2048
OVERLAP_TOKENS = 8
FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids around a reconstruction chunk, from the model's tokenizer."""

    prefix: tuple[int, ...]  # the chat template's text before a user message's content
    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]  # the template's text after a user message's content (generation prompt)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "RepeatPrompt":
        prefix_text, suffix_text = "", "\n"
        if getattr(tokenizer, "chat_template", None):
            dummy = "dummy context"
            sep = "\n" + "#" * len(dummy)
            text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + sep}],
                                                 add_generation_prompt=True, tokenize=False, enable_thinking=False)
            before, suffix_text = text.split(sep)
            prefix_text = before.split(dummy)[0]

        def enc(t: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(t, add_special_tokens=False)) if t else ()

        return cls(enc(prefix_text), enc(FIRST), enc(LATER), enc(suffix_text))

    def longest_ask(self, overlap: int = OVERLAP_TOKENS) -> int:
        """Tokens a chunk's repeat ids add besides the chunk itself, at most."""
        return max(len(self.first), len(self.later) + overlap) + len(self.suffix)


@dataclass(frozen=True)
class Chunk:
    span: tuple[int, int]  # the context positions ``[s, e)`` this chunk scores
    repeat: tuple[int, ...]  # the ids that follow the context: request + suffix + the chunk's tokens


def chunks(prompt_ids, context_len: int, prompt: RepeatPrompt, size: int = CHUNK_TOKENS,
           overlap: int = OVERLAP_TOKENS, start_at: int = 0) -> list[Chunk]:
    """The reconstruction chunks of the context ``prompt_ids[:context_len]``: it is repeated from the end of
    the chat template's prefix when the prompt starts with it (else from token 0). ``start_at`` > 0: only
    ``[start_at, context_len)`` is repeated (the tokens a streaming-input session appended since its last
    round), its first chunk asked for as a later part, starting with the ``overlap`` tokens before it."""
    ids = list(prompt_ids[:context_len])
    p = len(prompt.prefix)
    start = p if 0 < p < context_len and tuple(ids[:p]) == prompt.prefix else 0
    start = max(start, start_at)
    out = []
    for a in range(start, len(ids), size):
        part = ids[a : a + size]
        ask = list(prompt.first) if a == start and start_at == 0 else list(prompt.later) + ids[max(0, a - overlap) : a]
        out.append(Chunk((a, a + len(part)), tuple(ask + list(prompt.suffix) + part)))
    return out
