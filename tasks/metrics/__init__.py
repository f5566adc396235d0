"""Benchmark metrics, each equal to the reference implementation it names (pycocotools, the VOC devkit,
mmsegmentation's mIoU, sacreBLEU, Moses' tokenizer with multi-bleu.perl)."""
