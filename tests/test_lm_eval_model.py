"""lm-eval's `--model easylm` (easylm/evaluation/lm_eval_model.py) for a family other than
LLaMA: made from model_args naming only an hf:: directory of a tiny random Gemma 3 (the
family read from its config.json), its loglikelihoods are transformers' log-probabilities
of the same tokens; the negative twin shows the comparison catches a scorer off by one
position (each token scored by the logits at its own position, not the one before)."""

import lm_eval.api.registry
import pytest
import torch
from gemma_utils import forward_rel, hf_model, tiny_config
from lm_eval.api.instance import Instance
from transformers import AutoTokenizer

import easylm.evaluation.lm_eval_model  # noqa: F401  (registers --model easylm)
from easylm.data.tokenizer import load_tokenizer

SEQ = 48
# Contexts longer than the debug window (8 tokens), so the sliding layers drop keys.
REQUESTS = [("Once upon a time there was a little girl who lived in a small house near",
             " the forest"),
            ("The cat sat on the mat and looked at the", " dog, who was very happy")]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma") / "hf"
    hf_model(tiny_config(num_hidden_layers=2)).save_pretrained(directory)
    load_tokenizer("embedded").save_pretrained(directory)
    return directory


def transformers_logprobs(model, tokenizer, context: str, continuation: str, late: int = 1):
    """(summed log-probability of the continuation's tokens, their count, max |logit|), split
    as lm-eval's `hf` backend splits them (the whole text encoded, the context's tokens cut
    off), each token scored by the logits `late` positions before it (1: right; 0: the
    negative twin's off-by-one)."""
    whole = tokenizer(context + continuation)["input_ids"]
    n = len(whole) - len(tokenizer(context)["input_ids"])
    ids = torch.tensor([whole])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    scored = torch.log_softmax(logits, -1)[len(whole) - n - late:len(whole) - late]
    logps = scored.gather(-1, ids[0, -n:, None])[:, 0]
    return float(logps.sum()), n, float(logits.abs().max())


def test_loglikelihood_on_a_gemma_directory_is_transformers(gemma_dir):
    cls = lm_eval.api.registry.get_model("easylm")
    lm = cls.create_from_arg_string(
        f"load_checkpoint=hf::{gemma_dir},tokenizer={gemma_dir},seq_length={SEQ},dtype=fp32",
        {"batch_size": 2, "max_batch_size": None, "device": None})
    assert lm.engine.model.name == "gemma"
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(REQUESTS)]
    ours = [logp for logp, _ in lm.loglikelihood(requests)]

    config = tiny_config(num_hidden_layers=2)
    model = hf_model(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    for (context, continuation), got in zip(REQUESTS, ours):
        expected, terms, scale = transformers_logprobs(model, tokenizer, context, continuation)
        # Each log-softmax moves by at most twice the largest logit error (fp32 forward:
        # tests/gemma_utils.py forward_rel), and `terms` of them add.
        tolerance = terms * 2 * forward_rel(config, SEQ) * scale
        assert abs(got - expected) <= tolerance, (got, expected, tolerance)
        # Negative twin: each token scored at its own position (an off-by-one a scorer can
        # make).
        shifted, _, _ = transformers_logprobs(model, tokenizer, context, continuation, late=0)
        assert abs(got - shifted) > tolerance, (got, shifted, tolerance)
