"""Streaming text out of token ids, and deciding when a sequence is finished. Pure; used by decode workers.

`IncrementalDetokenizer` turns tokens into text deltas one token at a time. Decoding a token alone is wrong
for byte-level BPE (one character may span several tokens, so a lone token decodes to U+FFFD) and for
tokenizers that merge or strip spaces depending on the left context, so it keeps the usual two offsets:
text is decoded from `prefix_offset` (a little left context) and only what lies beyond the text already
emitted (`read_offset`) is released, and never while it still ends in an incomplete character.

`StopChecker` applies the finish rules: EOS token -> "stop", stop string -> "stop" (text trimmed at the
stop string), max_tokens -> "length". It withholds any tail of the text that could still grow into a stop
string, so a client never sees text that later turns out to be part of one.

A decode worker's loop, per generated token:

    update = stop.update(token, detok.feed(token))
    send(update.text)
    if update.finish_reason: finish(update.finish_reason)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# how many tokens of left context to decode with (enough for any tokenizer's space/merge rules)
CONTEXT_TOKENS = 5


class TextDecoder(Protocol):
    """Anything with a HF-style decode: an Engine, or a transformers tokenizer."""

    def decode(self, ids: Sequence[int], /, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self, decoder: TextDecoder, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        # the prompt's tail is context only: its text is never emitted
        self.tokens: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.decoder.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Add one generated token; returns the newly completed text (possibly empty)."""
        self.tokens.append(int(token_id))
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still waiting for its remaining bytes
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: release whatever is still withheld (an incomplete character included)."""
        if self.read_offset >= len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta


@dataclass(frozen=True)
class StopUpdate:
    text: str  # text to emit now
    finish_reason: str | None  # None while running; "stop" or "length" once finished
    stop_string: str | None = None  # the stop string that matched, if any


class StopChecker:
    def __init__(
        self,
        stop_strings: Iterable[str] = (),
        eos_ids: Iterable[int] = (),
        max_tokens: int | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.min_tokens = min_tokens  # neither EOS nor a stop string ends the output before this many tokens
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.pending = ""  # text received but withheld: it may be the start of a stop string
        self.finish_reason: str | None = None

    def _withheld_length(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def update(self, token_id: int, text: str) -> StopUpdate:
        """Account one generated token and the text delta it produced; returns what to emit and the verdict.

        The token that triggers EOS is not part of the output text. Call nothing after a finish.
        """
        if self.finish_reason is not None:
            raise RuntimeError(f"sequence already finished ({self.finish_reason})")
        self.num_tokens += 1
        if self.num_tokens < self.min_tokens:
            # as vLLM: no stop check at all before min_tokens (the engine masks EOS out of the sampling)
            buffer, self.pending = self.pending + text, ""
            return StopUpdate(buffer, None)
        if int(token_id) in self.eos_ids:
            return self._finish("stop", self.pending)
        buffer = self.pending + text
        match = self._first_stop(buffer)
        if match is not None:
            index, stop = match
            return self._finish("stop", buffer[:index], stop)
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._finish("length", buffer)
        keep = self._withheld_length(buffer)
        self.pending = buffer[len(buffer) - keep :] if keep else ""
        return StopUpdate(buffer[: len(buffer) - keep], None)

    def resumed_end(self, last_token: int) -> StopUpdate | None:
        """For output resumed on another worker (``pending`` set to the text the previous worker withheld, and
        ``min_tokens`` to what was still owed): whether that output had already ended, before any new token.
        The previous worker may have published the token that ended it (with the text before a stop string)
        and died before its final message; a new token would run past the stop. None: not ended."""
        if self.finish_reason is not None or self.min_tokens > 0:
            return None
        if int(last_token) in self.eos_ids:
            return self._finish("stop", self.pending)
        match = self._first_stop(self.pending)
        if match is not None:
            return self._finish("stop", self.pending[: match[0]], match[1])
        return None

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Where the earliest stop string in ``text`` starts, and which one."""
        return min(((text.find(s), s) for s in self.stop_strings if s in text), default=None, key=lambda m: m[0])

    def finish(self, reason: str) -> StopUpdate:
        """Finish for an outside reason (e.g. "length" at the model's context limit, or "abort"):
        releases the withheld text."""
        if self.finish_reason is not None:
            return StopUpdate("", self.finish_reason)
        return self._finish(reason, self.pending)

    def _finish(self, reason: str, text: str, stop: str | None = None) -> StopUpdate:
        self.finish_reason = reason
        self.pending = ""
        return StopUpdate(text, reason, stop)
