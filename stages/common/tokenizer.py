"""Tokenizer, chat template and incremental detokenization.

Built on the `tokenizers` library and a `tokenizer.json` file, with the chat template rendered by
jinja2 the way transformers renders it, so loading the engine never imports transformers (which
takes seconds). Tests check that ids and templates match transformers exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

Message = dict[str, Any]
# vLLM's choice: decode a few tokens of left context so a token's leading space survives.
_CONTEXT_TOKENS = 5
# Characters tokenized per call while a long text is measured: about a millisecond each on
# SmolLM2's tokenizer, which holds the GIL for the whole call, so other threads run in between.
PIECE_CHARS = 2048


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _pieces(text: str, size: int) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` characters, each cut before a space when
    there is one to cut at."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            space = text.rfind(" ", start + 1, end)
            end = space if space > start else end
        yield text[start:end]
        start = end


class Tokenizer:
    """Text <-> token ids, plus the model's chat template and its end-of-sequence ids."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_ids: Sequence[int],
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))

    @classmethod
    def from_pretrained(cls, folder: str | Path, extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
        folder = Path(folder)
        backend = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t["name"] == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        special = {
            key: content
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (content := _token_content(config.get(key))) is not None
        }
        eos_ids = list(extra_eos_ids)
        if "eos_token" in special:
            eos_id = backend.token_to_id(special["eos_token"])
            if eos_id is not None:
                eos_ids.append(eos_id)
        return cls(backend, chat_template=template, special_tokens=special, eos_token_ids=eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_chars_per_token(self) -> int:
        """The longest token, in characters of its vocabulary string. A byte-level token decodes
        to at most that many characters, so a text longer than `n * max_chars_per_token` cannot
        fit in n tokens: the engine refuses it before paying for the tokenization."""
        return max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_within(
        self, text: str, max_tokens: int, *, add_special_tokens: bool = True
    ) -> list[int] | None:
        """The ids of `text`, or None when it clearly has more than `max_tokens` tokens.

        Tokenizing a 600,000-character prompt holds the GIL for about a second, and a prompt
        that long cannot fit any context. So a long text is first measured piece by piece (cut
        before a space, where a byte-level BPE's pre-tokenizer cuts too), stopping as soon as
        the count passes twice `max_tokens`; only a text that may fit is tokenized whole, for
        the exact ids. Cutting can change the merges around each cut by a few tokens (0.002%
        on a 200,000-token text): the factor two leaves a margin far beyond that, so nothing
        that fits is refused here, and whoever asked still checks the exact length."""
        if len(text) > PIECE_CHARS:
            count = 0
            for piece in _pieces(text, PIECE_CHARS):
                count += len(self.encode(piece, add_special_tokens=False))
                if count > 2 * max_tokens:
                    return None
        return self.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @cached_property
    def _template(self) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        assert self.chat_template is not None
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation into the prompt text the model was trained on."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if not messages:
            raise ValueError("messages must not be empty")
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of a conversation plus the assistant header (the template adds specials)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, one token at a time.

    Decoding token by token breaks multi-byte characters (an emoji may span three tokens) and
    drops leading spaces, so each step decodes a short window of ids that ends at the newest token
    and returns only the text that is complete, as vLLM's detokenizer does.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        full = decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence, or a token that renders as nothing
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def extend(self, token_ids: Sequence[int]) -> str:
        """Append many tokens at once; return the text they complete: what `add` token by token
        would return joined, in a few decodes instead of two per token. A request that reads
        its text only at its end (stage 01's `Request._decode_pending`) detokenizes this way.

        One decode takes the longest run of the new tokens whose text ends on a whole
        character; the tokens after it go through `add`, whose rules say what is held back.
        In text that is a few tokens at most (an unfinished character is at most three
        bytes), found in the first tries. Bytes that never make a character (a random
        model's tokens, bytes split off invalid UTF-8) may hold the end back further: the
        search goes on back, one decode a try, as long as it must. It stopped three tokens
        back once, and sent every token through `add` (two decodes each, over a window that
        grows while nothing completes): 20 decodes a request on the step profile's random
        tokens. Only when no run of the new tokens ends whole do all of them go through
        `add`."""
        if not token_ids:
            return ""
        start = len(self._ids)
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        for end in range(len(self._ids), start, -1):
            full = decode(self._ids[self._prefix_offset : end])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                # The window restarts where that text ended, a token boundary `add` also used.
                rest = self._ids[end:]
                del self._ids[end:]
                self._prefix_offset = self._read_offset
                self._read_offset = end
                return full[len(prefix) :] + "".join(self.add(token_id) for token_id in rest)
        del self._ids[start:]
        return "".join(self.add(token_id) for token_id in token_ids)
