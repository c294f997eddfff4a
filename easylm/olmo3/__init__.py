"""OLMo 3 (`olmo3`): `easylm.olmo3.family.FAMILY`."""
