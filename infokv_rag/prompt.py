"""Chat template -> document prefix + question suffix.

The document is the start of the first user turn, so its tokens form a prefix shared by every question;
each question (or conversation) is a suffix that ends with the assistant's generation prompt. The split
is found by rendering the model's own chat template around sentinels, as kvpress's pipeline does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .documents import is_blank, unpaired_surrogate
from .errors import ConfigError, EmptyQuestionError

_SENTINEL = "\u2063INFOKV-SPLIT\u2063"
_FENCE = "\u2063INFOKV-TURN\u2063"

DOCUMENT_INTRO = "Read the document below, then answer the question that follows it.\n\nDocument:\n"
ANSWER_INSTRUCTION = "Answer concisely, using only the document above."
DOCUMENT_END = "\n\n"
"""What the document prefix ends with, after the document's text: the questions' suffixes are read after it."""

Turn = tuple[str, str]
"""(role, content) with role in system, user, assistant."""

_ENCODING = threading.Lock()
"""Held while a tokenizer encodes. transformers' fast tokenizer keeps `split_special_tokens` in the Rust tokenizer that
every call shares, setting it before each encode and reading it during: two threads encoding at once, one a text to
read as text and one a template, read with each other's setting (a question's ids split the template's `<|im_end|>`
into characters; a quoted `<|im_end|>` became the control token)."""


def question_turns(question: str) -> list[Turn]:
    """The conversation that asks one question about the document; `ConfigError` for a question that is not Unicode
    text, `EmptyQuestionError` for one with nothing to read (`is_blank`)."""
    _check_content(question)
    if is_blank(question):
        raise _empty("the question")
    return [("user", f"Question: {question}\n{ANSWER_INSTRUCTION}")]


def _empty(what: str) -> EmptyQuestionError:
    return EmptyQuestionError(
        f"{what} is empty (nothing but whitespace or control characters): ask a question about the document"
    )


def check_conversation(turns: Sequence[Turn]) -> None:
    """Refuses a conversation that cannot be asked, without a tokenizer: as `conversation_messages` does, and with
    `EmptyQuestionError` when its question, the last user turn after the last answer, is empty (`is_blank`; with no
    user turn there, the system turns that stand for it). Every answer passes here (`CompressedDocument.generate`),
    and the surfaces call it first, before any document is read."""
    conversation_messages(turns)
    # What is asked: the turns after the last answer (a system turn alone there is a user message of its own, as
    # `conversation_messages` folds it); a conversation that ends with an answer asks its last user message again.
    last_answer = max((index for index, (role, _) in enumerate(turns) if role == "assistant"), default=-1)
    asked = turns[last_answer + 1 :] or turns
    users = [content for role, content in asked if role == "user"]
    question = users[-1] if users else "".join(content for role, content in asked if role == "system")
    if is_blank(question):
        raise _empty("the question (the conversation's last user message)")


def conversation_messages(turns: Sequence[Turn]) -> list[dict[str, str]]:
    """A conversation's turns as the chat template's messages: every turn a (role, content) pair of strings, every
    content Unicode text (`ConfigError`), roles system, user or assistant, the first message a user's.

    System turns are folded into the next user turn because the template's system slot sits before the document,
    which is already cached; those after the last user turn join it.
    """
    _check_shape(turns)
    messages: list[dict[str, str]] = []
    pending_system: list[str] = []
    for role, content in turns:
        _check_content(content)
        if role == "system":
            pending_system.append(content)
            continue
        if role not in ("user", "assistant"):
            raise ConfigError(f"unknown chat role {role!r}; use system, user or assistant")
        if role == "user" and pending_system:
            content = "\n".join([*pending_system, content])
            pending_system = []
        _add_turn(messages, role, content)
    if pending_system:  # after the last user turn: it still speaks to the question, so it joins it
        _add_turn(messages, "user", "\n".join(pending_system))
    if not messages or messages[0]["role"] != "user":
        raise ConfigError(
            "a conversation about the document must start with a user message (the document opens the first user "
            "turn): leave out an assistant's opening message, such as a greeting, or start with the user's"
        )
    return messages


class PromptFormat:
    """Builds token ids for the document prefix and question suffixes with one tokenizer.

    The template head is rendered once, when the format is made, so every document it reads (and `head_tokens`)
    shares one head even where the template prints today's date (Llama 3.x's "Today Date").
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._head = self._head_now()
        self._controls = tuple(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)

    def _head_now(self) -> str:
        """What the chat template renders before the first user turn's text, read at this moment."""
        head, _ = self._render([{"role": "user", "content": _SENTINEL}], _SENTINEL).split(_SENTINEL)
        return head

    @property
    def chat_template(self) -> str:
        return str(self.tokenizer.chat_template or "")

    def _render(self, messages: list[dict[str, str]], marker: str) -> str:
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(marker) != 1:
            raise ConfigError("the model's chat template does not place the first user turn verbatim")
        return str(rendered)

    def spells_control(self, text: str) -> bool:
        """Whether `text` holds the spelling of one of the tokenizer's control tokens (`<|im_end|>`)."""
        return any(control in text for control in self._controls)

    def ids(self, text: str, as_text: bool) -> list[int]:
        """`text`'s token ids alone, no special tokens added; a control token's spelling read as text if `as_text`,
        else as the control token. Every encode of the engine's tokenizer goes through here (`_ENCODING`)."""
        with _ENCODING:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=as_text)["input_ids"])

    def _encode(self, pieces: Sequence[str], after: str = "") -> list[int]:
        """Token ids of the template's text and the caller's alternating, the template's first, as they read after
        the text `after` ends (the document prefix, before a question): the template's control tokens read as such,
        the caller's text (a document, a turn) read as text whatever it spells, so a contract quoting `<|im_end|>`
        cannot end its turn and answer in its place. Read in one call where the caller's text spells no control
        token (ids at a piece's edge may differ from the pieces' own, and every other text reads as it always has)."""
        if not any(self.spells_control(piece) for piece in pieces[1::2]):
            return self._ids_after(after[-1:], "".join(pieces), as_text=False)
        ids: list[int] = []
        for index, piece in enumerate(pieces):
            before = pieces[index - 1][-1:] if index else after[-1:]
            ids += self._ids_after(before, piece, as_text=index % 2 == 1)
        return ids

    def _ids_after(self, before: str, text: str, as_text: bool) -> list[int]:
        """`text`'s ids as they read after the character `before` (where the piece before it ends): alone, a
        SentencePiece tokenizer would begin it with a word-start space that the rendered prompt does not hold. Alone
        after all where `before` and `text` share a token."""
        if before:
            anchor = self.ids(before, as_text=True)
            ids = self.ids(before + text, as_text)
            if ids[: len(anchor)] == anchor:
                return ids[len(anchor) :]
        return self.ids(text, as_text)

    def text_tokens(self, text: str) -> int:
        """How many tokens `text` is, read as text (a piece of a document)."""
        return len(self.ids(text, as_text=self.spells_control(text)))

    @property
    def head_tokens(self) -> int:
        """Tokens of the template head and instruction that precede every document."""
        return len(self._encode([f"{self._head}{DOCUMENT_INTRO}"]))

    def document_ids(self, text: str) -> list[int]:
        """Tokens of the template head, the instruction and the document: the cached prefix."""
        return self._encode([f"{self._head}{DOCUMENT_INTRO}", text.strip(), DOCUMENT_END])

    def conversation_ids(self, turns: Sequence[Turn]) -> list[int]:
        """Tokens that follow the document prefix for a conversation, up to the assistant prompt; the turns are
        checked and folded as `conversation_messages` says (an empty question is `check_conversation`'s to refuse:
        the chat template's own tokens are counted around an empty one)."""
        messages = conversation_messages(turns)
        contents = [message["content"] for message in messages]
        marker = _unquoted(_SENTINEL, contents)
        # A turn that spells a control token is fenced, to be read as text (`_encode`); the others are rendered as
        # they are, so a template that trims or rewrites them does so.
        spelling = [content for content in contents if self.spells_control(content)]
        fence = _unquoted(_FENCE, contents) if spelling else ""
        messages = [
            {**message, "content": f"{fence}{message['content']}{fence}"} if message["content"] in spelling else message
            for message in messages
        ]
        messages[0] = {**messages[0], "content": marker + messages[0]["content"]}
        head, suffix = self._render(messages, marker).split(marker)
        # A head that prints today's date changes at midnight, after documents were cached behind the old one (or
        # saved on another day); the suffix never holds the head, so it only has to agree with today's.
        if head != self._head and head != self._head_now():
            raise ConfigError("the chat template renders the document turn differently for this conversation")
        # Read after the document prefix's end: alone, a SentencePiece tokenizer would begin the suffix with a
        # word-start space that the whole prompt does not hold.
        if not fence:
            return self._encode([suffix], after=DOCUMENT_END)
        pieces = suffix.split(fence)
        if pieces[1::2] != spelling or len(pieces) % 2 == 0:
            raise ConfigError("the model's chat template does not place verbatim a turn that quotes a control token")
        return self._encode(pieces, after=DOCUMENT_END)

    def question_ids(self, question: str) -> list[int]:
        return self.conversation_ids(question_turns(question))


def _unquoted(marker: str, texts: Sequence[str]) -> str:
    """`marker`, lengthened until none of `texts` holds it (a turn may quote it)."""
    while any(marker in text for text in texts):
        marker += "\u2063"
    return marker


def _add_turn(messages: list[dict[str, str]], role: str, content: str) -> None:
    """Appends a turn to `messages`, merged into the last one when it has the same role."""
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"] += "\n\n" + content
    else:
        messages.append({"role": role, "content": content})


def _check_shape(turns: object) -> None:
    """Refuses (`ConfigError`) a conversation that is not a sequence of (role, content) pairs of strings, such as
    OpenAI-style message dicts or a bare question."""
    # A sequence, not any iterable: a generator would be spent here, before the turns are read.
    if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
        raise ConfigError(f"a conversation must be a list of (role, content) pairs of strings, not {_shortened(turns)}")
    for turn in turns:
        if not (isinstance(turn, (tuple, list)) and len(turn) == 2 and all(isinstance(part, str) for part in turn)):
            raise ConfigError(f"each turn must be a (role, content) pair of strings, not {_shortened(turn)}")


def _shortened(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _check_content(content: object) -> None:
    """Refuses (`ConfigError`) a message that is not Unicode text."""
    if not isinstance(content, str):
        raise ConfigError(f"a message (a question) must be text, not {type(content).__name__}")
    where = unpaired_surrogate(content)
    if where is not None:
        raise ConfigError(f"a message holds a lone surrogate ({content[where]!r} at character {where}), not text")
