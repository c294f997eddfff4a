"""gpt-oss (OpenAI's open-weight MoE models): a family behind `easylm.gpt_oss.family.FAMILY`."""
