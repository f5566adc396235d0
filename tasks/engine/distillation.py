"""Knowledge distillation: a frozen teacher's logits as a second target (``--model.distillation.*``).

Losses, on logits with the classes on dim 1: (B, C) for classification, (B, C, H, W) for segmentation,
where each labelled pixel counts as a row (pixels the task's loss ignores are left out):

- soft (Hinton et al. 2015; timm ``task/distillation.py``, CVNets/CoreNet ``soft_kl_distillation``):
  ``KL(softmax(t / T) || softmax(s / T)) * T^2``, summed over classes and averaged over rows
  (``reduction="batchmean"``). DeiT's code (``losses.py``) divides the sum by rows x classes instead,
  which is this value over C; the suite follows timm and CVNets.
- hard (DeiT, Touvron et al. 2021, Sec. 3 "hard-label distillation"): cross-entropy with the
  teacher's argmax as the label.

Either is mixed with the task's own loss (cross-entropy with the data's label, a MixUp/CutMix soft
target included) as DeiT's ``DistillationLoss`` does: ``(1 - alpha) * task + alpha * distill``.
With DeiT's distillation token (``ViT(distillation_token=True)``) the task loss is the class head's
and the distillation loss the distillation head's; at ``kind="hard"``, ``alpha=0.5`` this is the
paper's ``1/2 CE(Z_s, y) + 1/2 CE(Z_dist, argmax Z_t)``.

The teacher (:class:`Teacher`) is no sub-module of the task: it is outside the optimizer, the
checkpoint's ``state_dict``, EMA (a deep copy of the task shares it), layer-decay groups, DDP's
gradient sync and compilation; it is built only when ``fit`` starts, so ``validate``/``test``/
``predict``/``export`` of the checkpoint never need it. It runs in eval mode under ``torch.no_grad``
on the student's device, in the student's parameter dtype, inside the same autocast as the
student's forward (Lightning's precision context around ``training_step``). Its weights come from:

- a checkpoint of this suite (``runs/.../best.ckpt``) of the same task, trained on the same classes;
- registered weights (:mod:`backbones.pretrained`, e.g. ``mobilevitv2_200.cvnets_in1k``), found as
  :func:`backbones.weights.load_pretrained` finds a backbone's (classification);
- ``timm:<model name>``: ``timm.create_model`` with the weights of ``teacher_file`` or timm's local
  cache (classification); this path downloads nothing.

Images reach the teacher normalised as the student's data are; a teacher trained on another mean and
std gets them re-normalised, ``(x * std_s + mean_s - mean_t) / std_t`` (timm's
``DistillationTeacher.normalize_input``).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence
from urllib.parse import urlparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.engine.cost import count_flops, count_parameters

KINDS = ("soft", "hard")


@dataclass
class Distillation:
    """What ``--model.distillation.*`` sets.

    Args:
        teacher: a checkpoint of this suite (``*.ckpt``), a registered weights name, or ``timm:<model name>``.
        kind: ``"soft"`` (KL at ``temperature``) or ``"hard"`` (cross-entropy on the teacher's argmax). With a
            student that has DeiT's distillation token, the distillation head learns from the teacher and the
            class head from the label.
        alpha: weight of the distillation loss; the task's loss gets ``1 - alpha`` (DeiT's
            ``--distillation-alpha``, default 0.5).
        temperature: softmax temperature of the soft loss (DeiT's ``--distillation-tau``, default 1.0; the
            paper's soft-distillation runs use 3.0 with alpha 0.1).
        teacher_file: for ``timm:<name>``, the weights file (a state dict: ``torch.save(model.state_dict())`` or
            timm's ``.safetensors``); without it timm's local cache is read.
    """

    teacher: str
    kind: Literal["soft", "hard"] = "soft"
    alpha: float = 0.5
    temperature: float = 1.0
    teacher_file: str | None = None

    def __post_init__(self):
        if not self.teacher:
            raise ValueError("distillation.teacher is empty: name a checkpoint, registered weights or timm:<model>")
        if self.kind not in KINDS:
            raise ValueError(f"distillation.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"distillation.alpha must be in [0, 1], got {self.alpha}")
        if not self.temperature > 0:
            raise ValueError(f"distillation.temperature must be positive, got {self.temperature}")

    @classmethod
    def of(cls, value: "Distillation | dict | None") -> "Distillation | None":
        """The configuration from what a task's constructor got: itself, a dict (a checkpoint's saved
        arguments), or ``None``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"distillation must be a Distillation or a dict of its fields, got {type(value).__name__}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- losses --------------------------------------------------------------------------------------------------
def soft_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
                           valid: torch.Tensor | None = None) -> torch.Tensor:
    """Student and teacher logits with classes on dim 1 ((N, C) rows, or (B, C, H, W) pixel maps) ->
    ``KL(softmax(t/T) || softmax(s/T)) * T^2``, summed over classes and averaged over the rows (pixels),
    only those where ``valid`` (shape without the class dim) is true; in float32."""
    student_log_p = F.log_softmax(student.float() / temperature, dim=1)
    teacher_log_p = F.log_softmax(teacher.float() / temperature, dim=1)
    per_row = F.kl_div(student_log_p, teacher_log_p, reduction="none", log_target=True).sum(1)
    return _mean(per_row, valid) * temperature ** 2


def hard_distillation_loss(student: torch.Tensor, teacher: torch.Tensor,
                           valid: torch.Tensor | None = None) -> torch.Tensor:
    """Logits with classes on dim 1 -> mean cross-entropy of the student with the teacher's argmax, over the rows
    (pixels) where ``valid`` is true."""
    return _mean(F.cross_entropy(student.float(), teacher.argmax(dim=1), reduction="none"), valid)


def _mean(values: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if valid is None:
        return values.mean()
    # an all-invalid batch gives 0, not NaN (no row to learn from)
    return (values * valid).sum() / valid.sum().clamp(min=1)


def distillation_loss(config: Distillation, student: torch.Tensor, teacher: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """The loss ``config.kind`` names, of logits with classes on dim 1."""
    if config.kind == "soft":
        return soft_distillation_loss(student, teacher, config.temperature, valid)
    return hard_distillation_loss(student, teacher, valid)


def mixed_loss(config: Distillation, task_loss: torch.Tensor, distill: torch.Tensor) -> torch.Tensor:
    """``(1 - alpha) * task_loss + alpha * distill`` (DeiT's ``DistillationLoss``)."""
    return (1.0 - config.alpha) * task_loss + config.alpha * distill


# -- the teacher ---------------------------------------------------------------------------------------------
class Teacher:
    """A frozen network and the normalisation it was trained on, called on the student's images.

    Not an ``nn.Module``: a task holding one keeps it out of its parameters, state dict, children (so
    out of the optimizer, EMA averaging, layer-decay groups, DDP and compilation), and a deep copy of
    the task (Lightning's ``EMAWeightAveraging``) shares it instead of copying it.

    Args:
        network: returns logits (B, C) (or a task's output, e.g. segmentation's ``{"out": ...}``).
        name: what the configuration named, for messages.
        mean, std: the normalisation of the teacher's training input; ``None`` where unknown (taken to be
            the student's).
    """

    def __init__(self, network: nn.Module, name: str, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None):
        self.network = network.eval().requires_grad_(False)
        self.name = name
        self.mean = tuple(float(v) for v in mean) if mean is not None else None
        self.std = tuple(float(v) for v in std) if std is not None else None
        self._renormalise: tuple[torch.Tensor, torch.Tensor] | None = None
        self._student_normalisation: tuple | None = None

    def __deepcopy__(self, memo) -> "Teacher":
        return self

    def __call__(self, images: torch.Tensor, like: torch.Tensor, student_mean: Sequence[float] | None = None,
                 student_std: Sequence[float] | None = None) -> Any:
        """The teacher's output for (B, 3, H, W) ``images`` normalised with the student's ``student_mean`` /
        ``student_std``, computed without gradients on the device and in the dtype of ``like`` (a student
        parameter), under whatever autocast the caller runs in."""
        self._follow(like)
        if self.network.training:  # whoever switched it to training: a teacher's BatchNorm never updates
            self.network.eval()
        with torch.no_grad():
            return self.network(self._normalised(images, student_mean, student_std))

    def _follow(self, like: torch.Tensor) -> None:
        """Move the network to ``like``'s device and floating dtype (a no-op once it is there)."""
        current = next(self.network.parameters(), None)
        if current is not None and (current.device != like.device or current.dtype != like.dtype):
            self.network.to(device=like.device, dtype=like.dtype)
            self._renormalise = None

    def _normalised(self, images: torch.Tensor, student_mean, student_std) -> torch.Tensor:
        if self.mean is None or student_mean is None:
            return images
        student = (tuple(float(v) for v in student_mean), tuple(float(v) for v in student_std))
        if student == (self.mean, self.std):
            return images
        if self._renormalise is None or self._student_normalisation != student:
            mean_s, std_s, mean_t, std_t = (torch.tensor(v, device=images.device).view(1, -1, 1, 1)
                                            for v in (*student, self.mean, self.std))
            # x_t = (x * std_s + mean_s - mean_t) / std_t, as one multiply-add
            self._renormalise = (std_s / std_t, (mean_s - mean_t) / std_t)
            self._student_normalisation = student
        scale, shift = self._renormalise
        return images * scale.to(images.dtype) + shift.to(images.dtype)

    def cost(self, image_size: int | None) -> dict[str, float]:
        """``{"params"}`` and, at ``image_size``, ``{"gflops"}`` of one image through the teacher."""
        cost: dict[str, float] = {"params": count_parameters(self.network)}
        if image_size:
            device = next(self.network.parameters()).device
            cost["gflops"] = count_flops(self.network, torch.zeros(1, 3, image_size, image_size, device=device)) / 1e9
        return cost


class ImageClassifier(nn.Module):
    """A registered backbone and its classifier, (B, 3, H, W) -> (B, C): the teacher made of registered weights."""

    def __init__(self, backbone: nn.Module, num_classes: int):
        super().__init__()
        from heads.classifier import ClassifierHead

        self.backbone = backbone
        self.head = ClassifierHead(backbone.num_features, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_pooled(images))


def load_teacher(config: Distillation, task_class: type, class_names: Sequence[str],
                 image_classifier: bool = True) -> Teacher:
    """The teacher ``config.teacher`` names, for a student of ``task_class`` over ``class_names``; refuses
    a teacher of another task or another class count (or, for a checkpoint of this suite, other classes),
    and weights that are not on this machine. Registered weights and timm models are image classifiers:
    a student that is not one (``image_classifier=False``) takes only a checkpoint of its own task."""
    name = config.teacher
    is_checkpoint = name.endswith(".ckpt") or Path(name).expanduser().is_file()
    if not image_classifier and not is_checkpoint:
        raise ValueError(f"distillation teacher {name!r}: a {task_class.__name__} learns only from a checkpoint of "
                         "its own task (registered weights and timm models are image classifiers)")
    if name.startswith("timm:"):
        return _timm_teacher(name[len("timm:"):], len(class_names), config.teacher_file)
    if config.teacher_file:
        raise ValueError(f"distillation.teacher_file is for a timm:<model> teacher, not for {name!r}")
    if is_checkpoint:
        return _checkpoint_teacher(name, task_class, class_names)
    return _registered_teacher(name, len(class_names))


def _checkpoint_teacher(path: str, task_class: type, class_names: Sequence[str]) -> Teacher:
    from tasks.engine.checkpoints import check_checkpoint_file

    check_checkpoint_file(path, task_class)  # a missing, truncated or other task's file is named
    model = task_class.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    teacher_classes = list(getattr(model, "class_names", class_names))
    if teacher_classes != list(class_names):
        raise ValueError(f"teacher {path} was trained on {len(teacher_classes)} classes "
                         f"({', '.join(teacher_classes[:6])}{', ...' if len(teacher_classes) > 6 else ''}), the "
                         f"student on {len(class_names)} ({', '.join(list(class_names)[:6])}"
                         f"{', ...' if len(class_names) > 6 else ''}): a teacher must score the student's classes "
                         "in the student's order")
    spec = getattr(model, "input_spec", None)
    return Teacher(model, path, *((spec.mean, spec.std) if spec is not None else (None, None)))


def _registered_teacher(name: str, num_classes: int) -> Teacher:
    from backbones.pretrained import find_weights
    from backbones.registry import BACKBONES
    from backbones.weights import load_pretrained

    entry = find_weights(name)  # an unknown name is refused with the closest registered ones
    if entry is None:
        raise FileNotFoundError(f"distillation teacher {name!r} is no file, registered weights name or timm:<model>")
    backbone = BACKBONES.get(entry.backbone)(**entry.arguments)
    head = load_pretrained(backbone, name)  # a missing file is refused, saying where the weights come from
    weight = head.get("head.fc.weight")
    if weight is None or weight.shape[0] != num_classes:
        found = "no classifier" if weight is None else f"a {weight.shape[0]}-class classifier"
        raise ValueError(f"teacher {name} has {found}; the student has {num_classes} classes: a teacher must "
                         "score the student's classes")
    network = ImageClassifier(backbone, num_classes)
    network.head.fc.load_state_dict({"weight": weight, "bias": head["head.fc.bias"]})
    return Teacher(network, name, entry.preprocessing.mean, entry.preprocessing.std)


def _timm_teacher(model_name: str, num_classes: int, teacher_file: str | None) -> Teacher:
    try:
        import timm
        from timm.models import load_state_dict
    except ImportError:  # timm is among the suite's dev extras, not its requirements
        raise ImportError(f"the teacher timm:{model_name} needs timm: pip install timm") from None

    if not timm.is_model(model_name):
        close = timm.list_models(f"*{model_name.split('.')[0].split('_')[0]}*")[:5]
        raise ValueError(f"timm has no model {model_name!r} (similar: {', '.join(close) or 'none'})")
    pretrained_cfg = timm.models.get_pretrained_cfg(model_name)
    cfg = pretrained_cfg.to_dict() if pretrained_cfg is not None else {}
    file = Path(teacher_file).expanduser() if teacher_file else _timm_cached_file(cfg)
    if file is None or not file.is_file():
        where = f"{file}, which does not exist" if file is not None else "timm's local cache, which holds none"
        raise FileNotFoundError(
            f"weights of the timm teacher {model_name} were looked for in {where}. Nothing is downloaded at run time: "
            f"on a machine with internet run timm.create_model({model_name!r}, pretrained=True) (it fills the cache) "
            "or torch.save(that_model.state_dict(), FILE), and give --model.distillation.teacher_file FILE")
    state_dict = load_state_dict(str(file))
    classifier = cfg.get("classifier") or "head"
    classifier = classifier[0] if isinstance(classifier, (list, tuple)) else classifier
    weight = state_dict.get(f"{classifier}.weight")
    file_classes = int(weight.shape[0]) if weight is not None else cfg.get("num_classes")
    if file_classes != num_classes:
        raise ValueError(f"timm teacher {model_name} ({file}) has a {file_classes}-class classifier; the student has "
                         f"{num_classes} classes: a teacher must score the student's classes")
    network = timm.create_model(model_name, pretrained=True, num_classes=num_classes,
                                pretrained_cfg_overlay={"file": str(file), "num_classes": num_classes})
    return Teacher(network, f"timm:{model_name}", cfg.get("mean"), cfg.get("std"))


def _timm_cached_file(cfg: dict) -> Path | None:
    """Where timm's loader would have cached the weights of ``cfg`` (the Hugging Face hub's cache, else
    torch.hub's), or ``None``; this looks, it never downloads."""
    hub_id = cfg.get("hf_hub_id")
    if hub_id:
        from huggingface_hub import try_to_load_from_cache

        for filename in (cfg.get("hf_hub_filename"), "model.safetensors", "pytorch_model.bin"):
            if filename:
                found = try_to_load_from_cache(hub_id, filename)
                if isinstance(found, str):
                    return Path(found)
    url = cfg.get("url")
    if url:
        cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
        if cached.is_file():
            return cached
    return None


# -- what a task adds ------------------------------------------------------------------------------------------
class LearnsFromTeacher:
    """What a task adds to :class:`tasks.engine.base.TaskModule` to distil (put it first among the bases:
    ``class ClassificationTask(LearnsFromTeacher, Predictor, TaskModule)``; it needs ``class_names`` and,
    from :class:`tasks.engine.predictor.Predictor`, ``input_spec``).

    The task calls :meth:`init_distillation` in its constructor and :meth:`teacher_output` in its training
    loss. The teacher is built when ``fit`` sets the task up, on every rank, after the input specification
    of the data is known; other commands never build it.
    """

    #: the configuration (``None``: no distillation) and, while fitting, the teacher
    distillation: Distillation | None = None
    teacher: Teacher | None = None
    #: whether registered weights and timm models can teach this task (they are image classifiers)
    teacher_is_image_classifier: bool = True

    def init_distillation(self, distillation: Distillation | dict | None) -> None:
        self.distillation = Distillation.of(distillation)
        if self.distillation is not None:
            # plain values, which a weights-only checkpoint can hold and load_from_checkpoint hands back
            self.hparams["distillation"] = self.distillation.as_dict()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self.distillation is not None and self.teacher is None:
            from lightning.pytorch.utilities import rank_zero_info

            self.teacher = load_teacher(self.distillation, type(self), self.class_names,
                                        self.teacher_is_image_classifier)
            rank_zero_info(self.teacher_report())

    def teacher_output(self, images: torch.Tensor) -> Any:
        """The teacher's output for a training batch's (B, 3, H, W) images (normalised for the student)."""
        if self.teacher is None:
            raise RuntimeError("the teacher is built when fit sets the task up (setup('fit')); call that first")
        spec = getattr(self, "input_spec", None)
        like = next(self.parameters())
        return self.teacher(images, like, spec.mean if spec else None, spec.std if spec else None)

    def teacher_report(self) -> str:
        """One line: the distillation and what the teacher costs beside the student (parameters, and
        GFLOPs per image at the data's size where it is known)."""
        config, example = self.distillation, self.example_input_array
        size = example.shape[-1] if isinstance(example, torch.Tensor) else None
        try:  # the FLOP count runs the teacher once at the data's size: a teacher that cannot take it stops here
            teacher = self.teacher.cost(size)
        except (ValueError, RuntimeError, AssertionError) as err:
            raise ValueError(f"distillation teacher {self.teacher.name} does not take the student's {size} px images "
                             f"({err}): a teacher sees the student's batch as it is") from None
        student = self.model_cost()
        at = f" per {size} px image" if size else ""

        def show(cost: dict) -> str:
            flops = f", {cost['gflops']:.3g} GFLOPs" if "gflops" in cost else ""
            return f"{cost['params'] / 1e6:.3g}M params{flops}"

        loss = f"soft KL at T={config.temperature}" if config.kind == "soft" else "hard (teacher's argmax)"
        return (f"distillation: {loss}, alpha={config.alpha}, teacher {self.teacher.name} ({show(teacher)}{at}; "
                f"the student {show(student)}); the teacher runs in eval mode without gradients, not saved")
