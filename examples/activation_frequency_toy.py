"""The activation-frequency toy example: 2 layers x 4 experts, 3 GPU experts.

    python examples/activation_frequency_toy.py

One global top-3 over the table picks (1, 2) = 0.9, (0, 3) = 0.8 and (0, 1) = 0.5.
"""

import torch

from tiermoe.compat import build_device_map, generate_gpu_experts_masks

activation_freq = torch.tensor([[0.1, 0.5, 0.3, 0.8],
                                [0.2, 0.4, 0.9, 0.1]])  # [layers, experts]
mask = generate_gpu_experts_masks(activation_freq, num_gpu_experts=3)
print("mask: [" + ",".join("[" + ",".join("T" if on else "F" for on in row) + "]" for row in mask.tolist()) + "]")
for (layer, expert), device in build_device_map(mask).items():
    print(f"layer {layer} expert {expert}: {device}")
