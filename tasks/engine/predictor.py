"""The Python API: a trained model from its checkpoint alone, predicting without a Trainer.

    import tasks

    model = tasks.load("runs/detect/checkpoints/last.ckpt")   # the task class the checkpoint names
    model.predict("photo.jpg")                                # one input -> one result
    model.predict(["a.jpg", pil_image, array])                # a list -> a list, in order

``Task.load_from_checkpoint(path)`` gives the same model for a known task. ``predict`` takes file
paths, PIL images, numpy arrays ((H, W, 3) uint8 RGB) or (3, H, W) uint8 tensors (classification,
detection, segmentation), or strings (translation), one or a list, and returns plain values in the
input's own coordinates:

- classification: ``[(class name, probability), ...]``, the ``top_k`` best, best first;
- detection: ``[{"box": [x1, y1, x2, y2], "score", "category_id", "category_name"}, ...]``, boxes in
  the original image's pixels, detections scoring at least ``score_threshold`` (default the model's
  ``display_score_threshold``, as `predict` writes them);
- segmentation: an (H, W) array of labels at the original size (label i is ``model.class_names[i]``);
- translation: the translated string.

Images are prepared as the CLI's `predict` prepares them: upright (a file's or a PIL image's EXIF
orientation applied, :func:`datamodules.images.read_rgb`), through the evaluation transform of the
input specification the checkpoint carries (:class:`datamodules.input_spec.InputSpec`), and the same
task methods turn the network's output into results. The model runs on its own device (``model.to("cuda")``)
in evaluation mode.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from datamodules.input_spec import InputSpec, input_spec_of, stored_input_spec


def load(path: str | Path, map_location: Any = "cpu"):
    """The model of a checkpoint written by this suite, as the task class it names (``suite_task``),
    in evaluation mode."""
    from tasks.engine.checkpoints import read_checkpoint

    name = read_checkpoint(path).get("suite_task")
    if not name:
        raise ValueError(f"{path} does not name its task (no suite_task entry): load it with the task class, "
                         "e.g. tasks.detect.DetectionTask.load_from_checkpoint(path)")
    module, class_name = name.rsplit(".", 1)
    task_class = getattr(importlib.import_module(module), class_name)
    return task_class.load_from_checkpoint(path, map_location=map_location, weights_only=True).eval()


# -- images in --------------------------------------------------------------------------------------------
def is_one_image(item: Any) -> bool:
    from PIL import Image

    return isinstance(item, (str, Path, Image.Image, np.ndarray, torch.Tensor))


def read_image(item: Any) -> tuple[torch.Tensor, str]:
    """An input -> ((3, H, W) uint8 upright RGB pixels, its name): a path is read by
    :func:`datamodules.images.read_rgb` (EXIF orientation applied), a PIL image is turned upright by its
    EXIF tag and a 16-bit one scaled as the same file would be (:func:`datamodules.images.pil_rgb`), an
    (H, W, 3) or (H, W) uint8 array and a (3, H, W) uint8 tensor are taken as they are."""
    from PIL import Image

    from datamodules.images import pil_rgb, read_rgb

    if isinstance(item, (str, Path)):
        return read_rgb(item), str(item)
    if isinstance(item, Image.Image):
        return pil_rgb(item).contiguous(), getattr(item, "filename", "") or ""
    if isinstance(item, torch.Tensor):
        if item.dtype != torch.uint8 or item.ndim != 3 or item.shape[0] != 3:
            raise ValueError(f"an image tensor must be (3, H, W) uint8 RGB, got {tuple(item.shape)} {item.dtype}")
        return item.cpu().contiguous(), ""
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or not (item.ndim == 2 or (item.ndim == 3 and item.shape[2] in (3, 4))):
            raise ValueError(f"an image array must be (H, W, 3) uint8 RGB (or (H, W) grey), got {item.shape} "
                             f"{item.dtype}")
        rgb = np.repeat(item[..., None], 3, axis=2) if item.ndim == 2 else item[..., :3]
        return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous(), ""
    raise TypeError(f"cannot predict on a {type(item).__name__}: give a file path, a PIL image, an (H, W, 3) uint8 "
                    "array or a (3, H, W) uint8 tensor")


# -- a checkpoint's weights and this model ---------------------------------------------------------------
def check_weights_fit(model: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint whose tensors have other shapes than ``model``'s (a resume after changing the
    backbone's width), naming the constructor arguments that differ from the checkpoint's
    (``model.backbone.init_args.width: checkpoint 0.25, this run 0.5``), before loading fails with a
    size-mismatch traceback that names neither. Called as the checkpoint is restored, before its weights."""
    saved = checkpoint.get("state_dict") or {}
    own = model.state_dict()
    wrong = [(key, tuple(value.shape), tuple(own[key].shape)) for key, value in saved.items()
             if key in own and hasattr(value, "shape") and tuple(value.shape) != tuple(own[key].shape)]
    if not wrong:
        return
    from tasks.engine.checkpoints import plain

    theirs, ours = dotted(plain(checkpoint.get("hyper_parameters") or {})), dotted(plain(dict(model.hparams)))
    changed = [f"model.{key}: checkpoint {theirs.get(key)!r}, this run {ours.get(key)!r}"
               for key in sorted(theirs.keys() | ours.keys())
               if not key.split(".")[-1].startswith("_") and key in theirs and key in ours and theirs[key] != ours[key]]
    key, saved_shape, own_shape = wrong[0]
    because = (f"its constructor arguments differ: {'; '.join(changed)}" if changed else
               "the saved constructor arguments are the same (was the model's code changed?)")
    raise ValueError(f"the checkpoint's weights do not fit this model: {len(wrong)} tensors have other shapes "
                     f"({key}: checkpoint {list(saved_shape)}, this model {list(own_shape)}); {because}. Give the "
                     "checkpoint's values to resume it, or train the new architecture from scratch (no --ckpt_path)")


def dotted(arguments: dict, prefix: str = "") -> dict[str, Any]:
    """Nested arguments -> ``{"backbone.init_args.width": 0.25, ...}``."""
    flat = {}
    for key, value in arguments.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class Predictor:
    """What a task adds to :class:`tasks.engine.base.TaskModule` for ``model.predict(inputs)`` (put it first among
    the bases: ``class DetectionTask(Predictor, TaskModule)``).

    The input specification: on ``fit`` (and on any run of a model that has none yet) it is the
    datamodule's ``input_spec`` (or, for a datamodule that states none, :attr:`input_spec_rule` applied
    to its arguments), whose mean and std :func:`datamodules.input_spec.resolve_preprocessing` decided;
    every checkpoint carries it as ``checkpoint["input_spec"]``, and loading one restores it
    (:func:`datamodules.input_spec.stored_input_spec`). A checkpoint without one (a Lightning checkpoint of
    another origin) gets it from the datamodule arguments Lightning saved beside the model
    (``datamodule_hyper_parameters``).

    A task implements :meth:`predict_inputs`, a list of inputs -> a list of results; :meth:`predict`
    batches, switches to evaluation mode and unwraps a single input.
    """

    #: the datamodule arguments -> :class:`InputSpec` rule, for datamodules without ``input_spec``; ``None``
    #: for a task whose input is no image
    input_spec_rule: Callable[[dict], InputSpec] | None = None
    input_spec: InputSpec | None = None
    #: inputs per forward of :meth:`predict`
    predict_batch_size = 8

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and (stage == "fit" or self.input_spec is None):
            self.input_spec = input_spec_of(datamodule, self.input_spec_rule) or self.input_spec

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.input_spec is not None:
            checkpoint["input_spec"] = self.input_spec.to_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        check_weights_fit(self, checkpoint)
        if self.input_spec is not None and self._fitting():
            return  # a resumed fit keeps the spec of the data it trains on
        self.input_spec = stored_input_spec(checkpoint, self.input_spec_rule) or self.input_spec

    def _fitting(self) -> bool:
        """Whether a Trainer runs ``fit`` with this model; ``False`` when none is attached (``tasks.load``)."""
        try:
            return self.trainer.state.fn == "fit"
        except RuntimeError:  # not attached to a Trainer
            return False

    def require_input_spec(self) -> InputSpec:
        if self.input_spec is None:
            raise RuntimeError(f"this {type(self).__name__} has no input specification (image size, mean, std): "
                               "load it from a checkpoint written by fit, or set model.input_spec = "
                               "datamodules.input_spec.InputSpec(...)")
        return self.input_spec

    # -- predict ----------------------------------------------------------------------------------------------
    def is_one_input(self, inputs: Any) -> bool:
        """Whether ``inputs`` is one input rather than a list of them."""
        return is_one_image(inputs)

    def predict_inputs(self, inputs: list, **options) -> list:
        """Results for a list of inputs (one batch)."""
        raise NotImplementedError

    def predict(self, inputs: Any, batch_size: int | None = None, **options) -> Any:
        """Results for one input, or a list of results for a list of inputs (see :mod:`tasks.engine.predictor`), ``batch_size``
        (default :attr:`predict_batch_size`) at a time. ``options`` are the task's own (``top_k``,
        ``score_threshold``, ``beam_size``)."""
        if batch_size is None:
            batch_size = self.predict_batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"predict: batch_size={batch_size!r}; give a positive number of inputs per forward "
                             f"(default {self.predict_batch_size})")
        # what is not a collection is one input, which the task names if it cannot read it (None, a number)
        single = self.is_one_input(inputs) or not isinstance(inputs, Iterable)
        items = [inputs] if single else list(inputs)
        was_training = self.training
        self.eval()
        try:
            with torch.inference_mode():
                results = [result for start in range(0, len(items), batch_size)
                           for result in self.predict_inputs(items[start:start + batch_size], **options)]
        finally:
            self.train(was_training)
        return results[0] if single else results

    def prepared_images(self, inputs: Sequence) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, str]]]:
        """(the network inputs (3, h, w), the upright pixels with their names) of a list of image inputs."""
        spec = self.require_input_spec()
        transform = spec.eval_transform()
        read = [read_image(item) for item in inputs]
        return [spec.prepare(pixels, transform) for pixels, _ in read], read
