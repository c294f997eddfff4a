"""`python -m easylm.gemma.convert_hf_to_easylm --hf_model=DIR --output_dir=DIR`: the
generic converter (easylm/convert_hf_to_easylm.py) for the Gemma 3 family, by the name
EasyLM's scripts use."""

from easylm import convert_hf_to_easylm
from easylm.gemma.family import FAMILY


def main(argv=None):
    convert_hf_to_easylm.main(argv, FAMILY, "easylm.gemma")


if __name__ == "__main__":
    main()
