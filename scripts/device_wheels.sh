#!/usr/bin/env bash
# Wheels for a GPU machine that has PyTorch and most of the scientific stack but not the suite's own
# requirements, for Python 3.12 on x86-64 Linux (the lent GPU machines' image: see README "On a GPU").
# The list is the project's dependency closure minus what that image already holds (torch,
# torchvision, lightning, torchmetrics, timm, onnx, onnxruntime, sentencepiece, sacrebleu, numpy, and
# transformers 5.17 for gpu_suite.py's MarianMTModel peer: device KINDS.md's package list).
# The wheels below come to ~49 MB of the 64 MiB a device call carries.
# wandb and its telemetry stack are left out: the GPU check logs to CSV (--trainer.logger false).
#
#   bash scripts/device_wheels.sh [.whl]        # here, with PyPI reachable
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site   # there
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
packages=(
  "jsonargparse[signatures,omegaconf]==4.53.0" docstring-parser==0.18.0 typeshed-client==2.15.0 omegaconf==2.4.0
  litdata==0.2.76 boto3==1.43.11 botocore==1.43.11 s3transfer==0.17.0 jmespath==1.1.0 obstore==0.12.1
  albumentations==2.0.8 albucore==0.0.24 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
  typing-inspection==0.4.2 simsimd==6.5.16 stringzilla==5.3.2
  pycocotools==2.0.11 faster-coco-eval==1.8.0 sacremoses==0.2.0 pycountry==26.2.16 babel==2.18.0
  platformdirs==4.14.8
)
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" "${packages[@]}"
du -sh "$dest"
