import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from numerics import assert_close, forward_rel

from easylm.errors import UserError
from easylm.llama.config import LLaMAConfig
from easylm.llama.model import PARTITION_RULES, LLaMAForCausalLM
from easylm.models.decoder import stack_layers, unstack_layers
from easylm.runtime.sharding import (
    BATCH_AXES,
    hybrid_mesh_shape,
    init_sharded,
    check_batch_split,
    make_mesh,
    match_partition_rules,
    mesh_dim_string,
    mesh_string,
    named_shardings,
    parse_mesh_dim,
    path_to_string,
    rule_shardings,
)


def sizes(dp=1, fsdp=1, sp=1, ep=1, mp=1):
    return {"dp": dp, "fsdp": fsdp, "sp": sp, "ep": ep, "mp": mp}


def test_parse_mesh_dim():
    assert parse_mesh_dim("1,-1,1", 8) == sizes(fsdp=8)
    assert parse_mesh_dim("2,-1,2", 8) == sizes(dp=2, fsdp=2, mp=2)
    assert parse_mesh_dim("2,2,2", 8) == sizes(dp=2, fsdp=2, mp=2)


def test_named_mesh_dim():
    # Named sizes, in any order; axes not named are 1, one may be -1.
    assert parse_mesh_dim("dp=1,fsdp=2,ep=4", 8) == sizes(fsdp=2, ep=4)
    assert parse_mesh_dim("ep=2,fsdp=-1", 8) == sizes(fsdp=4, ep=2)
    assert parse_mesh_dim("fsdp=2,mp=2,ep=2", 8) == sizes(fsdp=2, ep=2, mp=2)
    assert parse_mesh_dim("fsdp=-1", 8) == parse_mesh_dim("1,-1,1", 8)
    assert parse_mesh_dim("dp=1,fsdp=2,sp=4", 8) == sizes(fsdp=2, sp=4)  # context parallel
    # The printed mesh and the flag written back are the old ones unless sp/ep split.
    assert mesh_string(sizes(fsdp=8)) == "dp=1 fsdp=8 mp=1"
    assert mesh_string(sizes(fsdp=2, ep=4)) == "dp=1 fsdp=2 ep=4 mp=1"
    assert mesh_dim_string(sizes(dp=2, fsdp=4)) == "2,4,1"
    assert mesh_dim_string(sizes(fsdp=2, ep=4)) == "fsdp=2,ep=4"


def test_expert_axis_splits_the_batch():
    mesh = make_mesh("fsdp=2,ep=4")
    assert mesh.axis_names == ("dp", "fsdp", "sp", "ep", "mp")
    assert dict(mesh.shape) == sizes(fsdp=2, ep=4)
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P(BATCH_AXES)))
    assert {s.data.shape for s in x.addressable_shards} == {(1, 4)}
    with pytest.raises(UserError, match=r"must be a multiple of the dp\*fsdp\*ep=8 batch shards"):
        check_batch_split(4, mesh.shape)
    check_batch_split(8, mesh.shape)


@pytest.mark.parametrize(
    "mesh_dim, message",
    [
        ("dp=1,fsdp=2,xp=4", "--mesh_dim='dp=1,fsdp=2,xp=4': unknown axis 'xp'; the axes are "
                             "dp,fsdp,sp,ep,mp"),
        ("fsdp=2,ep=2", "--mesh_dim='fsdp=2,ep=2': the product 4 does not match the 8 devices"),
        ("fsdp=3,ep=-1", "--mesh_dim='fsdp=3,ep=-1': the product of the given entries, 3, "
                         "does not divide the 8 devices"),
        ("ep=2,ep=4", "--mesh_dim='ep=2,ep=4': axis 'ep' is given twice"),
        ("ep=2,4", "--mesh_dim='ep=2,4': '4' has no '='; write every entry as axis=size or "
                   "give three bare numbers dp,fsdp,mp"),
        ("ep=two,fsdp=-1", "--mesh_dim='ep=two,fsdp=-1': the size of 'ep' must be an integer"),
    ],
)
def test_bad_named_mesh_dim(mesh_dim, message):
    with pytest.raises(UserError) as e:
        make_mesh(mesh_dim)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "mesh_dim, message",
    [
        ("3,-1,1", r"the product of the given entries, 3, does not divide the 8 devices"),
        ("2,2,1", r"the product 4 does not match the 8 devices"),
        ("1,8", r"has 2 entries; expected 3 \(dp,fsdp,mp\)"),
        ("a,1,1", r"must be comma-separated integers"),
        ("-1,-1,1", r"at most one -1"),
    ],
)
def test_bad_mesh_dim(mesh_dim, message):
    with pytest.raises(UserError, match=message):
        make_mesh(mesh_dim)


def test_hybrid_mesh_shape():
    # --dcn_mesh_dim splits the processes (TPU: slices), --mesh_dim the devices of each.
    assert hybrid_mesh_shape("1,-1,1", "2,1,1", 16, 2) == (sizes(fsdp=8), sizes(dp=2))
    assert hybrid_mesh_shape("1,4,2", "1,-1,1", 32, 4) == (sizes(fsdp=4, mp=2), sizes(fsdp=4))
    assert hybrid_mesh_shape("ep=8", "dp=2", 16, 2) == (sizes(ep=8), sizes(dp=2))


@pytest.mark.parametrize(
    "mesh_dim, dcn_mesh_dim, devices, granules, message",
    [
        ("1,-1,1", "3,1,1", 16, 2,
         "--dcn_mesh_dim='3,1,1': the product 3 does not match the 2 processes"),
        ("1,16,1", "2,1,1", 16, 2, "--mesh_dim='1,16,1': the product 16 does not match the "
                                   "8 devices per process (--dcn_mesh_dim is set)"),
        ("1,-1,1", "1,-1,1", 10, 3, "10 devices cannot be split evenly over 3 processes"),
    ],
)
def test_bad_hybrid_mesh(mesh_dim, dcn_mesh_dim, devices, granules, message):
    with pytest.raises(UserError) as e:
        hybrid_mesh_shape(mesh_dim, dcn_mesh_dim, devices, granules)
    assert str(e.value) == message


def test_hybrid_mesh_of_one_process_is_the_flat_mesh():
    # The two-process layout is tested in test_multihost.py.
    flat, hybrid = make_mesh("2,4,1"), make_mesh("2,4,1", dcn_mesh_dim="1,1,1")
    assert hybrid.shape == flat.shape and (hybrid.devices == flat.devices).all()
    with pytest.raises(UserError, match=r"^--dcn_mesh_dim='2,1,1': the product 2 does not "
                                        r"match the 1 processes$"):
        make_mesh("1,4,1", dcn_mesh_dim="2,1,1")


def test_unmatched_parameter_is_an_error():
    params = {"model": {"new_adapter": {"kernel": jnp.zeros((4, 4))}}}
    with pytest.raises(UserError, match=r"no partition rule matches parameter 'model/new_adapter/kernel' \(shape \(4, 4\)\)"):
        match_partition_rules(PARTITION_RULES, params)


def test_scalars_replicated_and_scanned_rules_get_a_layer_axis():
    shapes = {"step": jnp.zeros(()), "model": {"layers": {"mlp": {"down_proj": {"kernel": jnp.zeros((2, 8, 4))}}}}}
    specs = match_partition_rules(PARTITION_RULES, shapes)
    assert specs["step"] == P()
    assert specs["model"]["layers"]["mlp"]["down_proj"]["kernel"] == P(None, "mp", "fsdp")


def _loss_and_grads(model, params, ids):
    def loss_fn(params):
        logits = model.apply({"params": params}, ids).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    return jax.value_and_grad(loss_fn)(params)


@pytest.fixture(scope="module")
def single_device():
    config = LLaMAConfig.from_preset("debug", initializer_range=0.1)
    model = LLaMAForCausalLM(config)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (8, 16)))
    device = jax.devices()[0]
    params = jax.device_put(model.init_params(jax.random.PRNGKey(0)), device)
    loss, grads = jax.jit(_loss_and_grads, static_argnums=0)(model, params, jax.device_put(ids, device))
    logits_scale = float(jnp.abs(model.apply({"params": params}, ids)).max())
    return config, ids, loss, grads, logits_scale


@pytest.mark.parametrize("mesh_dim", ["8,1,1", "1,8,1", "1,1,8", "2,2,2", "fsdp=2,ep=4"])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_sharded_equals_single_device(single_device, mesh_dim, scan_layers):
    config, ids, loss, grads, logits_scale = single_device
    config = config.replace(scan_layers=scan_layers)
    model = LLaMAForCausalLM(config)
    mesh = make_mesh(mesh_dim)
    init = LLaMAForCausalLM(config.replace(scan_layers=False)).init_params
    if scan_layers:  # the same values as the single-device run, stacked
        init = lambda rng, init=init: stack_layers(init(rng))  # noqa: E731
    params = init_sharded(init, PARTITION_RULES, mesh, jax.random.PRNGKey(0))

    # Every parameter is created with the sharding its rule gives.
    specs = match_partition_rules(PARTITION_RULES, params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        spec = specs
        for key in path:
            spec = spec[key.key]
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)

    batch = jax.device_put(ids, NamedSharding(mesh, P(BATCH_AXES, None)))
    grad_shardings = named_shardings(mesh, specs)
    with jax.set_mesh(mesh):
        step = jax.jit(_loss_and_grads, static_argnums=0, out_shardings=(NamedSharding(mesh, P()), grad_shardings))
        loss2, grads2 = step(model, params, batch)
    if scan_layers:
        grads2 = unstack_layers(jax.device_get(grads2))
    # Sharded matmuls and the loss's mean add their partial sums in other orders: the loss
    # is within twice the largest logit error, gradients within the backward's depth.
    rel = forward_rel(config, ids.shape[1])
    assert abs(float(loss2) - float(loss)) <= 2 * rel * logits_scale
    for (path, g), g2 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(grads2)):
        assert_close(np.asarray(g2), np.asarray(g), 2 * rel, err_msg=path_to_string(path))


def test_parameters_are_never_whole_on_one_device():
    # fsdp=8: each device holds 1/8 of every matrix.
    model = LLaMAForCausalLM(LLaMAConfig.from_preset("debug"))
    params = init_sharded(model.init_params, PARTITION_RULES, make_mesh("1,8,1"), jax.random.PRNGKey(0))
    kernel = params["model"]["layers"]["0"]["mlp"]["up_proj"]["kernel"]
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(8, 128)}


def test_rule_shardings_refuse_a_dimension_the_mesh_cannot_split():
    mesh = make_mesh("1,4,2")
    shapes = {"params": {"lm_head": {"kernel": jax.ShapeDtypeStruct((32, 600), jnp.float32)}}}
    # a vocabulary mp=2 divides is placed as the rule table says
    sharding = rule_shardings(mesh, PARTITION_RULES, shapes)["params"]["lm_head"]["kernel"]
    assert sharding == named_shardings(mesh, match_partition_rules(
        PARTITION_RULES, shapes))["params"]["lm_head"]["kernel"]
    shapes["params"]["lm_head"]["kernel"] = jax.ShapeDtypeStruct((32, 601), jnp.float32)
    with pytest.raises(UserError, match=r"^parameter 'params/lm_head/kernel' of shape "
                       r"\(32, 601\) cannot be split over mp=2 of the mesh on its axis 1 "):
        rule_shardings(mesh, PARTITION_RULES, shapes)


def test_a_checkpoint_the_mesh_cannot_split_is_one_line_in_train_and_serve(tmp_path, capsys):
    """A vocabulary of 601 over mp=2: was JAX's IndivisibleError traceback while placing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from easylm import serve, train

    LlamaForCausalLM(LlamaConfig(
        vocab_size=601, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar
    data = tmp_path / "d.jsonl"
    data.write_text("".join('{"text": "row %d of words"}\n' % i for i in range(16)))
    common = [f"--load_checkpoint=hf::{tmp_path / 'hf'}", "--mesh_dim=1,4,2"]
    runs = [(serve.main, ["serve", *common, "--port=0"]),
            (train.main, ["train", *common, "--total_steps=1",
                          f"--train_dataset.json_dataset.path={data}",
                          "--train_dataset.json_dataset.seq_length=16",
                          "--train_dataset.json_dataset.batch_size=8",
                          f"--logger.output_dir={tmp_path / 'out'}"])]
    for main, argv in runs:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err  # train warns first that the tokenizer is embedded
        assert e.value.code == 2 and "Traceback" not in err
        assert "lm_head/kernel' of shape (32, 601) cannot be split over mp=2" in \
            err.splitlines()[-1]
