"""The four tasks (``python -m tasks.classify|detect|segment|translate``) and, for Python,
``tasks.load(checkpoint)``: the trained model, ready for ``model.predict(inputs)`` (:mod:`tasks.api`)."""


def load(path, map_location="cpu"):
    """The model of a checkpoint written by this suite, as the task class it names, in evaluation mode
    (:func:`tasks.api.load`)."""
    from tasks.api import load as load_model

    return load_model(path, map_location)
