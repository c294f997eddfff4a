"""The llama4 family against transformers' Llama4ForCausalLM: a tiny random llama4_text
directory saved by transformers (fp32; a chunk of 16 below the 300-token prompt, layers 0
and 2 rotary and chunked, 1 and 3 NoPE with temperature tuning stepping every 8 positions,
experts on 0, 2, 3 and a dense MLP on 1, the routers scaled 5x) read through hf::DIR."""

import numpy as np
import pytest
from numerics import assert_close, assert_differs, fp32_rel
from serving_utils import assert_engine_greedy_equals_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_parity
import jax
import jax.numpy as jnp

from easylm.llama4 import hf
from easylm.llama4.family import FAMILY
from easylm.models import moe

V = 512  # the embedded tokenizer's, for the training run
PROMPT = 300


def _save(directory, initializer_range=0.2):
    torch.manual_seed(2)
    config = transformers.Llama4TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=24, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 2, 3],
        no_rope_layers=[1, 0, 1, 0], attention_chunk_size=16, floor_scale=8, attn_scale=0.5,
        max_position_embeddings=512, initializer_range=initializer_range, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        for i in (0, 2, 3):
            model.model.layers[i].feed_forward.router.weight.mul_(5.0)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama4"))
    model = _save(directory)
    config, params = hf.load_hf_params(directory)
    return directory, model, config, params


def _rel(config, terms=PROMPT):
    """Relative error of the logits: per layer 9 reductions in sequence (q/k/v, the q/k
    norm, scores, their weighted sum, o, the router, gate/up, down, the shared expert's
    sum) over at most max(D, keys) terms, then the head."""
    return fp32_rel(max(config.hidden_size, terms), 9 * config.num_hidden_layers + 1)


def _prompt(n=PROMPT, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, V, n)]


def test_config_json_is_read_as_transformers_reads_it(saved):
    from easylm.models import registry

    directory, model, config, _ = saved
    assert registry.family_of(f"hf::{directory}") == "llama4"
    assert FAMILY.module_class.layer_kinds(config) == ("rope_moe", "nope_dense", "rope_moe",
                                                       "nope_moe")
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    scout, maverick = FAMILY.from_preset("llama4_scout"), FAMILY.from_preset("llama4_maverick")
    assert round(maverick.num_parameters() / 1e9) == 401  # the card's 400B
    assert round(scout.num_matmul_parameters() / 1e9) == 16  # 17B active with the vision


def test_served_logprobs_of_a_long_prompt_match_transformers(saved):
    """The engine's log-probabilities of a 300-token prompt = transformers'; twins (full
    forwards, the same tolerance): the chunk ignored, rotary on the NoPE layers, no
    temperature tuning."""
    _, model, config, params = saved
    prompt = _prompt()
    expected, logits = hf_parity.reference_logprobs(model, prompt)
    atol = 2 * _rel(config) * float(np.abs(logits).max())
    # One expert a token: a router whose two best logits nearly tie would pick by roundoff
    # (seed 0's did, by 2e-5, at one token). This seed's closest call is far above it.
    _, sown = FAMILY.module_class(config).apply({"params": params}, jnp.asarray([prompt]),
                                                mutable=["router"])
    router = moe.router_stats(sown["router"]).logits
    best = jax.lax.top_k(router, 2)[0]
    closest = float((best[..., 0] - best[..., 1]).min())
    assert closest > 10 * _rel(config) * float(jnp.abs(router).max()), closest
    assert_close(hf_parity.served_logprobs(FAMILY.bind(config), params, prompt), expected,
                 rel=atol, scale=1.0)
    lm = FAMILY.module_class
    for twin in (dict(attention_chunk_size=0), dict(no_rope_layers=""),
                 dict(attn_temperature_tuning=False)):
        assert_differs(hf_parity.module_logprobs(lm(config.replace(**twin)), params, prompt),
                       expected, rel=atol, scale=1.0)


def test_served_greedy_tokens_equal_transformers_generate(saved):
    _, model, config, params = saved
    assert_engine_greedy_equals_generate(model, FAMILY.bind(config), params)


@pytest.mark.extended  # the backward compile: ~40-100 s on two shared cores
def test_gradients_are_transformers(saved):
    """The loss's gradient of a 40-token row = torch's backward through transformers, on
    the attention, the router and the experts (within the logits' relative error of each
    gradient's largest entry)."""
    _, model, config, params = saved
    ids = np.asarray([_prompt(40, 3)])
    lm = FAMILY.module_class(config)

    def loss(p):
        logp = jax.nn.log_softmax(lm.apply({"params": p}, jnp.asarray(ids[:, :-1])), -1)
        return -jnp.take_along_axis(logp, jnp.asarray(ids[:, 1:])[..., None], -1).mean()

    ours = jax.grad(loss)(params)["model"]["layers"]
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.tensor(ids[:, :-1])).logits[0],
                                      torch.tensor(ids[0, 1:])).backward()
    theirs = {name: p.grad.numpy() for name, p in model.named_parameters()}
    F = config.intermediate_size
    for mine, name, part in (
            (ours["0"]["self_attn"]["q_proj"]["kernel"], "0.self_attn.q_proj.weight", "T"),
            (ours["1"]["self_attn"]["k_proj"]["kernel"], "1.self_attn.k_proj.weight", "T"),
            (ours["0"]["feed_forward"]["router"]["kernel"], "0.feed_forward.router.weight", "T"),
            (ours["0"]["feed_forward"]["experts"]["up_proj"],
             "0.feed_forward.experts.gate_up_proj", "up"),
            (ours["3"]["feed_forward"]["experts"]["down_proj"],
             "3.feed_forward.experts.down_proj", "")):
        ref = theirs[f"model.layers.{name}"]
        ref = ref.T if part == "T" else ref[..., F:] if part == "up" else ref
        assert_close(np.asarray(mine), ref, _rel(config, 40), err_msg=name)


@pytest.mark.extended  # ~80 s on two cores
def test_training_through_the_command_starts_at_transformers_loss_and_exports(tmp_path):
    """At initializer_range 0.1: at 0.2 the third step's Adam update at lr 1e-2 overshoots
    (7.41, 7.36, 7.50), with gradients equal to transformers' (the test above)."""
    directory = str(tmp_path / "llama4")
    model = _save(directory, initializer_range=0.1)
    config = hf.load_hf_params(directory)[0]
    hf_parity.check_training_command(FAMILY, directory, model, tmp_path, _rel(config, 32),
                                     "Llama4ForCausalLM")


def test_export_loads_in_transformers_and_equals_served(tmp_path, saved):
    _, model, config, params = saved
    hf_parity.check_export(FAMILY, model, config, params, tmp_path, "Llama4ForCausalLM",
                           hf.load_hf_params)


@pytest.mark.extended  # two train runs' compiles and peft: ~3 min on two shared cores
def test_lora_through_the_command_exports_a_peft_adapter_equal_to_the_merged(tmp_path, saved,
                                                                          monkeypatch):
    """test_deepseek_v3's LoRA check on a Llama 4 directory: 2 steps of `python -m
    easylm.train --lora.*` on the attention, the dense and shared MLPs and the routed
    experts (stored input-first, (E, D, 2F), which PEFT's parameter wrapper reads as (E,
    out, in): A and B are written in each other's place); the PEFT adapter on transformers'
    base = the merged export, to test_deepseek_v3's tolerance over this model's 9 reductions
    a layer and the adapters' 2; twin: the base alone."""
    from test_deepseek_v3 import lora_logprobs

    directory, _, config, _ = saved
    targets = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)/kernel$|" \
              r"experts/(gate_up_proj|down_proj)$"
    before, peft, merged = lora_logprobs(
        tmp_path, directory, targets,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        monkeypatch)
    rel = 2 * fp32_rel(max(config.hidden_size, 40), 11 * config.num_hidden_layers + 1)
    scale = float(np.abs(merged).max())
    assert_close(peft, merged, rel, scale)
    assert_differs(before, merged, rel, scale)


def test_lora_adapters_as_peft_equal_ours_and_the_merged_export(tmp_path, saved):
    """Random adapters on every projection and the expert stacks (written transposed,
    `HFAdapter.experts_in_first`): PEFT's model on transformers' base = ours = the merged
    export, within the logits' tolerance; twin: PEFT with its adapters disabled."""
    directory, _, config, params = saved
    hf_parity.check_lora_peft(FAMILY, directory, config, params, tmp_path, _rel(config, 24),
                              hf_parity.PROJECTIONS)
