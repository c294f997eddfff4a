"""The dataset flags: an option of a block the selected type does not read is refused
(it would be ignored), and the trainer's derived defaults never trip that check."""

import pytest
from data_utils import tokenizer  # noqa: F401 (a fixture)

from easylm.data import DatasetFactory
from easylm.data.options import TYPES, loader_options
from easylm.errors import UserError


def test_an_option_of_a_block_the_type_does_not_read_is_refused(tokenizer):
    cfg = DatasetFactory.get_default_config({"type": "cache",
                                             "json_dataset": {"seq_length": 128}})
    with pytest.raises(UserError) as e:   # before the (missing) cache is opened
        DatasetFactory.load_dataset(cfg, tokenizer, process_index=0, process_count=1)
    assert str(e.value) == ("--train_dataset.json_dataset.seq_length is set but "
                            "--train_dataset.type=cache reads --train_dataset.cache.*")
    cfg = DatasetFactory.get_default_config({"mixture": {"sources": "mix.json"}})
    with pytest.raises(UserError) as e:
        DatasetFactory.load_dataset(cfg, tokenizer, for_eval=True, process_index=0,
                                    process_count=1)
    assert str(e.value) == ("--eval_dataset.mixture.sources is set but "
                            "--eval_dataset.type=json reads --eval_dataset.json_dataset.*")


def test_the_blocks_own_options_and_those_of_every_type_are_read():
    cfg = DatasetFactory.get_default_config({
        "type": "cache", "cache": {"seq_length": 128, "path": "c"},
        "text_processor": {"fields": "[prompt],answer"}, "preference": {"enabled": True}})
    assert loader_options(cfg) is cfg.cache
    with pytest.raises(UserError, match=r"^unknown dataset type 'csv'; expected json, "):
        loader_options(DatasetFactory.get_default_config({"type": "csv"}))


@pytest.mark.parametrize("kind", list(TYPES))
def test_the_trainers_derived_defaults_change_only_the_block_the_type_reads(kind):
    from easylm.llama import train

    block = TYPES[kind]
    data = ["--train_dataset.json_dataset.path=data.jsonl"] if kind == "json" else []  # no demo
    # debug's 512 positions shorten the rows; the eval rows follow the train rows.
    config = train.parse_flags(["train", "--llama.base_model=debug", "--objective=dpo", *data,
                                f"--train_dataset.type={kind}", f"--eval_dataset.type={kind}",
                                f"--train_dataset.{block}.batch_size=4"])
    for section in ("train_dataset", "eval_dataset"):
        options = loader_options(config[section], section)
        assert (options.seq_length, options.batch_size) == (512, 4)
    # The demo (no data, no checkpoint) sets its rows on json_dataset, the block it reads.
    demo = train.parse_flags(["train"]).train_dataset
    assert loader_options(demo).seq_length == 256
