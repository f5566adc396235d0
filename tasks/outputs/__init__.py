"""What `test` and `predict` write, as Lightning callbacks: the task modules compute (forward, loss, metric
updates) and hand their step outputs and computed metrics to these; one callback per output file, shared ones in
:mod:`tasks.outputs.common`, each task's in ``tasks/outputs/<task>.py``; tables and pictures reach the run's loggers
through :mod:`tasks.outputs.media`."""
