"""GRPO's reward functions (`--grpo.reward_funcs`), called as TRL's GRPOTrainer calls them:

    reward(prompts, completions, completion_ids=..., **fields) -> list[float | None]

`prompts` and `completions` are lists of one entry per completion (a prompt repeated
for each of its completions): text, or for a chat prompt its messages and the
completion as [{"role": "assistant", "content": text}]; `fields` holds each other field
of the examples as a list (`answer=[...]`; None where an example lacks it). None: the
function does not apply to that completion (it counts in neither the sum nor its mean).

Built-ins, for verifiable tasks:
  answer_match    1.0 when the completion's answer (the last \\boxed{...}, else the text
                  after the last '####') equals the example's `answer` (after its own
                  '####' if it has one, as GSM8K writes them): numerically when both parse
                  as numbers ('1,000', '$5', '0.50', '3/4'), else as text; 0.0 otherwise
  format          1.0 when the whole completion matches --grpo.format_pattern (default:
                  an answer answer_match can read), else 0.0
  length_penalty  DAPO's soft overlong punishment (2503.14476 eq. 13): 0 up to
                  max_new_tokens - length_buffer tokens, then falling linearly to -1 at
                  max_new_tokens
  environment     the episode's rewards from --grpo.environment's step() (summed; None
                  where it gave none): multi-turn rollouts only
  math_verify     1.0 when HF's math-verify finds the completion's answer equivalent to
                  `answer` (LaTeX and symbolic equivalence, e.g. $x^2+1$ = $1+x^2$); needs
                  the optional extra: pip install 'easylm[rl]'
A user function is `module:function` (module importable from the working directory).
answer_match needs nothing beyond the standard library and is exact about what it
accepts; math_verify is the checker TRL's and open-r1's recipes use (docs/rl.md).
"""

import importlib
import math
import re
from fractions import Fraction
from typing import Callable

import numpy as np

from easylm.errors import UserError

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(e[-+]?\d+)?$", re.IGNORECASE)
DEFAULT_FORMAT = r"(?s).*(####\s*\S.*|\\boxed\s*\{.+\}.*)"


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None without one."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The answer a completion states: the last \\boxed{}, else what follows the last
    '####' (its first line); None when it states none."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    return None


def _number(text: str):
    """A Fraction for '1,000', '$5', '0.50', '3/4', '\\frac{3}{4}', '1e3'; None for
    anything else (a percent sign, units: compared as text)."""
    s = text.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    frac = re.fullmatch(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if frac:
        a, b = _number(frac.group(1)), _number(frac.group(2))
        return a / b if a is not None and b not in (None, 0) else None
    if s.count("/") == 1:
        a, b = (_number(x) for x in s.split("/"))
        return a / b if a is not None and b not in (None, 0) else None
    if _NUMBER.match(s):
        return Fraction(s) if "e" not in s.lower() else Fraction(float(s))
    return None


def same_answer(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    expected = expected.rsplit("####", 1)[1] if "####" in expected else expected
    a, b = _number(given), _number(expected)
    if a is not None and b is not None:
        return a == b
    return " ".join(given.split()) == " ".join(expected.strip().split())


def _text(completion) -> str:
    """A completion's text (a chat completion is [{"role": "assistant", "content": ...}])."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def answer_match(prompts, completions, answer=None, **fields):
    if answer is None:
        raise UserError("the answer_match reward reads each example's 'answer' field, which "
                        "the prompts do not have")
    return [None if a is None else float(same_answer(extract_answer(_text(c)), str(a)))
            for c, a in zip(completions, answer)]


def environment(prompts, completions, environment_reward=None, **fields):
    if environment_reward is None:
        raise UserError("the environment reward reads the rewards of --grpo.environment's "
                        "step(), which single-turn rollouts have none of")
    return list(environment_reward)


def make_format(pattern: str) -> Callable:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise UserError(f"--grpo.format_pattern={pattern!r} is not a regular expression: {e}") \
            from None

    def format(prompts, completions, **fields):
        return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]

    return format


def make_length_penalty(max_new_tokens: int, buffer: int) -> Callable:
    buffer = buffer or max(1, max_new_tokens // 4)
    if not 0 < buffer <= max_new_tokens:
        raise UserError(f"--grpo.length_buffer={buffer} must be in [1, --grpo.max_new_tokens="
                        f"{max_new_tokens}]")

    def length_penalty(prompts, completions, completion_ids, **fields):
        free = max_new_tokens - buffer
        return [min(0.0, (free - len(ids)) / buffer) for ids in completion_ids]

    return length_penalty


def make_math_verify() -> Callable:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("--grpo.reward_funcs=math_verify needs the math-verify package: pip "
                        "install 'easylm[rl]' (or use answer_match)") from None

    def math_verify(prompts, completions, answer=None, **fields):
        if answer is None:
            raise UserError("the math_verify reward reads each example's 'answer' field, which "
                            "the prompts do not have")
        out = []
        for c, a in zip(completions, answer):
            if a is None:
                out.append(None)
                continue
            a = str(a).rsplit("####", 1)[-1].strip()
            gold = parse(a if "$" in a or "\\" in a else f"${a}$")
            out.append(float(verify(gold, parse(_text(c)))))
        return out

    return math_verify


BUILT_INS = ("answer_match", "environment", "format", "length_penalty", "math_verify")


def load(names: str, options) -> list[tuple[str, Callable]]:
    """[(name, function)] for --grpo.reward_funcs (comma-separated)."""
    out = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        if name == "answer_match":
            out.append((name, answer_match))
        elif name == "environment":
            out.append((name, environment))
        elif name == "format":
            out.append((name, make_format(options.format_pattern or DEFAULT_FORMAT)))
        elif name == "length_penalty":
            out.append((name, make_length_penalty(options.max_new_tokens, options.length_buffer)))
        elif name == "math_verify":
            out.append((name, make_math_verify()))
        else:
            out.append((name, _user_function(name)))
    if not out:
        raise UserError("--grpo.reward_funcs is empty: name at least one reward function "
                        f"({', '.join(BUILT_INS)}, or module:function)")
    return out


def _user_function(name: str) -> Callable:
    module_name, colon, attribute = name.partition(":")
    if not colon or not module_name or not attribute:
        raise UserError(f"--grpo.reward_funcs: unknown reward function {name!r}: not a "
                        f"built-in ({', '.join(BUILT_INS)}) nor module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (its import may fail any way)
        raise UserError(f"--grpo.reward_funcs={name}: cannot import {module_name!r} "
                        f"({type(e).__name__}: {e})") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise UserError(f"--grpo.reward_funcs={name}: module {module_name!r} has no function "
                        f"{attribute!r}")
    return function


def score(functions, prompts, completions, completion_ids, fields) -> list[list[float]]:
    """Each function's rewards [function][completion], None as NaN; a function that raises
    or returns anything but one number (or None) per completion is a UserError naming it."""
    n = len(completions)
    out = []
    for name, function in functions:
        try:
            values = function(prompts=prompts, completions=completions,
                              completion_ids=completion_ids, **fields)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (a user's function)
            raise UserError(f"reward function {name} raised {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise UserError(f"reward function {name} returned {type(values).__name__}, "
                            f"expected a list of {n} floats (or None)") from None
        if len(values) != n:
            raise UserError(f"reward function {name} returned {len(values)} values for {n} "
                            f"completions")
        row = []
        for v in values:
            if v is None:
                row.append(math.nan)
            elif not isinstance(v, bool) and np.ndim(v) == 0 and \
                    np.issubdtype(np.asarray(v).dtype, np.number):
                row.append(float(v))
            else:
                raise UserError(f"reward function {name} returned {v!r}, expected a float or "
                                f"None per completion")
        out.append(row)
    return out

