"""Show what the model will be trained on, before training on it.

    python -m easylm.data.preview --tokenizer=embedded \\
        --train_dataset.json_dataset.path=sft.jsonl \\
        --train_dataset.text_processor.fields='[prompt],answer'

prints the first documents as text with the spans that get no loss inside [[ ]], then
token and loss statistics over the first batches (all processes' rows). Token caches
(--train_dataset.type=cache) and mixtures (type=mixture, each document labelled with its
source, and per-source counts) preview the same way; preference pairs
(--train_dataset.preference.enabled=True) show both sides of each pair, and count the
pairs truncated to seq_length; GRPO's prompts (--completion_tokens=N, the run's
--grpo.max_new_tokens) show each prompt as the sampler gets it, with the fields that go
to the rewards, and count the prompts too long for the row. With the run's --grpo.tools
(or --grpo.environment) a prompt is shown as its first episode starts: the environment's
reset() messages rendered by the chat template, with the tools' schemas. Chats with
images (an image-text model's: --family=qwen3_5_vl --load_checkpoint=hf::DIR, whose image
processor reads them) show each image's run of placeholder tokens as one marker with its
token count, and count the images and image tokens of the batches.
"""

import sys

from ml_collections import ConfigDict

from easylm import flags
from easylm.data.dataset import DatasetFactory
from easylm.data.image_chats import image_runs
from easylm.data.images import image_chat_reader
from easylm.data.options import loader_block
from easylm.data.pairs import SIDES, render_pair
from easylm.data.reader import prepare_records
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError, exit_on_user_error
from easylm.runtime import run_flags

USAGE = "usage: python -m easylm.data.preview [--train_dataset.*=...] [--tokenizer=...]"
HELP = {
    "tokenizer": run_flags.help_text("tokenizer"),
    "num_examples": "documents to print",
    "num_batches": "batches to compute the statistics over",
    "completion_tokens": "> 0: the rows are GRPO's prompts (--objective=grpo), each leaving "
                         "this many tokens of its row for the completion: give the run's "
                         "--grpo.max_new_tokens",
    "family": "chats with images: the image-text model's family (e.g. qwen3_5_vl)",
    "load_checkpoint": "chats with images: the model's hf::DIR (its config.json and image "
                       "processor)",
    "grpo.tools": "the run's --grpo.tools (with --completion_tokens): each prompt shown as "
                  "its first episode starts, rendered with the tools' schemas",
    "grpo.environment": "the run's --grpo.environment (with --completion_tokens): each "
                        "prompt shown as its environment's reset() messages render",
    **{f"train_dataset.{k}": v for k, v in DatasetFactory.HELP.items()},
}


def default_config():
    config = ConfigDict()
    config.train_dataset = DatasetFactory.get_default_config()
    config.tokenizer = run_flags.DEFAULTS["tokenizer"]
    config.num_examples = 3
    config.num_batches = 8
    config.completion_tokens = 0
    config.family = ""
    config.load_checkpoint = ""
    config.grpo = ConfigDict({"tools": "", "environment": ""})
    return config


def render(tokenizer, tokens, masks):
    """Text of a document with the no-loss spans inside [[ ]]."""
    pieces, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or masks[end] != masks[start]:
            text = tokenizer.decode(tokens[start:end])
            pieces.append(text if masks[start] else f"[[{text}]]")
            start = end
    return "".join(pieces)


def render_image_chat(tokenizer, document, image_token_id: int) -> list[str]:
    """Preview lines of an image chat: each image's placeholder tokens one marker."""
    tokens, masks, _ = document
    pieces, start = [], 0
    runs = image_runs(tokens, image_token_id)
    for k, (begin, end) in enumerate(runs, 1):
        pieces += [render(tokenizer, tokens[start:begin], masks[start:begin]),
                   f"[[<image {k}: {end - begin} tokens>]]"]
        start = end
    pieces.append(render(tokenizer, tokens[start:], masks[start:]))
    return ["".join(pieces), f"({len(tokens)} tokens, {int(masks.sum())} with loss, "
                             f"{len(runs)} image(s))"]


def _examples(dataset, tokenizer, slots, records, documents, images=None) -> list[str]:
    """The first documents (or pairs) as the model sees them, loss masks marked."""
    lines = ["legend: [[text]] gets no loss", ""]
    for slot, record, document in zip(slots, records, documents):
        source = f" (source {dataset.mixture[record[2]]})" if dataset.mixture else ""
        lines.append(f"--- {'pair' if dataset.pairs else 'document'} {slot}{source}")
        if isinstance(document, tuple) and dataset.pairs:
            lines += render_pair(render, tokenizer, document)
        elif isinstance(document, tuple) and images is not None:
            lines += render_image_chat(tokenizer, document, images.image_token_id)
        elif isinstance(document, tuple):
            tokens, masks = document
            lines += [render(tokenizer, tokens, masks),
                      f"({len(tokens)} tokens, {int(masks.sum())} with loss)"]
        else:
            lines.append(f"(skipped: {document})" if document else "(blank line)")
        lines.append("")
    return lines


def _prompt_examples(tokenizer, slots, documents, episode) -> list[str]:
    """The first prompts as the sampler gets them (special tokens shown), each with the
    fields that travel with it to the reward functions."""
    lines = []
    for slot, document in zip(slots, documents):
        lines.append(f"--- prompt {slot}")
        if isinstance(document, tuple):
            ids, example = document
            ids = episode(example) if episode else ids
            fields = {k: v for k, v in example.items() if k not in ("prompt", "messages")}
            lines += [tokenizer.decode(ids),
                      f"({len(ids)} tokens; to the rewards: {fields or 'no other field'})"]
        else:
            lines.append(f"(skipped: {document})" if document else "(blank line)")
        lines.append("")
    return lines


def _skips_until(dataset, usable: int, window: int = 64) -> tuple[int, int]:
    """(examples read, examples skipped) in order until `usable` prompts, one pass at most:
    the loader reads ahead of its batches, so its own counter says more than they used."""
    total, read, skipped = dataset.order.num_documents, 0, 0
    while read - skipped < usable and (total is None or read < total):
        end = read + window if total is None else min(read + window, total)
        for document in prepare_records(dataset.order.read(list(range(read, end))),
                                        dataset.processor):
            if read - skipped == usable:
                break
            read += 1
            skipped += document is not None and not isinstance(document, tuple)
    return read, skipped


def _first_episode(config, grpo, tokenizer):
    """example -> the ids of its first episode's prompt, as the run's multi-turn rollouts
    render it (--grpo.tools / --grpo.environment), or None for single-turn prompts."""
    from easylm.data import conversations, environments  # tools' imports: only here

    loaded = environments.load(ConfigDict(dict(grpo, tool_timeout=0.0)))
    if loaded is None:
        return None
    factory, schemas = loaded
    flag = "--grpo.tools" if grpo.tools else "--grpo.environment"
    renderer = conversations.make_renderer(flag, config.text_processor.chat_template, tokenizer,
                                      schemas, tokenizer.eos_token_id)
    return lambda example: renderer.ids(list(factory().reset(dict(example))), True)


def preview_prompts(config, tokenizer, num_examples, num_batches, completion_tokens,
                    grpo=None):
    """GRPO's prompt rows: the first prompts, then their lengths over the first batches."""
    config = DatasetFactory.get_default_config(config)
    episode = _first_episode(config, grpo, tokenizer) if grpo else None
    dataset = DatasetFactory.load_dataset(config, tokenizer, process_index=0, process_count=1,
                                          prompts=completion_tokens)
    slots = list(range(min(num_examples, dataset.order.num_documents or num_examples)))
    lines = _prompt_examples(tokenizer, slots,
                             prepare_records(dataset.order.read(slots), dataset.processor),
                             episode)
    batches, lengths = 0, []
    for batch, _ in dataset:
        if batches == num_batches:
            break
        batches += 1
        if episode:
            lengths += [len(episode(example)) for n, example in
                        zip(batch["prompt_lengths"], batch["examples"]) if n]
        else:
            lengths += [int(n) for n in batch["prompt_lengths"] if n]
    dataset.close()
    read, skipped = _skips_until(dataset, len(lengths))
    room = dataset.seq_length - completion_tokens
    lines += [
        f"{batches} batches of {dataset.batch_size} prompts; a row is {dataset.seq_length} "
        f"tokens: the prompt (at most {room}) and up to {completion_tokens} completion tokens",
        f"prompts: {len(lengths)}, tokens per prompt: mean "
        f"{sum(lengths) / max(len(lengths), 1):.1f}, longest {max(lengths, default=0)}",
        f"prompts skipped: {skipped} of the first {read} examples",
    ]
    if episode:  # the lengths above are the rendered first episodes'
        lines.append(f"episode prompts that leave no room in the row (the rollout stops "
                     f"with an error there): {sum(n >= dataset.seq_length for n in lengths)}")
    return "\n".join(lines)


def preview(config, tokenizer, num_examples, num_batches, images=None):
    """`images`: an image-text model's reader of image chats (one a row, or packed with
    segment_ids=True)."""
    # Segment ids (they change nothing else) tell where documents start; pairs are not
    # packed, so each side starts one (its BOS).
    config = DatasetFactory.get_default_config(config)
    if images is not None and config.text_processor.chat:
        return preview_image_chats(config, tokenizer, num_examples, num_batches, images)
    if not config.preference.enabled:
        config[loader_block(config)].segment_ids = True
    dataset = DatasetFactory.load_dataset(config, tokenizer, process_index=0,
                                          process_count=1, pairs=True)
    slots = list(range(min(num_examples, dataset.order.num_documents or num_examples)))
    records = dataset.order.read(slots)
    documents = prepare_records(records, dataset.processor)
    lines = _examples(dataset, tokenizer, slots, records, documents)

    batches = targets = loss = starts = 0
    metrics = counted = {}
    prefixes = [f"{side}_" for side in SIDES] if dataset.pairs else [""]
    offsets = None if dataset.pairs else _row_offsets(dataset)
    for batch, metrics in dataset:
        if batches == num_batches:
            break
        batches += 1
        for prefix in prefixes:
            targets += batch[f"{prefix}target_tokens"].size
            loss += int(batch[f"{prefix}loss_masks"].sum())
        if dataset.pairs:
            starts += sum(int((batch[f"{p}input_tokens"] == tokenizer.bos_token_id).sum())
                          for p in prefixes)
        else:
            starts += _documents_started(batch["segment_ids"], offsets)
            offsets = _row_offsets(dataset)
        counted = metrics   # the counters as of the last batch counted
    dataset.close()
    shape = f"{dataset.batch_size} pairs of 2 x {dataset.seq_length}" if dataset.pairs else \
        f"{dataset.batch_size} x {dataset.seq_length}"
    lines += [
        f"{batches} batches of {shape} tokens",
        f"target tokens: {targets}, with loss: {loss} ({100 * loss / max(targets, 1):.1f}%)",
        f"{'sides' if dataset.pairs else 'documents'} started in inputs: {starts}",
        f"{'pairs' if dataset.pairs else 'documents'} skipped: "
        f"{counted.get('dataset_skipped_documents', 0)} (of those the batches read)",
        f"pipeline speed: {metrics.get('dataset_tokens_per_second', 0):.0f} tokens/s",
    ]
    if dataset.pairs:
        lines.append(f"pairs truncated to seq_length: {counted.get('dataset_truncated_pairs', 0)}")
        split = getattr(dataset.processor, "split_pairs", 0)
        lines.append(f"pairs whose prompt's last token merges with the response's: {split}")
    for name in dataset.mixture or ():
        tokens = counted.get(f"source/{name}/tokens", 0)
        lines.append(f"source {name}: {counted.get(f'source/{name}/documents', 0)} documents "
                     f"finished, {tokens} target tokens ({100 * tokens / max(targets, 1):.1f}%)")
    return "\n".join(lines)


def preview_image_chats(config, tokenizer, num_examples, num_batches, images):
    """The first image chats, then their tokens, images and image tokens over the first
    batches."""
    dataset = DatasetFactory.load_dataset(config, tokenizer, process_index=0,
                                          process_count=1, images=images)
    slots = list(range(min(num_examples, dataset.order.num_documents or num_examples)))
    records = dataset.order.read(slots)
    lines = _examples(dataset, tokenizer, slots, records,
                      prepare_records(records, dataset.processor), images)
    batches = targets = loss = pictures = image_tokens = chats = rows = 0
    metrics = {}
    for batch, metrics in dataset:
        if batches == num_batches:
            break
        batches += 1
        if "segment_ids" in batch:   # packed: the chats of each row
            chats += int(batch["segment_ids"].max(axis=1).sum())
            rows += int((batch["segment_ids"].max(axis=1) > 0).sum())
        targets += batch["target_tokens"].size
        loss += int(batch["loss_masks"].sum())
        pictures += int(batch["patch_segments"].max(axis=1).sum())
        image_tokens += int((batch["image_tokens"] >= 0).sum())
    dataset.close()
    return "\n".join(lines + [
        f"{batches} batches of {dataset.batch_size} x {dataset.seq_length} tokens, " +
        (f"packed: {chats} chats in {rows} rows" if dataset.kind.packed else
         "one chat a row (not packed)"),
        f"target tokens: {targets}, with loss: {loss} ({100 * loss / max(targets, 1):.1f}%)",
        f"images: {pictures}, image tokens: {image_tokens}",
        f"chats skipped: {metrics.get('dataset_skipped_documents', 0)} (of those the "
        f"batches read)",
    ])


def _row_offsets(dataset):
    """Where each row's next piece starts in its document: 0 at a document's first token."""
    streams = dataset.get_state_dict()["streams"]
    return [streams[str(r)][1] for r in range(dataset.batch_size)]


def _documents_started(segment_ids, offsets):
    """Documents whose first token is among the inputs: the pieces of each row (segments
    1..k, 0 being padding) but a first piece that continues the previous row's document.
    Counting BOS tokens instead counts every turn of a chat template that starts turns
    with it."""
    pieces = segment_ids.max(axis=1)
    return int(sum(k - (k > 0 and offset > 0) for k, offset in zip(pieces, offsets)))


@exit_on_user_error
def main(argv=None):
    argv = argv or sys.argv
    config = flags.parse(default_config(), HELP, argv, USAGE)
    if config.completion_tokens < 0:
        raise UserError(f"--completion_tokens must be >= 0, got {config.completion_tokens}")
    multi_turn = config.grpo.tools or config.grpo.environment
    if multi_turn and not config.completion_tokens:
        raise UserError("--grpo.tools and --grpo.environment preview GRPO's prompts: give "
                        "--completion_tokens (the run's --grpo.max_new_tokens) too")
    tokenizer = load_tokenizer(config.tokenizer)
    if config.completion_tokens > 0:
        print(preview_prompts(config.train_dataset, tokenizer, config.num_examples,
                              config.num_batches, config.completion_tokens,
                              config.grpo if multi_turn else None))
    else:
        print(preview(config.train_dataset, tokenizer, config.num_examples,
                      config.num_batches,
                      image_chat_reader(config.family, config.load_checkpoint,
                                        config.tokenizer)))


if __name__ == "__main__":
    main()
