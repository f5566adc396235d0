"""The attention zoo lives in :mod:`layers.attention`; this name keeps older import paths
(``backbones.attention.build_attention`` and the class names) working."""
from layers.attention import *  # noqa: F401,F403
from layers.attention import __all__  # noqa: F401
