"""`python -m easylm.llama.serve`: loading params:: and hf:: checkpoints, flags, user errors."""

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from serving_utils import log_softmax, make_tokenizer, tiny_config
from transformers import LlamaForCausalLM as HFLlama

from easylm import flags as flag_lib
from easylm.errors import UserError
from easylm.llama.family import FAMILY
from easylm.llama.model import LLaMAForCausalLM
from easylm.runtime import checkpoint
from easylm.serving import cli as serving_cli

ENV = {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS", "HF_HUB_OFFLINE", "WANDB_MODE")}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer().save_pretrained(directory)
    return directory


def greedy_text(tokenizer, model, params, prompt, steps, eos):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(log_softmax(model, params, ids)[-1])))
        if ids[-1] == eos:
            ids.pop()
            break
    return tokenizer.decode(ids[len(prompt):], skip_special_tokens=True)


def parse(argv):
    return flag_lib.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY), ["serve"] + argv)


@pytest.mark.slow
def test_serves_a_trained_checkpoint(tmp_path, tokenizer_dir):
    """A checkpoint that records its model config (as the trainer's and the converter's
    do) serves with that shape, not the preset's."""
    config = tiny_config(hidden_size=32, intermediate_size=64)  # not the debug preset's shape
    model = LLaMAForCausalLM(config)
    params = jax.jit(model.init_params)(jax.random.PRNGKey(3))
    directory = checkpoint.save_params(str(tmp_path / "ckpt"), params,
                                       {"model": "llama", "llama_config": config.to_dict()})
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "easylm.llama.serve", f"--load_checkpoint=params::{directory}",
         f"--tokenizer={tokenizer_dir}", f"--port={port}", "--seq_length=64", "--batch_size=2",
         "--decode_steps=4", "--min_bucket=64", "--pre_compile", "--api_key=k"],
        env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # bounded: at most ~5 minutes on a loaded machine
            if process.poll() is not None:
                break
            try:
                if httpx.get(url + "/health", headers={"Authorization": "Bearer k"}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        log.seek(0)
        assert process.poll() is None, log.read()
        prompt = [1, 40, 41, 42]
        response = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"},
                              json={"prompt": prompt, "max_tokens": 10, "temperature": 0},
                              timeout=120).json()
        tokenizer = make_tokenizer()
        expected = greedy_text(tokenizer, model, params, prompt, 10, tokenizer.eos_token_id)
        assert response["choices"][0]["text"] == expected
        log.seek(0)
        # --pre_compile: the warm-up's one line (its programs: one prompt bucket, one window).
        assert re.search(r"compiled \d+ programs in [\d.]+s: prefill and score of prompt "
                         r"lengths \[64\]", log.read())
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def test_serves_a_hugging_face_directory_like_hf_generate(tmp_path, tokenizer_dir):
    config = tiny_config()
    torch.manual_seed(0)
    hf = HFLlama(config.to_hf_config()).eval()
    hf.save_pretrained(tmp_path / "hf")
    app, batcher = serving_cli.build(FAMILY, parse([f"--load_checkpoint=hf::{tmp_path / 'hf'}",
                                      f"--tokenizer={tokenizer_dir}", "--seq_length=64",
                                      "--batch_size=2", "--mesh_dim=1,-1,1"]))
    try:
        prompt = [1, 7, 8, 9, 10]
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        # A loopback Host: the server answers no other on a loopback bind.
        response = TestClient(app, base_url="http://127.0.0.1").post("/v1/completions",
                                                                     json=body).json()
    finally:
        batcher.stop()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0]
    ids = out[len(prompt):].tolist()
    ids = ids[:ids.index(config.eos_token_id)] if config.eos_token_id in ids else ids
    assert response["choices"][0]["text"] == make_tokenizer().decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("argv,message", [
    (["--tokenizer=/nonexistent/tok"], "tokenizer '/nonexistent/tok' does not exist"),
    (["--seq_length=1024"], "--seq_length=1024 is above the model's max_position_embeddings=512"),
    (["--load_checkpoint=nope::/x"], "unknown prefix 'nope'"),
    (["--batch_size=0"], "--batch_size must be >= 1, got 0"),
    (["--chat_template=/nonexistent.jinja"], "--chat_template='/nonexistent.jinja': cannot read it"),
])
def test_bad_flags_are_one_line_errors(argv, message, tokenizer_dir):
    argv = argv if any(a.startswith("--tokenizer") for a in argv) else argv + [f"--tokenizer={tokenizer_dir}"]
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        serving_cli.build(FAMILY, parse(argv))


@pytest.mark.slow
def test_cli_user_error_exits_2_without_traceback():
    result = subprocess.run([sys.executable, "-m", "easylm.llama.serve", "--port=notaport"],
                            env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(serving_cli, "build", lambda family, config: pytest.fail("loaded the model first"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            serving_cli.main(FAMILY, ["serve", f"--port={port}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --host=127.0.0.1 --port={port}: cannot listen there (Address already in use); "
        f"is another server running? pick another --port\n")


def test_ready_line_says_where_and_what():
    from types import SimpleNamespace

    from easylm.serving import server as server_lib

    engine = SimpleNamespace(params={"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32)},
                             seq_length=512, batch_size=8)
    config = server_lib.get_default_config({"model_name": "tiny", "api_key": "k"})
    line = server_lib.ready_line(config, SimpleNamespace(engine=engine), 5007)
    assert line == ("ready: chat page http://127.0.0.1:5007/ | OpenAI API http://127.0.0.1:5007/v1 | "
                    "model 'tiny': 17 parameters, float32, context 512 tokens, 8 batch slots | "
                    "API key required")
    config = server_lib.get_default_config({"host": "0.0.0.0"})
    line = server_lib.ready_line(config, SimpleNamespace(engine=engine), 80)
    assert line.startswith(f"ready: chat page http://{socket.gethostname()}:80/ |")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE_AND_LIST_MODULES = """
import sys
from easylm import flags as flag_lib
from easylm.models import registry
from easylm.serving import cli
family, argv = registry.from_argv(["serve", *sys.argv[1:]], detect=True)
app, batcher = cli.build(family, flag_lib.parse(cli.default_config(family),
                                                cli.help_entries(family), argv))
batcher.stop()
if family.name == "twin":  # the negative twin: a serve process that loads the trainer
    import easylm.training.trainer
print(" ".join(sorted(m for m in sys.modules if m.startswith(("easylm.objectives",
                                                              "easylm.training")))))
"""


def test_a_serve_process_imports_no_training_code(tmp_path, tokenizer_dir):
    # STYLE.md: serving loads no training code (objectives: GRPO's rollouts, rewards; the
    # trainer). What `python -m easylm.serve --load_checkpoint=hf::DIR` imports, made to
    # stop after building the server.
    torch.manual_seed(0)
    HFLlama(tiny_config().to_hf_config()).save_pretrained(tmp_path / "hf")
    argv = [f"--load_checkpoint=hf::{tmp_path / 'hf'}", f"--tokenizer={tokenizer_dir}",
            "--seq_length=32", "--batch_size=1", "--pre_compile=False"]
    run = subprocess.run([sys.executable, "-c", SERVE_AND_LIST_MODULES, *argv],
                         capture_output=True, text=True, env={**os.environ, **ENV}, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [], run.stdout
    # The negative twin: a process that does load the trainer is seen to.
    twin = SERVE_AND_LIST_MODULES.replace('family.name == "twin"', "True")
    run = subprocess.run([sys.executable, "-c", twin, *argv], capture_output=True, text=True,
                         env={**os.environ, **ENV}, timeout=300)
    assert "easylm.training.trainer" in run.stdout.split(), run.stderr
