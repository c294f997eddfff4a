"""GLM-5 / GLM-5.1 (`glm_moe_dsa`): `easylm.glm_moe_dsa.family.FAMILY`."""
