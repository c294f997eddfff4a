"""README.md as a newcomer runs it: what the Quick start installs is enough for the serve
command the trainer prints; every command and flag it names exists; its links resolve."""

import contextlib
import importlib
import io
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import tomllib
from importlib import metadata

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md")).read()
# The recipes in full, moved out of the README: their commands are checked as its own.
RECIPES = open(os.path.join(REPO, "docs", "recipes.md")).read()
# A fresh `python3.11 -m venv` has these before anything is installed.
VENV_BUILTIN = {"pip", "setuptools"}


def section(heading: str) -> str:
    match = re.search(rf"(?ms)^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", README)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def sh_block(heading: str) -> list[str]:
    """The lines of the section's one ```sh block (what .ci/run and a newcomer run)."""
    blocks = re.findall(r"(?ms)^```sh\n(.*?)^```", section(heading))
    assert len(blocks) == 1, f"'## {heading}' should have exactly one ```sh block"
    return [line for line in blocks[0].splitlines() if line.strip()]


def installed_by(lines: list[str]) -> set[str]:
    """Distributions (canonical names) that `lines`' pip installs bring, easylm included:
    its pyproject dependencies and named extras, then everything they require."""
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    wanted = []
    for line in lines:
        words = shlex.split(line.split("#")[0])
        if words[:2] != ["pip", "install"]:
            continue
        for word in words[2:]:
            if word.startswith("-"):
                continue
            match = re.fullmatch(r"\.(?:\[(.*)\])?", word)
            if match is None:  # a requirement of its own, e.g. torch==2.13.0
                wanted.append(word)
                continue
            wanted += project["dependencies"]
            for extra in filter(None, (match.group(1) or "").split(",")):
                wanted += project["optional-dependencies"][extra]
    seen = set()  # (distribution, extra) pairs whose requirements are counted
    todo = [(Requirement(r), "") for r in wanted]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        for wanted_extra in {"", *requirement.extras} - {e for n, e in seen if n == name}:
            seen.add((name, wanted_extra))
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:  # not for this platform (or not here)
                continue
            todo += [(Requirement(r), wanted_extra) for r in requires]
    return {name for name, _ in seen} | {"easylm"} | VENV_BUILTIN


def modules_not_installed_by(lines: list[str]) -> list[str]:
    """Top-level modules of this environment that `lines` would not have installed."""
    keep = installed_by(lines)
    return sorted(module for module, dists in metadata.packages_distributions().items()
                  if module.isidentifier() and module != "easylm"
                  and not {canonicalize_name(d) for d in dists} & keep)


# Runs `python -m MODULE ARGS` with the given top-level modules unimportable, as in an
# environment where they were never installed (find_spec says None, import raises), and
# Ctrl-C handled as in a terminal (a background shell may have left SIGINT ignored).
WITHOUT = """
import json, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def without(hidden: list[str], module: str, *args) -> list[str]:
    return [sys.executable, "-c", WITHOUT, json.dumps(hidden), module, *args]


@pytest.mark.slow
def test_the_printed_serve_command_needs_only_what_the_quick_start_installs(tmp_path):
    hidden = modules_not_installed_by(sh_block("Quick start"))
    # The check means something only if this environment has extras to hide.
    assert {"torch", "selenium", "openai", "pytest"} <= set(hidden), hidden
    env = {**os.environ, "PYTHONPATH": REPO}

    result = subprocess.run(without(hidden, "easylm.llama.serve", "--help"), env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "--load_checkpoint=" in result.stdout, result.stderr

    train = subprocess.run(
        without(hidden, "easylm.llama.train", "--total_steps=1",
                f"--logger.output_dir={tmp_path}"),
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    (command,) = [line.split(":", 1)[1].strip() for line in train.stdout.splitlines()
                  if line.startswith("serve it:")]
    program = shlex.split(command)
    assert program[:3] == ["python", "-m", "easylm.llama.serve"], command

    with serving(without(hidden, *program[2:], "--port=0"), env, tmp_path) as (ready, log):
        url = re.search(r"OpenAI API (\S+)", ready).group(1)
        assert "918,656 parameters, float32, context 512 tokens, 8 batch slots" in ready
        models = httpx.get(url + "/models", timeout=60).json()
        assert models["data"][0]["id"] == "easylm"
        # What the chat page sends (the chat template needs jinja2, which torch brought here).
        reply = httpx.post(url + "/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4,
            "temperature": 0}).json()
        assert reply.get("usage", {}).get("completion_tokens", 0) >= 1, reply
    # The ready line was all: no orbax or jax INFO chatter, no transformers advice, and no
    # traceback on Ctrl-C.
    assert log.read() == ""


@contextlib.contextmanager
def serving(argv: list[str], env: dict, cwd):
    """A server run as `argv` (with --port=0): yields (its ready line, its stderr file, read
    from the start after the block), and at the end Ctrl-C must stop it cleanly."""
    log = open(cwd / "serve.log", "w+")
    server = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=log,
                              text=True)
    try:
        # The ready line (bounded: a server that hangs before it fails here, not forever).
        assert select.select([server.stdout], [], [], 600)[0], "no ready line in 10 minutes"
        ready = server.stdout.readline()
        log.seek(0)
        assert ready.startswith("ready: chat page http://127.0.0.1:"), ready + log.read()
        yield ready, log
        server.send_signal(signal.SIGINT)  # Ctrl-C
        code = server.wait(60)
        log.seek(0)
        assert code == 0, f"exit {code} on Ctrl-C; its stderr: {log.read()[-3000:]}"
    finally:
        server.kill()
        server.wait(30)
    log.seek(0)


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The Quick start's `python -m easylm.llama.train`, run once to its end: (what it
    printed, the directory it ran in). Only the output directory differs from the README's
    command, and the run directory's name does not depend on it."""
    out = tmp_path_factory.mktemp("quick_start")
    train = subprocess.run([sys.executable, "-m", "easylm.llama.train",
                            f"--logger.output_dir={out}/runs"], env=newcomer_env(),
                           capture_output=True, text=True, timeout=1800, cwd=out)
    assert train.returncode == 0, train.stderr[-3000:]
    return train.stdout, out


def newcomer_env() -> dict:
    """This environment as a newcomer's shell has it: one CPU device, not the 8 virtual
    ones conftest.py makes for the sharding tests (the README shows a 1-device mesh), and
    XLA's defaults, not conftest.py's faster-compiling COMPILE_FLAGS (the README shows
    the losses of XLA's defaults)."""
    flags = re.sub(r"--xla_(force_host_platform_device_count|backend_optimization_level|"
                   r"cpu_use_fusion_emitters)=\w+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return {**os.environ, "PYTHONPATH": REPO, "XLA_FLAGS": flags}


def _numbers(line: str) -> str:
    """A printed line without what depends on the machine: the speed, the runs' directory."""
    line = re.sub(r"tokens/s [\d,.]+", "tokens/s N", line)
    return re.sub(r"\S*/(llama-[0-9a-f]{8})", r"RUNS/\1", line)


@pytest.mark.slow
def test_the_quick_start_prints_what_the_readme_shows(quick_start):
    """Every line the README shows of the run (losses, accuracy, directory, serve command)
    is what the command prints; only speeds and the home directory differ."""
    (shown,) = re.findall(r"(?ms)^```text\n(.*?)^```", section("Quick start"))[:1]
    printed = {_numbers(line) for line in quick_start[0].splitlines()}
    for line in shown.splitlines():
        if line == "..." or line.startswith("llama: "):  # ... and the machine-dependent MFU
            continue
        assert _numbers(line) in printed, (line, quick_start[0])
    header = next(line for line in shown.splitlines() if line.startswith("llama: "))
    assert header.split(" | no MFU")[0] in quick_start[0]


# The chat page's default temperature (easylm/serving/static/chat.html).
CHAT_PAGE_TEMPERATURE = 0.7
MARKERS = ("<|user|>", "<|assistant|>", "<|system|>", "<s>", "</s>")


@pytest.mark.slow
def test_the_quick_start_model_tells_a_story_when_asked(quick_start):
    """The demo's checkpoint, served by the command the trainer printed, answers a chat
    request for a story with one that starts at a word (not mid-word, as a model that
    never saw the chat template did: 'y a time, there was...') and ends on its own."""
    stdout, out = quick_start
    (command,) = [line.split(":", 1)[1].strip() for line in stdout.splitlines()
                  if line.startswith("serve it:")]
    argv = [sys.executable] + shlex.split(command)[1:] + ["--port=0"]
    corpus = open(os.path.join(REPO, "easylm", "data", "embedded", "corpus.jsonl")).read()
    words = set(re.findall(r"[A-Za-z]+", corpus))
    animals = ["cat", "dog", "duck", "cow", "frog", "owl", "pig", "bee", "horse", "mouse"]
    with serving(argv, newcomer_env(), out) as (ready, _):
        url = re.search(r"OpenAI API (\S+)", ready).group(1)
        replies = [httpx.post(url + "/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": f"Tell me a story about "
                                                     f"{'an' if a[0] in 'aeiou' else 'a'} {a}"}],
            "temperature": CHAT_PAGE_TEMPERATURE, "seed": i, "max_tokens": 200}).json()
            for i, a in enumerate(animals)]
    for reply in replies:
        choice = reply["choices"][0]
        text = choice["message"]["content"]
        first = re.match(r"[A-Z][a-z]*\b", text)
        assert first and first.group() in words, text
        assert not any(m in text for m in MARKERS), text
        assert choice["finish_reason"] == "stop", reply  # it ended its turn with EOS


@pytest.mark.slow
def test_hidden_modules_are_really_hidden():
    """The negative twin: what the Quick start does not install cannot be imported."""
    hidden = modules_not_installed_by(["pip install -e ."])
    assert "torch" in hidden and "fastapi" not in hidden and "jax" not in hidden
    assert "torch" not in modules_not_installed_by(["pip install -e .", "pip install torch"])
    probe = subprocess.run(
        [sys.executable, "-c", f"import sys\nfor n in {hidden!r}: sys.modules[n] = None\n"
                               f"import easylm.serving.server\nimport torch"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe.stderr
    assert probe.stderr.rstrip().endswith("import of torch halted; None in sys.modules")


def snippets(text: str) -> list[str]:
    """Each logical line of the fenced blocks (continuations joined) and each inline span."""
    out = []
    for block in re.findall(r"(?ms)^```\w*\n(.*?)^```", text):
        out += block.replace("\\\n", " ").splitlines()
    out += re.findall(r"`([^`\n]+)`", re.sub(r"(?ms)^```.*?^```", "", text))
    return out


def named_commands_and_flags(text: str):
    """(module or None, flags) for each snippet that runs easylm or names flags alone;
    snippets that run other programs (pip, lm_eval, apt-get) are not ours to check."""
    for snippet in snippets(text):
        flags = lambda s: re.findall(r"(?<![\w-])--([A-Za-z_][\w.]*)", s)
        match = re.search(r"python -m ([\w.]+)(.*)", snippet)
        if match:
            yield match.group(1), flags(match.group(2))
        elif snippet.lstrip().startswith("--"):
            yield None, flags(snippet)


def help_text(module: str) -> str:
    """--help and --helpfull: the common flags, and every other."""
    out = io.StringIO()
    for option in ("--help", "--helpfull"):
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
            importlib.import_module(module).main([f"python -m {module}", option])
            raise SystemExit(0)  # a main that printed its usage and returned
        assert exit_info.value.code in (0, None), f"python -m {module} {option} failed"
    return out.getvalue()


def test_the_readme_is_a_newcomers_path():
    """A first hour's read: at most 200 lines, in the order a newcomer needs them (what it
    is, Quick start, one command per recipe, where the docs are, Tests); the detail lives
    in docs/, and every recipe's page is linked from it."""
    assert len(README.splitlines()) <= 200, len(README.splitlines())
    headings = re.findall(r"(?m)^## (.*)$", re.sub(r"(?ms)^```.*?^```", "", README))
    assert headings == ["Quick start", "Recipes", "Documentation", "Tests",
                        "License and credits"], headings
    recipes = section("Recipes")
    for page in ("recipes", "data", "model", "lora", "preference", "rl", "evaluation",
                 "planning", "multihost"):
        assert f"](docs/{page}.md" in recipes, page


def test_every_command_and_flag_the_readme_names_exists():
    named = list(named_commands_and_flags(README + RECIPES))
    helps = {module: help_text(module) for module in {m for m, _ in named if m}}
    assert {"easylm.llama.train", "easylm.llama.serve", "easylm.data.preview"} <= set(helps)
    everywhere = "\n".join(helps.values())
    missing = []
    for module, flags in named:
        for flag in flags:
            if flag in ("help", "flagfile"):  # absl's own
                continue
            if f"--{flag}=" not in (helps[module] if module else everywhere):
                missing.append(f"{module or 'any command'}: --{flag}")
    assert not missing, missing
    # The negative twin: a misspelt flag is caught.
    assert "--train_dataset.json_dataset.pth=" not in helps["easylm.llama.train"]


def _anchors(path: str) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    headings = re.findall(r"(?m)^#+ (.*)$", re.sub(r"(?ms)^```.*?^```", "", open(path).read()))
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", ["README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(REPO, "docs")) if name.endswith(".md")))
def test_links_resolve(page):
    path = os.path.join(REPO, page)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", open(path).read()):
        if re.match(r"[a-z]+:", target):  # http(s): not fetched
            continue
        file, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(file):
            broken.append(target)
        elif anchor and file.endswith(".md") and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, broken


# What the README's first paragraph calls each config.json model_type a family reads.
MODEL_NAMES = {"llama": "LLaMA 1, 2, 3 and 3.2", "mistral": "Mistral", "qwen2": "Qwen2",
               "qwen3": "Qwen3", "gemma3_text": "Gemma 3", "gemma3": "Gemma 3",
               "gpt_oss": "gpt-oss", "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral",
               "qwen3_5_text": "Qwen3.5", "qwen3_5": "Qwen3.5", "deepseek_v3": "DeepSeek-V3",
               "qwen3_5_moe_text": "Qwen3.5-MoE", "qwen3_5_moe": "Qwen3.5-MoE",
               "qwen3_next": "Qwen3-Next", "glm4_moe": "GLM-4.5",
               "gemma4_text": "Gemma 4", "gemma4": "Gemma 4", "olmo3": "OLMo 3",
               "smollm3": "SmolLM3", "kimi_k25": "Kimi K2.5", "minimax_m2": "MiniMax-M2",
               "deepseek_v32": "DeepSeek-V3.2", "glm_moe_dsa": "GLM-5",
               "deepseek_v4": "DeepSeek-V4",
               "llama4_text": "Llama 4", "mistral4": "Mistral Small 4"}


def test_the_first_paragraph_names_every_model_easylm_reads():
    """Every model_type a registered family reads is named in the README's opening
    paragraph, and nothing else is: 4280dbe said "LLaMA-family models (LLaMA 1, 2, 3 and
    3.2)" with Mistral, Qwen2/3 and Gemma 3 supported. A family added to the registry fails
    here until the README (and MODEL_NAMES) name it."""
    from easylm.models import registry

    read = {t for name in registry.FAMILIES for t in registry.get(name).hf.model_types}
    assert read == set(MODEL_NAMES)
    opening = " ".join(README.split("\n\n")[1].split())
    for model_type, words in MODEL_NAMES.items():
        assert words in opening, (model_type, opening)
