"""ONNX export: ``python -m tasks.<task> export`` (:mod:`tasks.export.command`), the shared writing and
ONNX Runtime checks (:mod:`tasks.export.onnx`) and one graph module per task."""
