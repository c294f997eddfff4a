"""MiniMax-M2 (`minimax_m2`): `easylm.minimax_m2.family.FAMILY`."""
