"""The trainer: its flags and run defaults, the train state and steps, setup, the loop and its hooks; the optimizers, the training log and the run lock."""
