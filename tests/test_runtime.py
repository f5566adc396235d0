"""tasks.cli.runtime: a freed tensor's memory serves the next one without faulting its pages in again."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# two training steps of a MobileViTv2-0.5 (batch 8, 128 px) after a warm-up step: the minor page
# faults they cost
PROBE = """
import resource, torch
from tasks.cli.runtime import reuse_freed_memory
applied = reuse_freed_memory()
torch.set_num_threads(1)
from backbones import MobileViTv2
model = MobileViTv2(width=0.5)
images = torch.randn(8, 3, 128, 128)
def step():
    model.forward_pooled(images).sum().backward()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(system_malloc: bool) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "SUITE_SYSTEM_MALLOC"}
    if system_malloc:
        env["SUITE_SYSTEM_MALLOC"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.slow  # ~10 s of page-fault counting
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    applied, faults = probe(system_malloc=False)
    # glibc's defaults (the opt-out): each step maps its activations afresh and faults every page in
    kept_default, faults_default = probe(system_malloc=True)
    assert applied and not kept_default
    assert faults * 2 < faults_default, (faults, faults_default)  # measured: 3.5-10x fewer


@pytest.mark.parametrize("task, recipe, autotune, matmul", [
    ("classify", "imagenet_mobilevitv2_200.yaml", True, "highest"),  # bf16-mixed, fixed 256 px crops
    ("detect", "coco_ssdlite_mobilevitv2_100.yaml", True, "highest"),
    ("segment", "ade20k_deeplabv3_mobilevitv2_100.yaml", True, "highest"),
    ("translate", "wmt14_en_de_transformer_base.yaml", False, "highest"),  # token batches change shape
    ("classify", "demo_mobilevitv2.yaml", True, "high"),  # 32-true: TF32 matmuls
    ("translate", "demo_transformer.yaml", False, "high"),
])
def test_cuda_speed_settings_per_recipe(task, recipe, autotune, matmul):
    import yaml

    from tasks.cli.runtime import cuda_speed_settings

    trainer = yaml.safe_load((REPO / "configs" / task / recipe).read_text())["trainer"]
    assert cuda_speed_settings(task, trainer) == {"benchmark": autotune, "float32_matmul_precision": matmul}


def test_cuda_speed_settings_leave_a_recipes_choice_and_determinism_alone():
    from tasks.cli.runtime import cuda_speed_settings

    assert cuda_speed_settings("classify", {"benchmark": False})["benchmark"] is None  # Lightning applies the recipe's
    assert cuda_speed_settings("classify", {"deterministic": True}) == {"benchmark": False,
                                                                      "float32_matmul_precision": "highest"}
