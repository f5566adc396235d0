"""What a task module is: the LightningModule base and its non-finite-loss guard, the optimizer's parameter
groups and schedules, the predictor behind ``tasks.load``, the compile report, the model's cost, and what a
checkpoint file holds."""
