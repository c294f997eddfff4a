"""What a multi-turn GRPO episode talks to (`--grpo.tools`, `--grpo.environment`).

An environment is a class with

    reset(example) -> messages                   the conversation the model starts from
    step(messages) -> (messages_to_append, reward_or_None, done)

`step` is called after each of the model's turns that ended with its EOS, with the whole
conversation so far (the model's turn last, {"role": "assistant", "content": text});
what it appends (tool or user messages) is rendered by the chat template and prefilled
onto the episode's cache, and the model takes its next turn. Its rewards are summed per
episode for the `environment` reward function. One instance per episode.

`--grpo.tools=MODULE:FN[,FN...]` is the built-in one (`ToolEnvironment`): plain functions
with type hints and a Google-style docstring, shown to the model as the JSON schemas
transformers' `get_json_schema` makes (the chat template renders them, as TRL's `tools=`);
the model's tool calls, in the Qwen/Hermes format `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` or Llama 3.x's bare `{"name": ..., "parameters": {...}}`, are run with
a per-call timeout, and each result, or what went wrong (an exception, a timeout, an
unknown tool, bad JSON), is the tool message the model reads next. A turn without a tool
call ends the episode.
"""

import importlib
import json
import re
import threading

from easylm.errors import UserError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _import(flag: str, spec: str, what: str):
    module_name, colon, names = spec.partition(":")
    if not colon or not module_name or not names:
        raise UserError(f"--grpo.{flag}={spec!r} must be MODULE:{what}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (its import may fail any way)
        raise UserError(f"--grpo.{flag}={spec}: cannot import {module_name!r} ({type(e).__name__}:"
                        f" {e})") from None
    out = []
    for name in (n.strip() for n in names.split(",")):
        if not hasattr(module, name):
            raise UserError(f"--grpo.{flag}={spec}: module {module_name!r} has no {name!r}")
        out.append(getattr(module, name))
    return out


def load(options):
    """(a factory of one environment per episode, the tools' JSON schemas for the chat
    template or None), or None for single-turn GRPO."""
    if options.tools and options.environment:
        raise UserError("--grpo.tools and --grpo.environment are exclusive: tools are one "
                        "environment; give a class that runs them itself, or the functions")
    if options.environment:
        (cls,) = _import("environment", options.environment, "CLASS")
        for method in ("reset", "step"):
            if not callable(getattr(cls, method, None)):
                raise UserError(f"--grpo.environment={options.environment}: the class has no "
                                f"{method}() method (reset(example) -> messages, step(messages) "
                                f"-> (messages, reward or None, done))")
        return cls, None
    if options.tools:
        from transformers.utils import get_json_schema

        functions = _import("tools", options.tools, "FN[,FN...]")
        schemas = []
        for f in functions:
            try:
                schemas.append(get_json_schema(f))
            except Exception as e:  # noqa: BLE001  (transformers' DocstringParsingException...)
                raise UserError(f"--grpo.tools: {getattr(f, '__name__', f)!r} has no JSON "
                                f"schema ({e}); a tool needs type hints and a docstring with "
                                f"an Args: section") from None
        timeout = options.tool_timeout
        return (lambda: ToolEnvironment(functions, timeout)), schemas
    return None


def parse_tool_calls(text: str):
    """[(name, arguments dict) or (None, error text)] of the tool calls in a model turn:
    Hermes/Qwen `<tool_call>{json}</tool_call>` blocks, else a turn that is one Llama 3.x
    JSON object {"name": ..., "parameters" or "arguments": {...}} (after an optional
    <|python_tag|>). [] when the turn calls nothing."""
    blocks = _HERMES.findall(text)
    if not blocks:
        bare = text.strip().removeprefix("<|python_tag|>").strip()
        if not (bare.startswith("{") and '"name"' in bare):
            return []
        blocks = [bare]
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append((None, f"error: the tool call is not valid JSON ({e}): {block[:200]}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            error = f"error: a tool call is a JSON object with a \"name\", got {block[:200]}"
            calls.append((None, error))
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                error = f"error: the arguments of {call['name']} are not valid JSON ({e})"
                calls.append((None, error))
                continue
        if not isinstance(arguments, dict):
            calls.append((None, f"error: the arguments of {call['name']} must be an object"))
            continue
        calls.append((call["name"], arguments))
    return calls


def call_with_timeout(function, arguments: dict, timeout: float) -> str:
    """The tool's result as text (str as it is, anything else as JSON, or its str() when
    JSON cannot write it), or the error the model reads instead. The call runs in a daemon
    thread: one that hangs past `timeout` is abandoned there (a Python thread cannot be
    killed), and the episode goes on."""
    result = {}

    def run():
        try:
            result["value"] = function(**arguments)
        except BaseException as e:  # noqa: BLE001  (whatever a tool raises, the model reads it)
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True, name=f"tool-{function.__name__}")
    thread.start()
    thread.join(timeout if timeout > 0 else None)
    name = function.__name__
    if thread.is_alive():
        return f"error: the call to {name} timed out after {timeout:g} s"
    if "error" in result:
        e = result["error"]
        return f"error: {name} raised {type(e).__name__}: {e}"
    value = result["value"]
    if isinstance(value, str):
        return value
    for text in (json.dumps, str):  # str: what JSON has no form for (an object, a cycle)
        try:
            return text(value)
        except Exception as e:  # noqa: BLE001  (a __str__ may raise anything)
            error = e
    return f"error: {name} returned a {type(value).__name__} with no text " \
           f"({type(error).__name__}: {error})"


class ToolEnvironment:
    """The built-in environment of `--grpo.tools`: the example's prompt; each turn's tool
    calls run, their results appended as tool messages; a turn without one ends it."""

    def __init__(self, functions, timeout: float):
        self.tools = {f.__name__: f for f in functions}
        self.timeout = timeout
        self.calls = self.errors = 0

    def reset(self, example) -> list[dict]:
        prompt = example["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def step(self, messages):
        calls = parse_tool_calls(messages[-1]["content"])
        if not calls:
            return [], None, True
        out = []
        for name, arguments in calls:
            self.calls += 1
            if name is None:
                content = arguments  # the parse error
            elif name not in self.tools:
                content = (f"error: unknown tool {name!r}; the tools are "
                           f"{', '.join(sorted(self.tools))}")
            else:
                content = call_with_timeout(self.tools[name], arguments, self.timeout)
            self.errors += content.startswith("error: ")
            out.append({"role": "tool", "name": name or "unknown", "content": content})
        return out, None, False
