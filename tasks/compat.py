"""The one place where the suite reaches into a library's private names.

Everything else uses public APIs. Each access here says why no public API does it, and
``tests/test_compat.py`` fails naming the library version and the private name when an upgrade
removes or changes one, so an upgrade breaks loudly here instead of silently elsewhere.
"""
from __future__ import annotations

#: (module, private name, what the suite uses it for): checked by tests/test_compat.py
PRIVATE_NAMES = [
    ("lightning.pytorch.core.mixins.hparams_mixin", "_given_hyperparameters",
     "tasks.base: is LightningCLI building this model (save its resolved config) or plain Python"),
]


def built_by_lightning_cli() -> bool:
    """True while LightningCLI instantiates a model with ``load_from_checkpoint`` support.

    Then ``save_hyperparameters`` stores LightningCLI's resolved config (class paths and their
    arguments), which a weights-only checkpoint can hold and ``load_from_checkpoint`` rebuilds;
    built in plain Python, the model must leave out the modules and callables it was given.
    Lightning tells the two apart only through this context variable, which
    ``save_hyperparameters`` reads itself; no public API exposes it (Lightning 2.6)."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

    return _given_hyperparameters.get() is not None
