"""DeepSeek-V3.2 (`deepseek_v32`): `easylm.deepseek_v32.family.FAMILY`."""
