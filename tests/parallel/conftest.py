"""The parallel tests share two CPU cores with everything else: one thread per process."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
