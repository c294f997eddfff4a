"""Gemma 3 (text): the second model family, behind `easylm.gemma.family.FAMILY`."""
