"""LoRA on the image-text families (qwen3_5_vl, gemma4_vl): a PEFT directory written by
easylm (transformers' module names, `model.language_model.layers...`,
`model.visual.merger...`, `model.embed_vision...`), loaded by peft onto transformers'
model, gives the merged model's log-probabilities on an image chat. In CI: adapters drawn
at random (B too) and written by `Adapters.save_peft`, merged by `LoraModel.merge`. Extended:
adapters trained on image chats by `python -m easylm.train --lora.rank=4`, exported by
`convert_easylm_to_hf --lora_mode=adapter` and `--lora_mode=merged`.

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
def test_peft_adapter_equals_the_merged_model(family, tmp_path):
    """Random adapters (B drawn too) written as a PEFT directory = the same adapters
    merged, on an image chat; read back, the PEFT directory gives the adapters again."""
    import jax
    from peft import PeftModel

    from easylm.models import registry
    from easylm.models.family import torch_reference
    from easylm.variants.adapters import Adapters
    from easylm.variants.lora import LoraConfig

    module, rel, size, _ = FAMILIES[family]
    hf = module.saved_checkpoint(tmp_path)
    owner = registry.get(family)
    config = owner.hf.read_config(hf[0]).replace(train_vision="projector")
    adapters = Adapters(owner)
    lm = adapters.lora_model(config, LoraConfig(rank=4, base_dtype="fp32"))
    draw = np.random.RandomState(0)  # on the host: an eager op a leaf would compile each
    drawn = jax.tree.map(lambda x: draw.normal(0, 0.1, x.shape).astype(np.float32),
                         lm.adapter_shapes)
    adapters.save_peft(str(tmp_path / "adapter"), lm, drawn, config)
    projector = {"qwen3_5_vl": "model.visual.merger.linear_fc1",
                 "gemma4_vl": "model.embed_vision.embedding_projection"}[family]
    targets = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert projector in targets["target_modules"]  # the tower's blocks have none:
    assert not any("blocks" in t or "vision_tower" in t for t in targets["target_modules"])
    _, back = adapters.load_peft(str(tmp_path / "adapter"), config)
    jax.tree.map(np.testing.assert_array_equal, back, drawn)

    params = owner.hf.read_params(hf[0], config)
    merged = torch_reference(owner, config, jax.device_get(lm.merge(lm.store_base(params),
                                                                    drawn)))
    inputs = module.transformers_inputs(hf, module.picture(0, *size))
    expected = logprobs(merged, inputs)
    adapted = PeftModel.from_pretrained(hf[1], str(tmp_path / "adapter")).eval()
    assert_close(logprobs(adapted, inputs), expected, rel)
    with adapted.disable_adapter():  # negative twin: the base alone misses it
        assert_differs(logprobs(adapted, inputs), expected, rel)


@pytest.mark.extended
@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_adapter_equals_the_merged_export(family, tmp_path):
    """Through the commands: train adapters on an image chat, export both ways."""
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
