"""easylm/model_flags.py: a family's flags, help and entry points derived from what the
family declares (its config dataclass, its package), with nothing written per family."""

import dataclasses

import toy_family

from easylm import model_flags
from easylm.gemma.family import FAMILY as GEMMA
from easylm.llama.family import FAMILY as LLAMA
from easylm.models.config import ModelConfig

TOY = toy_family.FAMILY


def test_flags_and_help_come_from_the_config_fields():
    flags = model_flags.flag_config(TOY)
    fields = {f.name for f in dataclasses.fields(toy_family.ToyConfig)}
    assert set(flags) == fields | {"base_model"} and flags.base_model == "tiny"
    entries = model_flags.help_entries(TOY)
    # A family's own field has its own help; a shared one redeclared with `default()`
    # keeps the shared help (ModelConfig's), and takes the family's default.
    assert entries["toy.mlp_activation"].startswith("the MLP's gate activation")
    shared = ModelConfig.__dataclass_fields__["vocab_size"].metadata["help"]
    assert entries["toy.vocab_size"].startswith(shared) and shared
    assert toy_family.ToyConfig().vocab_size == 512 != ModelConfig().vocab_size


def test_a_preset_and_overrides_make_the_config():
    config = model_flags.flag_config(TOY, "wide")
    config.mlp_activation = "silu"
    made = model_flags.model_config(TOY, {"toy": config, "load_checkpoint": ""})
    assert (made.hidden_size, made.mlp_activation) == (64, "silu")


def test_the_commands_a_run_prints_are_ones_that_exist():
    # LLaMA keeps EasyLM's entry points; Gemma has its own train and serve but no eval
    # module, so eval is the generic command (which reads the family from the checkpoint);
    # a family outside the registry is named to the generic command.
    assert model_flags.command(LLAMA, "serve") == "python -m easylm.llama.serve"
    assert model_flags.command(LLAMA, "eval") == "python -m easylm.llama.eval"
    assert model_flags.command(GEMMA, "serve") == "python -m easylm.gemma.serve"
    assert model_flags.command(GEMMA, "eval") == "python -m easylm.eval"
    assert model_flags.command(TOY, "serve") == "python -m easylm.serve --family=toy_family:FAMILY"


def test_a_lora_flag_on_a_family_without_lora_is_the_line_that_says_so():
    """`--lora.rank=4` for a family that offers no LoRA (the toy family) names the family
    and why, in train, plan and bench, instead of absl's 'unknown flag'; a family with LoRA
    takes the same flag (the twin)."""
    import pytest

    from easylm.errors import UserError
    from easylm.training import options

    assert "lora" not in TOY.variants
    with pytest.raises(UserError) as error:
        options.parse_flags(TOY, ["train", "--lora.rank=4"])
    assert str(error.value) == ("--lora.rank: --family=toy does not offer LoRA as yet "
                                "(docs/lora.md names the families that do)")
    assert options.parse_flags(LLAMA, ["train", "--lora.rank=4"]).lora.rank == 4
