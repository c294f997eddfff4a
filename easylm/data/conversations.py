"""Conversations rendered to token ids with a chat template, for rollouts that append to
them turn by turn (GRPO's --grpo.tools / --grpo.environment, easylm/objectives/episodes.py;
the prompts `python -m easylm.data.preview` shows for them).

A turn appended to a conversation is tokenized as the template's delta: the conversation
rendered before and after, the new suffix (`ChatRenderer.delta`), so the ids already in a
row (the model's sampled ones) stay as they are; a template that renders earlier turns
differently once more are appended is refused. Messages too long for the row are cut,
marked (`ChatRenderer.fit`).
"""

from easylm.data.prompts import chat_template
from easylm.errors import UserError


def make_renderer(flag: str, template_option: str, tokenizer, schemas,
                  eos_id: int) -> "ChatRenderer":
    """The ChatRenderer of a run's `flag` (--grpo.tools or --grpo.environment): the chat
    template of --train_dataset.text_processor.chat_template or the tokenizer's, checked
    to be prefix-stable; a template that ignores tools= is said in one line."""
    template = chat_template(template_option, tokenizer)
    if not template:
        raise UserError(f"{flag}: multi-turn rollouts render conversations with a chat "
                        f"template, and the tokenizer has none; set --train_dataset."
                        f"text_processor.chat_template")
    renderer = ChatRenderer(tokenizer, template, schemas, eos_id)
    renderer.delta([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}],
                   [{"role": "tool", "name": "probe", "content": "ok"}], True)  # stable?
    if schemas and not renderer.renders_tools():
        print(f"warning: {flag}: the chat template ignores tools=: the model is not shown "
              f"the tools' schemas (the calls it makes are still run)")
    return renderer


def _text_length(message) -> int:
    content = message.get("content")
    return len(content) if isinstance(content, str) else 0


def _cut(messages, chars: int):
    """`messages` with each text content longer than `chars` characters cut there, marked."""
    return [dict(m, content=f"{m['content'][:chars]} [cut: {len(m['content'])} characters "
                            f"in all]") if _text_length(m) > chars else m for m in messages]


class ChatRenderer:
    """Conversations -> ids with the chat template (the tools' schemas through `tools=`,
    as TRL's GRPOTrainer renders them). Ids are the template's text tokenized without the
    tokenizer's own special tokens (a BOS comes from the template's bos_token, once), as
    transformers' apply_chat_template(tokenize=True) makes them."""

    def __init__(self, tokenizer, template, schemas, eos_id: int):
        self.tokenizer, self.template, self.schemas, self.eos = tokenizer, template, schemas, eos_id

    def ids(self, messages, generation: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.schemas, chat_template=self.template, tokenize=False,
            add_generation_prompt=generation)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def renders_tools(self) -> bool:
        """Whether the template shows the tools at all (a probe with and without them)."""
        probe = [{"role": "user", "content": "hi"}]
        schemas, self.schemas = self.schemas, None
        try:
            bare = self.ids(probe, True)
        finally:
            self.schemas = schemas
        return self.ids(probe, True) != bare

    def delta(self, messages, new, ended_by_eos: bool) -> list[int]:
        """The ids that follow the model's last turn when `new` messages are appended: the
        template's rendering of `messages + new` (with the generation prompt) less that of
        `messages`, plus what the template writes after the model's turn ends (its EOS, when
        the turn was cut before it, and e.g. a newline; `messages` ends with that turn)."""
        before, after = self.ids(messages, False), self.ids(messages + new, True)
        if after[:len(before)] != before:
            raise UserError("the chat template is not prefix-stable: appending messages "
                            "changes how the earlier turns render (e.g. it drops their "
                            "reasoning), so multi-turn rollouts (--grpo.tools, "
                            "--grpo.environment) cannot append the new messages' tokens "
                            "alone; set --train_dataset.text_processor.chat_template to one "
                            "that renders earlier turns as they were")
        # The model's turn: where the generation prompt before it ends. An EOS before that
        # (a BOS that is the EOS, GPT-2's) is not the turn's end.
        turn = before[min(len(self.ids(messages[:-1], True)), len(before)):]
        tail = []
        if self.eos in turn:
            at = len(turn) - 1 - turn[::-1].index(self.eos)
            tail = turn[at + (1 if ended_by_eos else 0):]
        return tail + after[len(before):]

    def fit(self, messages, new, ended_by_eos: bool, room: int, reserve: int):
        """(new, its delta) with the delta shorter than `room` tokens (what the row has
        left), or None. Messages too long for it (a tool's 1 MB answer) are cut, each
        content to the most characters that leave the model `reserve` tokens, and marked."""
        longest = max(map(_text_length, new))
        if longest <= 16 * room:  # else not worth rendering whole: cut it
            delta = self.delta(messages, new, ended_by_eos)
            if len(delta) < room:
                return new, delta

        def fits(chars):
            delta = self.delta(messages, _cut(new, chars), ended_by_eos)
            return delta if len(delta) <= room - max(reserve, 1) else None

        if fits(0) is None:
            return None
        low, high = 0, min(longest, 16 * room)  # fits(low); the answer is below high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) is not None else (low, middle)
        return _cut(new, low), fits(low)
