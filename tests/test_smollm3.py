"""SmolLM3 (`smollm3`, the LLaMA family's variant with NoPE layers) against transformers'
SmolLM3ForCausalLM: a tiny random directory saved by transformers (fp32; every 2nd layer
without rotary, q/k/v/o and MLP biases, perturbed norms and biases) read through hf::DIR."""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, logprob_tolerance
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_parity

from easylm.errors import UserError
from easylm.llama import hf
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.llama.model import LLaMAForCausalLM

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300


def _save(directory):
    torch.manual_seed(0)
    config = transformers.SmolLM3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, no_rope_layer_interval=2, attention_bias=True, mlp_bias=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.SmolLM3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("smollm3"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_config_json_is_read_as_transformers_reads_it(saved):
    _, model, config, _ = saved
    assert (config.model_type, config.no_rope_layers) == ("smollm3", "1,3")
    assert config.layer_kinds() == ("full_attention", "no_rope") * 2
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert config.to_hf_config().no_rope_layers == [1, 0, 1, 0]
    with pytest.raises(UserError, match="slides SmolLM3's NoPE layers only"):
        LLaMAConfig.from_hf_config({"model_type": "smollm3", "use_sliding_window": True,
                                    "sliding_window": 8})
    with pytest.raises(UserError, match="no_rope_layers must list 0 or 1"):
        LLaMAConfig.from_hf_config({"model_type": "smollm3", "num_hidden_layers": 2,
                                    "no_rope_layers": [1, 2]})
    with pytest.raises(UserError, match="no_rope_layers='1' is not part of model_type 'llama'"):
        LLaMAConfig.from_preset("debug", no_rope_layers="1")


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The engine's log-probabilities of a 300-token prompt = transformers', per token;
    twin (a full forward, the same tolerance): the NoPE layers given rotary."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = logprob_tolerance(config, PROMPT, float(np.abs(logits).max()))
    served = hf_parity.served_logprobs(FAMILY.bind(config), params, prompt)
    assert_close(served, expected, rel=atol, scale=1.0)
    roped = LLaMAForCausalLM(config.replace(no_rope_layers=""))
    assert_differs(hf_parity.module_logprobs(roped, params, prompt), expected, rel=atol,
                   scale=1.0)


def test_served_greedy_tokens_equal_transformers_generate(saved):
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path, saved):
    from numerics import forward_rel

    directory, model, config, _ = saved
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path,
                                     forward_rel(config, 32), "SmolLM3ForCausalLM")


def test_export_loads_in_transformers_and_equals_served(tmp_path, saved):
    _, model, config, params = saved
    hf_parity.check_export(FAMILY, model, config, params, tmp_path, "SmolLM3ForCausalLM",
                           hf.load_hf_params)


def test_lora_adapter_loads_in_peft_and_equals_the_merged_export(tmp_path, saved):
    from numerics import forward_rel

    directory, _, config, params = saved
    hf_parity.check_lora_peft(FAMILY, directory, config, params, tmp_path,
                              forward_rel(config, 24), hf_parity.PROJECTIONS)


def test_the_released_shape_counts_as_its_card():
    """HuggingFaceTB/SmolLM3-3B: 3.08B parameters (tied), every 4th layer NoPE."""
    config = FAMILY.from_preset("smollm3_3b")
    assert config.num_parameters() == 3_075_098_624
    assert config.layer_kinds()[:4] == ("full_attention",) * 3 + ("no_rope",)
    # The planner's few layers keep the mix (its NoPE indices were out of range before).
    assert config.shard_variant(4, 2).layer_kinds() == ("full_attention",) * 3 + ("no_rope",)
