"""What a run trains for: next-token prediction and the preference objectives (DPO, SimPO, ORPO), behind one `Objective` interface."""
