"""easylm.doctor in one process (8 CPU devices): the report, and one line per
problem with a non-zero exit. Several processes: tests/test_multihost.py."""

import os
import subprocess
import sys

import flax
import jax
import pytest

from easylm import doctor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_doctor(argv, capsys):
    with pytest.raises(SystemExit) as e:
        doctor.main(["doctor", *argv])
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def test_healthy_setup_exits_0(tmp_path, capsys):
    code, out, err = run_doctor([f"--logger.output_dir={tmp_path}/runs",
                                 f"--compilation_cache_dir={tmp_path}/cache"], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("python ")
    assert f"| jax {jax.__version__} | jaxlib " in lines[0]
    assert f"| flax {flax.__version__} |" in lines[0]
    # Every number from jax's own view of this process (conftest.py's 8 CPU devices),
    # the default mesh 1,-1,1 putting all of them on fsdp. Catches a doctor that counts
    # the local devices as all of them or resolves -1 against another count.
    n, processes, kind = jax.device_count(), jax.process_count(), jax.devices()[0].platform
    per_process = ", ".join(f"{p}: {sum(d.process_index == p for d in jax.devices())}"
                            for p in range(processes))
    assert lines[1:] == [
        f"backend {jax.default_backend()}: {n} {kind} device(s), {processes} process(es)",
        f"devices per process: {per_process}",
        f"all {processes} process(es) joined; a sum over all {n} devices is correct",
        f"mesh: dp=1 fsdp={n} mp=1 (--mesh_dim=1,-1,1)",
        f"compilation cache: {tmp_path}/cache (writable)",
        "no problems found",
    ]


# The numbers in each line from the flags given (the mesh's product, dp*fsdp = 2*2) and
# jax's device and process counts. Catches a product or shard count taken of other axes
# (dp only: 2; all three: 8) and a count of another scope.
N, P = jax.device_count(), jax.process_count()


@pytest.mark.parametrize("argv, problems", [
    (["--mesh_dim=3,1,1"], [f"--mesh_dim='3,1,1': the product {3 * 1 * 1} does not match the "
                            f"{N} devices"]),
    (["--mesh_dim=2,2,2", "--train_dataset.json_dataset.batch_size=6"],
     [f"--train_dataset batch size 6 must be a multiple of the dp*fsdp={2 * 2} batch shards "
      "times --optimizer.accumulate_gradient_steps=1"]),
    (["--dcn_mesh_dim=2,1,1", "--mesh_dim=1,4,1"],
     [f"--dcn_mesh_dim='2,1,1': the product {2 * 1 * 1} does not match the {P} processes"]),
    (["--mesh_dim=1,1,1", "--logger.output_dir=/proc/easylm-runs"],
     [f"--mesh_dim='1,1,1': the product {1 * 1 * 1} does not match the {N} devices",
      "--logger.output_dir: /proc is not writable (No such file or directory)"]),
    # What the trainer refuses at its start (rows over sp, experts over ep).
    (["--mesh_dim=dp=1,fsdp=2,sp=4", "--train_dataset.json_dataset.seq_length=60"],
     ["--train_dataset.json_dataset.seq_length=60 must be a multiple of 2*sp = 8 to split "
      "rows over --mesh_dim=dp=1,fsdp=2,sp=4"]),
    (["--llama.model_type=qwen3_moe", "--llama.num_experts=6",
      "--llama.moe_intermediate_size=32", "--mesh_dim=dp=1,fsdp=2,ep=4"],
     ["--llama.num_experts=6 experts cannot be split over ep=4 of --mesh_dim=dp=1,fsdp=2,"
      "ep=4: give a number of experts that ep divides, or another ep"]),
    (["--quantize=int8"], ["--quantize=int8 stores a served model's weights in int8 (serve, "
                           "eval, bench decode, plan --plan.serve_tokens); a trained model "
                           "cannot be: for adapters on an int8 base give --lora.rank=R "
                           "--lora.base_dtype=int8"]),
    (["--objective=grpo", "--grpo.tools=nosuchmodule:f",
      "--train_dataset.json_dataset.path=prompts.jsonl"],
     ["--grpo.tools=nosuchmodule:f: cannot import 'nosuchmodule' (ModuleNotFoundError: No "
      "module named 'nosuchmodule')"]),
])
def test_each_problem_is_one_line_and_exit_1(argv, problems, tmp_path, capsys):
    if not any(a.startswith("--logger.output_dir") for a in argv):
        argv = [*argv, f"--logger.output_dir={tmp_path}"]
    code, out, err = run_doctor(argv, capsys)
    assert code == 1
    assert err.splitlines() == [f"problem: {p}" for p in problems]
    assert "no problems found" not in out


@pytest.mark.slow
def test_unwritable_compilation_cache(tmp_path):
    # A subprocess: the cache directory is read when jax starts.
    result = subprocess.run(
        [sys.executable, "-m", "easylm.doctor", f"--logger.output_dir={tmp_path}",
         "--compilation_cache_dir=/proc/easylm-cache"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "problem: compilation cache: /proc is not writable (No such file or directory)")


def test_bad_flag_exits_2(capsys):
    code, _, err = run_doctor(["--mesh_dimm=1,8,1"], capsys)
    assert code == 2
    assert err == "error: Unknown command line flag 'mesh_dimm'. Did you mean: mesh_dim ?\n"


@pytest.fixture(scope="module")
def data_of_each_type(tmp_path_factory):
    from data_utils import dataset_flags_of_each_type

    from easylm.data.tokenizer import load_tokenizer

    return dataset_flags_of_each_type(tmp_path_factory.mktemp("data"), load_tokenizer("embedded"))


@pytest.mark.parametrize("kind", ["json", "huggingface", "cache", "mixture"])
def test_each_dataset_type_checks_its_own_batch_size(kind, data_of_each_type, tmp_path, capsys):
    block = {"json": "json_dataset", "huggingface": "huggingface_dataset"}.get(kind, kind)
    argv = [*data_of_each_type[kind], f"--logger.output_dir={tmp_path}",
            f"--compilation_cache_dir={tmp_path}/cache"]
    code, out, err = run_doctor(argv, capsys)
    assert (code, err) == (0, "") and out.splitlines()[-1] == "no problems found"
    # The batch size of the block the type reads is the one checked.
    code, _, err = run_doctor([*argv, f"--train_dataset.{block}.batch_size=6"], capsys)
    assert code == 1 and err == ("problem: --train_dataset batch size 6 must be a multiple of "
                                 "the dp*fsdp=8 batch shards times "
                                 "--optimizer.accumulate_gradient_steps=1\n"), err


def test_options_of_a_block_the_type_does_not_read_are_a_problem(data_of_each_type, tmp_path,
                                                                 capsys):
    code, _, err = run_doctor([*data_of_each_type["mixture"], f"--logger.output_dir={tmp_path}",
                               "--train_dataset.json_dataset.path=other.jsonl"], capsys)
    assert code == 1 and err == ("problem: --train_dataset.json_dataset.path is set but "
                                 "--train_dataset.type=mixture reads --train_dataset.mixture.*\n")


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    """A tiny Qwen3.5 image-text checkpoint's config.json and PIL image processor, saved by
    transformers (the doctor reads no weights)."""
    from transformers import Qwen2VLImageProcessorPil

    from easylm.qwen3_5.vision_hf import FAMILY

    directory = tmp_path_factory.mktemp("doctor_vl") / "hf"
    FAMILY.from_preset("debug").to_hf_config().save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2).save_pretrained(
        directory)
    return directory


def test_the_images_of_the_first_rows_are_read(qwen_vl, tmp_path, capsys):
    """Each missing or unreadable image of the first rows is one line naming file and row;
    rows past doctor.IMAGE_ROWS are not read; a checkpoint with no image processor says so."""
    import json

    from PIL import Image

    Image.new("RGB", (16, 24), (200, 30, 30)).save(tmp_path / "photo.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    chat = lambda image: json.dumps({"messages": [  # noqa: E731
        {"role": "user", "content": [{"type": "image", "image": image}]},
        {"role": "assistant", "content": "w1"}]}) + "\n"
    path = tmp_path / "chats.jsonl"
    rows = [chat("photo.png"), chat("missing.png"), chat("broken.png")]
    path.write_text("".join(rows + [chat("photo.png")] * (doctor.IMAGE_ROWS - 3)
                            + [chat("late.png")]))
    argv = ["--family=qwen3_5_vl", f"--load_checkpoint=hf::{qwen_vl}",
            f"--tokenizer={qwen_vl}", "--train_dataset.text_processor.chat=True",
            f"--train_dataset.json_dataset.path={path}", f"--logger.output_dir={tmp_path}"]
    code, _, err = run_doctor(argv, capsys)
    assert code == 1
    assert err.splitlines() == [
        f"problem: {path}:2: image {tmp_path}/missing.png: no such file",
        f"problem: {path}:3: image broken.png: cannot be read as an image (cannot identify "
        f"image file '{tmp_path}/broken.png')"]
    path.write_text(rows[0])
    assert run_doctor(argv, capsys)[0] == 0
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((qwen_vl / "config.json").read_text())
    code, _, err = run_doctor([*argv[:1], f"--load_checkpoint=hf::{tmp_path}/hf",
                               f"--tokenizer={tmp_path}/hf", *argv[3:]], capsys)
    assert code == 1 and "no preprocessor_config.json" in err and len(err.splitlines()) == 1
