"""Model FLOP utilisation (MFU).

    MFU = flops_per_token(seq) * tokens_per_second / (peak_flops_per_device * devices)

`flops_per_token` is the model's training FLOPs per token, for LLaMA
6*N + 12*L*d_attn*seq (N matmul parameters, L layers, d_attn = heads*head_dim;
PaLM, appendix B). Rematerialisation is not counted: MFU measures useful work.

The peak is the dense (no sparsity) bf16 matmul rate of one JAX device, from
the vendors' datasheets: NVIDIA's A100, H100, H200, L4, L40S and B200 product
briefs, and Google Cloud's TPU system architecture pages (v2 and v3 list a chip
of two cores, each core a JAX device, so their figures are halved). An unknown
device (a CPU, a new chip) has no peak and MFU reads 'n/a' unless
`--peak_tflops` gives one.
"""

import jax

# (substring of jax.Device.device_kind, dense bf16 TFLOP/s per JAX device); first match wins.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("TPU v2", 22.5),
    ("TPU v3", 61.5),
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0),
    ("TPU v5", 459.0),  # v5p reports itself as 'TPU v5'
    ("TPU v6 lite", 918.0),
    ("TPU v6e", 918.0),
)


def peak_flops_per_device(device: jax.Device | None = None, override_tflops: float = 0.0):
    """Peak FLOP/s of one device: the override if > 0, else the table; None if unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = (device or jax.devices()[0]).device_kind
    for substring, tflops in PEAK_TFLOPS:
        if substring in kind:
            return tflops * 1e12
    return None


def mfu(flops_per_token: float, tokens_per_second: float, peak_per_device, num_devices: int):
    """Model FLOP utilisation in [0, 1], or None when the peak is unknown."""
    if not peak_per_device:
        return None
    return flops_per_token * tokens_per_second / (peak_per_device * num_devices)
