"""What every task shares: the LightningModule base, the CLI and its one config merge, checkpoints,
pre-emption and resume, progress lines, and the predictor behind ``tasks.load``."""
