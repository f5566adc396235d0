"""How a command runs: the LightningCLI every task runs (:mod:`tasks.cli.suite`), ``tasks.run``
(:mod:`tasks.cli.run`), and what a run needs around the task module: ``last.ckpt`` on its own schedule,
atomic checkpoint files, the resume checks and the run lock, pre-emption, progress lines, threads and
memory, and the determinism check."""
