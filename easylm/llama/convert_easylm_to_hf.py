"""`python -m easylm.llama.convert_easylm_to_hf --load_checkpoint=params::DIR --output_dir=DIR`:
the generic exporter (easylm/convert_easylm_to_hf.py) for the LLaMA family, by the name
EasyLM's scripts use."""

from easylm import convert_easylm_to_hf
from easylm.llama.family import FAMILY


def main(argv=None):
    convert_easylm_to_hf.main(argv, FAMILY, "easylm.llama")


if __name__ == "__main__":
    main()
