"""GLM-4.5 / GLM-4.6 (`glm4_moe`): `easylm.glm4_moe.family.FAMILY`."""
