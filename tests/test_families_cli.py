"""The families of issue 58 through the commands, each from a tiny random directory saved
by transformers (the family's own test module's `_save`, one directory per family for the
module): hostile input is one `error:` line, exit status 2 and no traceback: a bad value
of the family's own field (in CI); marked `extended` (outside CI, its time budget): the
directory missing a weight, the server answering a prompt over its context with a JSON
400 and going on answering, and 2 bf16 training steps from the directory with a bf16
server scoring a prompt (a train compile per family, ~40-200 s each on two shared
cores)."""

import contextlib
import importlib
import io
import math
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file

from easylm import train
from easylm.models import registry
from easylm.serving import cli as serving_cli

# family directory: (module whose _save writes it, a bad value of one of its own fields,
# what the error line says)
CASES = {
    "deepseek_v32": ("test_sparse_attention", "--deepseek_v32.index_topk=0",
                     "--deepseek_v32.index_topk=0 must be >= 1"),
    "glm_moe_dsa": ("test_sparse_attention", "--glm_moe_dsa.index_n_heads=0",
                    "--glm_moe_dsa.index_n_heads=0 must be >= 1"),
    "llama4": ("test_llama4", "--llama4.attention_chunk_size=-3",
               "--llama4.attention_chunk_size=-3 must be >= 0"),
    "mistral4": ("test_mistral4", "--deepseek_v3.kv_lora_rank=0",
                 "--deepseek_v3.kv_lora_rank=0 must be >= 1"),
    "deepseek_v4": ("test_deepseek_v4", "--deepseek_v4.hc_mult=0",
                    "--deepseek_v4.hc_mult must be >= 1, got 0"),
    "minimax_m2": ("test_minimax_m2", "--minimax_m2.partial_rotary_factor=1.5",
                   "--minimax_m2.partial_rotary_factor=1.5 of head_dim=16 is 24 rotary dims"),
    "olmo3": ("test_olmo3", "--olmo3.sliding_window=-1",
              "--olmo3.sliding_window must be >= 1, got -1"),
    "smollm3": ("test_smollm3", "--llama.no_rope_layers=7",
                "--llama.no_rope_layers='7': a layer index"),
    "kimi_k25": ("test_kimi_k25", "--deepseek_v3.n_group=3",
                 "8 experts cannot form n_group=3 groups"),
}
RUN = ["--tokenizer=embedded", "--total_steps=2", "--log_freq=1", "--dtype=bf16",
       "--mesh_dim=1,1,-1", "--train_dataset.json_dataset.seq_length=32",
       "--train_dataset.json_dataset.batch_size=2", "--compilation_cache_dir=",
       "--save_model_freq=0"]


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """(name, its directory, a copy missing one of layer 1's tensors, that tensor's name)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    module = importlib.import_module(CASES[name][0])
    if module.__name__ == "test_sparse_attention":
        module._save(name, str(directory / "hf"))
    else:
        module._save(str(directory / "hf"))
    missing = directory / "missing"
    shutil.copytree(directory / "hf", missing)
    tensors = load_file(missing / "model.safetensors")
    dropped = sorted(k for k in tensors if ".layers.1." in k or ".blocks.1." in k)[0]
    del tensors[dropped]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    return name, directory / "hf", missing, dropped


def error_line(argv, capsys) -> str:
    """`python -m easylm.train ARGV` run in process, expecting a user error: exit status 2,
    no traceback, one `error:` line, the last (a note may come before it); its message."""
    with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(io.StringIO()):
        train.main(["train", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    lines = err.splitlines()
    assert lines[-1].startswith("error: ") and err.count("error: ") == 1, err
    return lines[-1][len("error: "):]


def test_a_bad_value_of_the_familys_own_field_is_one_line(saved, tmp_path, capsys):
    name, directory, _, _ = saved
    _, flag, message = CASES[name]
    assert message in error_line([f"--load_checkpoint=hf::{directory}", flag, *RUN,
                                  f"--logger.output_dir={tmp_path}"], capsys)


@pytest.mark.extended  # loads each directory (10-40 s a family here): CI runs the flags' check
def test_a_directory_missing_a_weight_is_one_line_naming_it(saved, tmp_path, capsys):
    name, _, missing, dropped = saved
    line = error_line([f"--load_checkpoint=hf::{missing}", *RUN,
                       f"--logger.output_dir={tmp_path}"], capsys)
    assert "is missing 1 tensor(s)" in line and dropped.rsplit(".", 1)[0].split(".")[-1] in line


def _server(name, directory, extra=()):
    """(a TestClient of `python -m easylm.serve` on the directory, its batcher), bf16, a
    context of 64; or the UserError the command refuses it with."""
    from fastapi.testclient import TestClient

    family = registry.get(registry.family_of(f"hf::{directory}"))
    argv = ["serve", f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
            "--seq_length=64", "--batch_size=1", "--dtype=bf16", "--mesh_dim=1,1,-1", *extra]
    app, batcher = serving_cli.build(family, serving_cli.parse_flags(family, argv))
    return TestClient(app, base_url="http://127.0.0.1"), batcher


@pytest.mark.extended  # loads and serves each directory: CI runs the flags' check
def test_the_server_answers_a_prompt_over_its_context_with_a_400(saved):
    """A prompt of 80 ids into a context of 64: a JSON 400 naming the length, and the
    server still answers (its health)."""
    name, directory, _, _ = saved
    client, batcher = _server(name, directory)
    try:
        response = client.post("/v1/completions", json={"prompt": list(range(3, 83)),
                                                        "max_tokens": 4})
        assert response.status_code == 400, response.text
        assert "seq_length" in response.json()["error"]["message"] or \
            "context" in response.json()["error"]["message"], response.text
        assert client.get("/health").status_code == 200
    finally:
        batcher.stop()


@pytest.mark.extended  # a train and a serve compile per family: 40-200 s each here
def test_bf16_training_and_scoring_through_the_commands(saved, tmp_path):
    """2 bf16 steps of `python -m easylm.train` from the directory log finite losses, and a
    bf16 server on the directory scores a prompt (echo, log-probabilities) finitely."""
    name, directory, _, _ = saved
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(["train", f"--load_checkpoint=hf::{directory}", *RUN,
                    f"--logger.output_dir={tmp_path}", "--logger.experiment_id=run"])
    losses = [float(line.split("| loss ")[1].split()[0])
              for line in out.getvalue().splitlines() if "| loss " in line]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out.getvalue()
    client, batcher = _server(name, directory)
    try:
        body = {"prompt": list(range(3, 23)), "max_tokens": 0, "echo": True, "logprobs": 1}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
        assert len(logprobs) == 19 and all(math.isfinite(x) for x in logprobs)
    finally:
        batcher.stop()
