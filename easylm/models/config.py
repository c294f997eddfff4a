"""The config every family's model config derives from: what the generic code (the
decoder, the losses, the planner, the server, the converters) reads, declared once and typed.

A family's config subclasses `ModelConfig` (a frozen dataclass) and adds only its own
fields; where its default for a shared field differs (Gemma's vocabulary), it says so with
`default(value)`, which keeps the shared help:

    @dataclasses.dataclass(frozen=True)
    class GemmaConfig(ModelConfig):
        vocab_size: int = default(262208)
        query_pre_attn_scalar: float = field(256.0, "attention scores are scaled by ...")

Each field's help is in its metadata (`field(default, help)`); the command layer makes the
`--<family>.*` flags from them (easylm/model_flags.py). What a layer caches while decoding
is declared by the layer (`CausalLM.layer_cache`, easylm/models/decoder.py), not here.

What generic code reads of a family beyond the shared fields is declared here too, typed,
and each family fills it from its own fields: `section` (its flags' --<section>.*),
`attention_implementations` and `layer_type_choices` (what it allows), `routed_experts`
and `experts_per_token` (its mixture of experts; 0: dense), `layer_kinds()`,
`fixed_fields()` (shared fields its architecture sets) and `rotary_widths()`. The checks
every family shares run once, in `__post_init__` (`check_shared`).
"""

import dataclasses
import math
import os
from typing import Any, ClassVar

from easylm.errors import UserError
from easylm.models import remat, splash
from easylm.models.attention import ATTENTION_IMPLEMENTATIONS
from easylm.models.hf_checkpoint import read_config

# The layer kinds a `layer_types` field may name (HF's names): a family with that field
# allows some of them (`ModelConfig.layer_type_choices`).
LAYER_TYPES = ("sliding_attention", "full_attention", "linear_attention",
               "compressed_sparse_attention", "heavily_compressed_attention")  # DeepSeek-V4


def field(default, help_text: str):
    """A config field with its help (the flag's) beside it."""
    return dataclasses.field(default=default, metadata={"help": help_text})


def default(value):
    """A shared field redeclared with a family's own default; its help is the base config's
    (`ModelConfig`'s or a shared layer's config's; filled in by `ModelConfig.__init_subclass__`)."""
    return dataclasses.field(default=value, metadata={"help": None})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields and methods every family's config has. Counting methods are the
    family's (its layers are its own); the rest have defaults that fit a decoder whose
    layers are all alike."""

    # Shape.
    vocab_size: int = field(32000, "vocabulary size (rows of the embedding and the output "
                                   "projection); at least the tokenizer's")
    hidden_size: int = field(4096, "model width D")
    intermediate_size: int = field(11008, "MLP width F (gate, up and down projections)")
    num_hidden_layers: int = field(32, "decoder layers L")
    num_attention_heads: int = field(32, "query heads N")
    num_key_value_heads: int | None = field(
        None, "key/value heads K for grouped-query attention (a divisor of the query "
              "heads); unset: = num_attention_heads (multi-head)")
    head_dim: int | None = field(None, "width of one head H (even); unset: hidden_size // "
                                       "num_attention_heads")
    tie_word_embeddings: bool = field(False, "the output projection is the input embedding")
    # Numerics.
    max_position_embeddings: int = field(2048, "longest sequence the model takes (rows, the "
                                               "server's context)")
    rms_norm_eps: float = field(1e-6, "epsilon of the RMS norms")
    initializer_range: float = field(0.02, "standard deviation of the random initialisation")
    bos_token_id: int | None = field(1, "beginning-of-sequence token id")
    eos_token_id: int | None = field(2, "end-of-sequence token id (generation stops at it)")
    pad_token_id: int | None = field(None, "padding token id, carried to HF's config.json")
    # Implementation choices: none of these change the numbers.
    attention: str = field("auto", f"attention kernel: {', '.join(ATTENTION_IMPLEMENTATIONS)} "
                                   "(auto: cuDNN flash attention on GPU, Pallas splash "
                                   "attention on TPU, XLA elsewhere; dot_product: "
                                   "jax.nn.dot_product_attention)")
    scan_layers: bool = field(False, "run the layers as one jax.lax.scan (one compiled block "
                                     "of the layers' repeating pattern, faster compiles of "
                                     "deep models; parameters stacked; the same numbers)")
    remat_policy: str = field("none", "recompute activations in the backward pass to save "
                                      f"memory: {', '.join(remat.NAMES)} (least "
                                      "recomputation first)")
    loss_chunk_size: int = field(0, "training loss: logits for this many positions at a "
                                    "time, never all (B, T, V) at once (saves memory with "
                                    "large vocabularies); 0: all at once")

    # ------------------------------------------- declared for the generic code
    # The flags' section (--<section>.<field>): what every message about a field names.
    section: ClassVar[str] = "model"
    # The `attention` values this family computes (a subset of ATTENTION_IMPLEMENTATIONS).
    attention_implementations: ClassVar[tuple[str, ...]] = ATTENTION_IMPLEMENTATIONS
    # The field holding the routed-expert count (what `routed_experts` reads and a message
    # about it names, e.g. deepseek_v3's n_routed_experts), and the one holding the experts
    # each token takes; "" for a dense family.
    routed_experts_field: ClassVar[str] = ""
    experts_per_token_field: ClassVar[str] = ""
    # The kinds a family's `layer_types` field may list (LAYER_TYPES' names); () for a
    # family without that field.
    layer_type_choices: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A `default(value)` field keeps the shared help: filled in before @dataclass runs.
        for name, value in list(vars(cls).items()):
            if isinstance(value, dataclasses.Field) and value.metadata.get("help", "") is None:
                # Not yet a dataclass: the nearest base declaring the field has it.
                shared = next(base.__dataclass_fields__[name] for base in cls.__mro__[1:]
                              if name in getattr(base, "__dataclass_fields__", {})).metadata
                setattr(cls, name, dataclasses.field(default=value.default, metadata=shared))

    def __post_init__(self):
        for name, value in self.fixed_fields().items():
            given = getattr(self, name)
            if given is not None and given != value:
                raise UserError(f"--{self.section}.{name}={given}: this architecture sets it "
                                f"to {value}; leave it unset")
            object.__setattr__(self, name, value)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self.check_shared()

    def check_shared(self):
        """The checks every family's config shares, each a UserError naming the flag."""
        def fail(message):
            raise UserError(f"--{self.section}.{message}")

        for name, allowed in (("attention", self.attention_implementations),
                              ("remat_policy", remat.NAMES)):
            if getattr(self, name) not in allowed:
                fail(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.attention == "splash":  # the kernel's constraints (lengths are padded)
            splash.check_available("attention")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                fail(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_key_value_heads={self.num_key_value_heads} must divide "
                 f"num_attention_heads={self.num_attention_heads}")
        for name, width in self.rotary_widths().items():
            if width % 2:
                fail(f"{name}={width} must be even (rotary embeddings)")
        if self.layer_type_choices and self.layer_types:
            kinds = self.layer_types.split(",")
            if len(kinds) != self.num_hidden_layers or set(kinds) - set(self.layer_type_choices):
                fail(f"layer_types needs {self.num_hidden_layers} entries, each one of "
                     f"{', '.join(self.layer_type_choices)}; got {self.layer_types!r}")

    def fixed_fields(self) -> dict[str, Any]:
        """Shared fields this architecture sets from its own (DeepSeek-V3's latent cache:
        one key/value head of kv_lora_rank + qk_rope_head_dim): set here, and a flag that
        asks for another value is refused."""
        return {}

    def rotary_widths(self) -> dict[str, int]:
        """The widths rotary embeddings rotate, by the field that sets each (even)."""
        return {"head_dim": self.head_dim}

    # ----------------------------------------------------------------- values

    def replace(self, **changes):
        # The fields the architecture sets follow the changed ones.
        fixed = {name: None for name in self.fixed_fields() if name not in changes}
        return dataclasses.replace(self, **fixed, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    # ----------------------------------------------------------------- layers

    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind (HF's layer_types names); all alike unless a family says."""
        return ("full_attention",) * self.num_hidden_layers

    @property
    def routed_experts(self) -> int:
        """Routed experts E of each mixture-of-experts layer, 0 for a dense model: what
        expert parallelism (ep of --mesh_dim) splits. The family's `routed_experts_field`."""
        return getattr(self, self.routed_experts_field) if self.routed_experts_field else 0

    @property
    def experts_per_token(self) -> int:
        """Routed experts each token takes (K), 0 for a dense model."""
        return getattr(self, self.experts_per_token_field) if self.routed_experts else 0

    def lora_targets(self) -> str:
        """A regex of kernel paths a LoRA run adapts besides --lora.target_modules: the
        part of an image-text model's vision side its config trains ('': none)."""
        return ""

    def unfused(self):
        """This config computing each projection with its own matmul (what LoRA and int8
        wrap: qwix adapts the matmul that reads a module's own kernel); the same numbers."""
        return self

    def router_loss(self):
        """What training adds for the routers (`moe.RouterLoss`); None: no routers."""
        return None

    def indexer_loss_weight(self) -> float:
        """What training adds times the sparse attention indexers' KL loss (the mean over
        layers they sow, easylm/models/sparse_attention.py); 0: none."""
        return 0.0

    # --------------------------------------------------------------- counting

    def num_parameters(self) -> int:
        """Parameters of the model as built (an embedding tied to the head counted once)."""
        raise NotImplementedError

    def num_matmul_parameters(self) -> int:
        """N of the 6N training FLOPs a token: the parameters a token's matmuls read."""
        raise NotImplementedError

    def vision_parameters(self) -> int:
        """An image-text model's vision tower's parameters (in `num_parameters`); 0: text."""
        return 0

    def image_budget(self) -> tuple[int, int] | None:
        """An image-text model's (patches, image tokens) one row's images take at most
        (its max_image_patches, and the tokens they merge into); None: a text model."""
        return None

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token of rows of `seq_length`."""
        raise NotImplementedError

    def shard_variant(self, layers: int, mp: int):
        """This config with `layers` layers and the widths one of `mp` model-parallel
        shards holds (heads, MLP, vocabulary divided by mp): one device's activations, what
        the planner compiles. A config with `layer_types` keeps its mix in the `layers`."""
        fields = dict(num_hidden_layers=layers, head_dim=self.head_dim,
                      num_attention_heads=math.ceil(self.num_attention_heads / mp),
                      num_key_value_heads=math.ceil(self.num_key_value_heads / mp),
                      intermediate_size=math.ceil(self.intermediate_size / mp),
                      vocab_size=math.ceil(self.vocab_size / mp))
        if "layer_types" in self.field_names():
            kinds = self.layer_kinds()
            fields["layer_types"] = ",".join(kinds[i * len(kinds) // layers]
                                             for i in range(layers))
        return self.replace(**fields)

    # ---------------------------------------------------- HF transformers

    @classmethod
    def read_hf(cls, directory: str):
        """DIR/config.json as `from_hf_config` reads it (a family's HFAdapter.read_config)."""
        return cls.from_hf_config(read_config(directory), os.path.join(directory, "config.json"))

    @classmethod
    def from_hf_config(cls, hf: dict, path: str = "config.json"):
        """From config.json's fields, as transformers reads them; what this model would
        compute differently is a UserError naming `path` and the field."""
        raise UserError(f"{path}: {cls.__name__} cannot be read from a Hugging Face config")

    def to_hf_config(self):
        """The transformers config whose `save_pretrained` writes this model's config.json."""
        raise UserError(f"{type(self).__name__} has no Hugging Face counterpart")


def preset_config(config_class: type, presets: dict, name: str, family: str, **overrides):
    """`config_class` of preset `name` with `overrides`; unknown names are UserErrors."""
    if name not in presets:
        raise UserError(f"unknown {family} preset {name!r}; known presets: {', '.join(presets)}")
    unknown = set(overrides) - set(config_class.field_names())
    if unknown:
        raise UserError(f"unknown {family} config field(s): {', '.join(sorted(unknown))}")
    return config_class(**{**presets[name], **overrides})
