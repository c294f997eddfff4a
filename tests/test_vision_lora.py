"""LoRA on the image-text families (qwen3_5_vl, gemma4_vl) through the commands: adapters
trained on image chats by `python -m easylm.train --lora.rank=4`, exported by
`convert_easylm_to_hf --lora_mode=adapter` (a PEFT directory under transformers' module
names, `model.language_model.layers...`, `model.visual.merger...`,
`model.embed_vision...`) and `--lora_mode=merged`. The PEFT adapter loaded by peft onto
transformers' model gives the merged export's log-probabilities on an image chat.

With `train_vision=projector` the projector's kernels get adapters too (the vision
tower's do not): the PEFT file's names reach the vision side.

Tolerance: the two are transformers' forward of the same model, once with W + s A B
folded into each kernel (in fp32) and once with x W + s (x A) B: per matmul they differ by
rounding, about eps |x||W|, through the families' depth: the families' parity tolerances
(REL of test_vision_qwen3_5.py and test_vision_gemma4.py, derived there for these
models' log-probabilities against transformers).
"""

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from numerics import assert_close, assert_differs

import test_image_chats as qwen
import test_image_chats_gemma4 as gemma
import test_vision_gemma4
import test_vision_qwen3_5

FAMILIES = {  # family -> (its test module, the parity tolerance, a picture's (h, w), row)
    "qwen3_5_vl": (qwen, test_vision_qwen3_5.REL, (24, 16), qwen.T),
    "gemma4_vl": (gemma, test_vision_gemma4.REL, (16, 24), gemma.T),
}


def logprobs(model, inputs) -> np.ndarray:
    """Each next token's log-probability, in float64."""
    inputs = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs).logits[0, :-1].double()
    ids = inputs["input_ids"][0, 1:]
    return torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0].numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_adapter_equals_the_merged_export(family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from easylm import convert_easylm_to_hf as convert

    module, rel, size, length = FAMILIES[family]
    hf = module.saved_checkpoint(tmp_path)
    picture = module.picture(0, *size)
    data = qwen.write_data(tmp_path, [qwen.chat_row("a.png")], {"a.png": picture})
    losses = qwen.train(hf, data, tmp_path / "out", 2, "--save_model_freq=2",
                        "--lora.rank=4", f"--{family}.train_vision=projector",
                        family=family, length=length)
    assert losses[1] < losses[0], losses
    for mode in ("adapter", "merged"):
        with contextlib.redirect_stdout(io.StringIO()):
            convert.main(["convert", f"--load_checkpoint=params::{tmp_path}/out/run/checkpoints/2",
                          f"--output_dir={tmp_path / mode}", f"--lora_mode={mode}",
                          "--verify=False"])
    targets = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    projector = {"qwen3_5_vl": "model.visual.merger.linear_fc1",
                 "gemma4_vl": "model.embed_vision.embedding_projection"}[family]
    assert any(t.endswith(projector) or t == projector.rsplit(".", 1)[1]
               for t in targets["target_modules"]), targets["target_modules"]

    inputs = module.transformers_inputs(hf, picture)
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    base = AutoModelForImageTextToText.from_pretrained(hf[0]).eval()
    expected = logprobs(merged, inputs)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert_close(logprobs(adapted, inputs), expected, rel)
    with adapted.disable_adapter():  # negative twin: the base alone misses it
        assert_differs(logprobs(adapted, inputs), expected, rel)
