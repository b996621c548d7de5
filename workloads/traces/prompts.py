"""Turn a session into the token ids of each request, closed loop.

Chat sessions go through the model's chat template the way ``Engine.chat`` does it: turn k+1
starts with exactly the tokens of turn k's prompt and its actual reply (as generated, end of
turn included), followed by the tokens of what the template adds (the new user message, the
assistant header). Raw sessions are plain token concatenations: system, documents, user text,
each encoded on its own, then the actual reply ids and the next user text appended.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine import continue_tokens
from workloads.traces.text import encode
from workloads.traces.tokenizer import TextTokenizer
from workloads.traces.trace import Session, Trace


class SessionPrompts:
    """The state of one session while it runs: call :meth:`prompt` for turn k, then
    :meth:`record_reply` with the reply's ids before asking for turn k+1."""

    def __init__(self, session: Session, trace: Trace, tokenizer: TextTokenizer) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self._docs = [trace.documents[d] for d in session.documents]
        self._messages: list[dict[str, str]] = []
        self._raw: list[int] = []  # raw: the token ids so far; chat: last prompt + reply
        self._turn = 0
        if session.template == "chat":
            system = "\n\n".join(p for p in [session.system, *self._docs] if p)
            if system:
                self._messages.append({"role": "system", "content": system})
        else:
            for part in [session.system, *self._docs]:
                if part:
                    self._raw.extend(encode(tokenizer, part))

    @property
    def turn(self) -> int:
        """Index of the next turn to send."""
        return self._turn

    def prompt(self) -> list[int]:
        """Token ids of the current turn's request."""
        user = self.session.turns[self._turn].user
        if self.session.template == "raw":
            return self._raw + encode(self.tokenizer, user)
        text = self.tokenizer.apply_chat_template(
            [*self._messages, {"role": "user", "content": user}],
            tokenize=False, add_generation_prompt=True,
        )
        ids, _ = continue_tokens(self.tokenizer, self._raw, text)
        return ids

    def branch_prompts(self, prompt: Sequence[int]) -> list[list[int]]:
        """The current turn's candidate branches: its prompt + each branch text."""
        turn = self.session.turns[self._turn]
        return [list(prompt) + encode(self.tokenizer, b) for b in turn.branches]

    def record_reply(self, prompt: Sequence[int], reply_ids: Sequence[int],
                     reply_text: str | None = None) -> None:
        """Carry the actual reply into the history and move to the next turn.

        ``reply_text``: the reply as the engine returned it (stop strings cut); None decodes
        ``reply_ids`` without special tokens.
        """
        self._raw = list(prompt) + list(reply_ids)
        if self.session.template == "chat":
            if reply_text is None:
                reply_text = self.tokenizer.decode(list(reply_ids), skip_special_tokens=True)
            user = self.session.turns[self._turn].user
            self._messages.append({"role": "user", "content": user})
            self._messages.append({"role": "assistant", "content": reply_text})
        self._turn += 1
