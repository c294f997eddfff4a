"""The tiny chat tokenizer of the multi-turn GRPO tests and of
scripts/recipe_tool_grpo.py: word-level, a Hermes-style chat template (tools in the system
turn, tool results as <tool_response> in a user turn, <|im_end|> the EOS), its vocabulary
holding whole tool calls as single tokens, so a tiny LLaMA can call tools in one token."""

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CALLS = {  # each call three ways (the parser strips the spaces): a third of the vocabulary
    "hang": '{"name": "hang", "arguments": {}}',
    "raise": '{"name": "boom", "arguments": {}}',
    "ok": '{"name": "add", "arguments": {"a": 2, "b": 3}}',
    "bad_json": '{"name": "add", "arguments": {"a": ',
}
CALL_TOKENS = [f"<tool_call>{pad}{call}{pad}</tool_call>" for call in CALLS.values()
               for pad in ("", " ", "  ")]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system <tools> {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}</tools><|im_end|>{% endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'tool' %}<|im_start|>user <tool_response> "
    "{{ m['content'] }} </tool_response><|im_end|>{%- else %}<|im_start|>{{ m['role'] }} "
    "{{ m['content'] }}<|im_end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant {% endif %}")
WORDS = ["<pad>", "<unk>", "<|im_end|>", "<|im_start|>", "system", "user", "assistant",
         "<tools>", "</tools>", "<tool_response>", "</tool_response>", "add", "boom", "hang",
         "5", "error:", "the", "cat", "dog", "sun", "odd", "even", "a", "is"]
VOCAB = len(WORDS) + len(CALL_TOKENS)  # 36; <|im_end|> is id 2, the debug LLaMA's EOS

TOOLS_MODULE = '''
import threading


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


def hang() -> str:
    """Never answers in time."""
    threading.Event().wait(60)
    return "late"
'''


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(w, special=True) for w in WORDS[:4]])
    tok.add_tokens([AddedToken(c, normalized=False) for c in CALL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    assert len(fast) == VOCAB and fast.eos_token_id == 2
    return fast
