"""Commands over finished runs; they define no LightningModule: ``python -m tasks.tools.report`` (runs ->
table, CSV, plot) and ``python -m tasks.tools.average_checkpoints`` (the last N checkpoints -> one)."""
