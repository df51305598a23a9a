"""What both ends of a weight sync need: digests here; bucketing and broadcast backends beside it.

`digest` needs no torch, so the broker and tests may import it; the broadcast
modules import torch and the broker never imports them.
"""
