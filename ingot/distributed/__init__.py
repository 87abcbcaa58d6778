"""Tensor parallelism's process group and collectives: a thin layer over torch.distributed.

``parallel.py`` says which part of a dimension a rank owns; ``collectives.py``
holds the collectives the layers and the runner call; ``process_group.py``
creates and tears down the group.
"""
