"""Vision: datasets, training and evaluation loops for hpdl's vision models.

Classification (SOFT, ViT/PVT anchors) lives in :mod:`hpdl.vision.classify`; instance segmentation and
detection (SPRNet, Mask R-CNN and RetinaNet anchors) in :mod:`hpdl.vision.detect`. The models themselves are in
:mod:`hpdl.models`.
"""
