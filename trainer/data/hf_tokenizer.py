"""A Hugging Face model directory's tokenizer: `tokenizer.json` through the `tokenizers` library, and the chat
template of `tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2 as `transformers` renders
it: a sandboxed environment with trim_blocks and lstrip_blocks, the special tokens as variables.

What the assistant writes (what SFT counts) comes from the template's `{% generation %}` blocks where it has
them. The stock templates of most models (Llama 3.x, Qwen2.5/3, Mistral, SmolLM2) have none: then each
assistant turn is what rendering the conversation up to that message adds to the messages before it with the
generation prompt, cut after the first special token that follows the message's content (its end-of-turn
token); the role header belongs to the generation prompt and is not counted. That needs a template that
renders each turn the same alone as inside the whole conversation; `TemplateMaskError` says where one does not.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import cached_property

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateMaskError(ValueError):
    """A chat template whose assistant turns cannot be found message by message (the message says why)."""


class _GenerationSpans(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and records the body's character span."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.spans: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("spans", default=None)
        environment.extend(track_generation=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        text = caller()
        tracked = self.spans.get()
        if tracked is not None:
            blocks, spans = tracked
            start = len("".join(blocks))
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]):
        token = self.spans.set((blocks, spans))
        try:
            yield
        finally:
            self.spans.reset(token)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    """The tokenizer of model directory `path`."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config_file = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)
        self.special = {k: _token_text(config[k]) for k in SPECIAL_KEYS if config.get(k) is not None}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        self.chat_template = template
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, key: str) -> int | None:
        """The id of special token `key` (such as eos_token), or None when the directory names none."""
        text = self.special.get(key)
        return None if text is None else self.tokenizer.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _compiled(self):
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationSpans, jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            self._template = env.from_string(self.chat_template)
        return self._template

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The chat as text, and the character spans of its `{% generation %}` blocks."""
        template = self._compiled()
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with template.environment.track_generation(blocks, spans):
            for block in template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            ):
                blocks.append(block)
        return "".join(blocks), spans

    @property
    def has_generation_blocks(self) -> bool:
        return bool(self.chat_template) and bool(GENERATION_TAG.search(self.chat_template))

    @cached_property
    def _end_of_turn_tokens(self) -> re.Pattern:
        """The special tokens' texts (an end of turn is the first after a turn's content); never matches where
        the vocabulary has none."""
        special = sorted({t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special},
                         key=len, reverse=True)
        return re.compile("|".join(map(re.escape, special)) if special else r"(?!)")

    def _turn_span(self, messages: list[dict], i: int, whole: str) -> tuple[int, int]:
        """The character span, in `whole` (the rendered conversation), of assistant message `i`: its content and
        its end-of-turn token, found by rendering the messages before it with the generation prompt and the
        messages up to it."""
        where = f"message {i + 1} (the assistant's)"
        try:
            prompt, _ = self.render(messages[:i], add_generation_prompt=True)
            turn, _ = self.render(messages[: i + 1])
        except jinja2.exceptions.TemplateError as e:
            raise TemplateMaskError(f"fails to render the conversation up to {where} alone ({e})") from None
        if not whole.startswith(prompt):
            raise TemplateMaskError(f"renders the messages before {where} with the generation prompt as "
                                    f"{_tail(prompt)}, which the whole conversation does not start with")
        if not turn.startswith(prompt):
            raise TemplateMaskError(f"renders the conversation up to {where} without the generation prompt "
                                    f"({_tail(turn)}) that it renders before it ({_tail(prompt)})")
        added = turn[len(prompt):]
        special = self._end_of_turn_tokens
        token = special.search(added, _content_end(added, messages[i].get("content") or "", special))
        end = token.end() if token else len(added.rstrip())
        if whole[len(prompt) : len(prompt) + end] != added[:end]:
            raise TemplateMaskError(f"renders {where} as {_tail(added[:end])} when it is the last message, but as "
                                    f"{_tail(whole[len(prompt) : len(prompt) + end])} inside the whole conversation")
        return len(prompt), len(prompt) + end

    def assistant_spans(self, messages: list[dict], mask: str = "assistant", by_role: bool | None = None
                        ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text, and the character spans the loss counts: `assistant` every assistant turn,
        `last` the last one, `all` the whole text. The turns come from the `{% generation %}` blocks, or message
        by message (`by_role`, the default where the template has no blocks). Raises TemplateMaskError."""
        whole, blocks = self.render(messages)
        if mask == "all":
            return whole, [(0, len(whole))]
        if by_role is None:
            by_role = not self.has_generation_blocks
        if not by_role:
            return whole, blocks[-1:] if mask == "last" else blocks
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        return whole, [self._turn_span(messages, i, whole) for i in (turns[-1:] if mask == "last" else turns)]

    def apply_chat_template(self, messages: list[dict], mask: str = "assistant", by_role: bool | None = None
                            ) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of the chat: 1 for every token overlapping a span of `assistant_spans`."""
        text, spans = self.assistant_spans(messages, mask, by_role)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        counted = [0] * len(encoding.ids)
        i = 0
        for t, (start, end) in enumerate(encoding.offsets):
            while i < len(spans) and start >= spans[i][1]:
                i += 1
            if i == len(spans):
                break
            if end > spans[i][0]:
                counted[t] = 1
        return encoding.ids, counted


def _content_end(added: str, content: str, special: re.Pattern) -> int:
    """Where a turn's content ends in what the turn adds: after its first occurrence outside a special token
    (templates trim it, put a thinking block before it, or a header after it), else 0."""
    content = content.strip()
    tokens = [m.span() for m in special.finditer(added)]
    at = 0
    while content:
        found = added.find(content, at)
        if found < 0:
            break
        if not any(start < found + len(content) and found < end for start, end in tokens):
            return found + len(content)
        at = found + 1
    return 0


def _tail(text: str, width: int = 40) -> str:
    """The end of a rendered text, quoted, for an error message."""
    return repr(text if len(text) <= width else "..." + text[-width:])
