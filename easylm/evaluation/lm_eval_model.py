"""lm-eval's `--model easylm`, for any model family: importing this module registers it.

    import lm_eval
    import easylm.evaluation.lm_eval_model  # noqa: F401
    lm_eval.simple_evaluate(model="easylm", tasks=["hellaswag"], model_args={
        "load_checkpoint": "hf::DIR", "tokenizer": "DIR", "seq_length": 2048})

model_args are `python -m easylm.eval`'s model flags, without the dashes (load_checkpoint,
tokenizer, dtype, mesh_dim, batch_size, seq_length, <family>.*, ...), and `family`: the
family whose model it is, by default the one the checkpoint is (`hf::DIR`'s config.json
model_type, an easylm checkpoint's metadata), else llama.
"""

from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from easylm import flags as flag_lib
from easylm.errors import UserError
from easylm.evaluation import cli
from easylm.evaluation.harness import HarnessLM
from easylm.models import registry


@register_model("easylm")
class EasyLMHarnessLM(HarnessLM):
    """A `HarnessLM` over a checkpoint of any family, made from lm-eval's model_args."""

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        args = dict(arg_dict)
        batch_size = (additional_config or {}).get("batch_size")
        if batch_size is not None:  # simple_evaluate's own batch_size argument
            if not str(batch_size).isdigit():
                raise UserError(f"batch_size={batch_size!r}: easylm needs a number of rows")
            args.setdefault("batch_size", int(batch_size))
        argv = [f"--{key}={value}" for key, value in args.items()]
        family, argv = registry.from_argv(argv, detect=True)
        config = flag_lib.parse(cli.model_config(family), cli.help_entries(family),
                                ["easylm"] + argv)
        return cli.load(family, config, cls)
